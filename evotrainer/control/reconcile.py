"""Reconcile: make the recorded reality (runs/ on each version branch) match the specs.

Level-triggered, like a Kubernetes controller: every pass re-derives the state of every
version from git and the backend, plans the next action for each, and applies it with one
commit per state change. Nothing is remembered between passes, so a pass that crashed is
repaired by the next one:

- a run record (state Pending, deterministic job id) is committed *before* the launch, and
  the backend adopts a job it already knows instead of launching it again;
- records are written in one commit each (plumbing: no half-written file is ever committed);
- promotion merges into `main`, pruning tags `pruned/<v>`; nothing is deleted.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from evotrainer import API_VERSION
from evotrainer.agent.skills import pending_evidence, record_evidence
from evotrainer.backends import get_backend
from evotrainer.backends.base import Backend, JobSpec, JobState, job_id
from evotrainer.control.gate import decide, recorded_scores
from evotrainer.control.lineage import tree_order
from evotrainer.diagnosis.diagnose import diagnose, diagnosis_document
from evotrainer.diagnosis.harness import HarnessRevision, resolve_harness
from evotrainer.errors import EvoError
from evotrainer.store import specs
from evotrainer.store.clock import now_iso
from evotrainer.store.git import PRUNED_TAG_PREFIX, branch_name
from evotrainer.store.recipe import deep_merge, digest
from evotrainer.store.workspace import VersionState, Workspace, run_path

# Hard exit after the N-th action boundary: the crash-safety tests walk N over every one.
FAULT_ENV = "EVOTRAINER_FAULT_AFTER"


@dataclass
class Action:
    # approve | launch | poll | collect | diagnose | rediagnose | gate | promote | prune |
    # evidence | retry | fail: each applied by the Reconciler method of the same name
    kind: str
    reason: str


@dataclass
class VersionPlan:
    version: str
    sync: str  # Synced | OutOfSync | Drifted
    health: str  # Pending | Running | Succeeded | Failed | Stalled | —
    action: Action | None  # the next state change; None: nothing to do now
    note: str = ""  # why nothing happens (awaiting approval, waiting for parent, ...)

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "sync": self.sync,
            "health": self.health,
            "action": self.action.kind if self.action else None,
            "reason": self.action.reason if self.action else self.note,
        }


@dataclass
class Context:
    """Everything a pass reads once: specs and records from git, the harness in force."""

    ws: Workspace
    states: dict[str, VersionState]
    harness: HarnessRevision
    backends: dict[str, Backend] = field(default_factory=dict)

    def backend(self, name: str) -> Backend:
        if name not in self.backends:
            self.backends[name] = get_backend(name, self.ws.artifact_root / "cache")
        return self.backends[name]


def load_context(ws: Workspace, backends: dict[str, Backend] | None = None) -> Context:
    harness_name = ws.project.get("harness", "h0")
    return Context(ws, ws.versions(), resolve_harness(harness_name, ws.root), dict(backends or {}))


# ---- planning -------------------------------------------------------------------------


def job_recipe(ctx: Context, state: VersionState) -> dict:
    """The recipe the backend runs: an evaluation-only version trains for 0 steps."""
    recipe = ctx.ws.resolved_recipe(state.name, ctx.states)
    if state.spec.get("train") is False:
        recipe = deep_merge(recipe, {"grpo": {"steps": 0}})
    return recipe


def job_for(ctx: Context, state: VersionState, run: dict) -> JobSpec:
    return JobSpec(
        job_id=run["job_id"],
        version=state.name,
        recipe=job_recipe(ctx, state),
        workdir=ctx.ws.worktree_path(state.name),
        artifact_dir=ctx.ws.root / run["artifact_dir"],
    )


def plan_version(ctx: Context, state: VersionState) -> VersionPlan:
    if state.spec is None:
        return VersionPlan(
            state.name,
            "OutOfSync",
            "—",
            None,
            "spec missing or unreadable: run `evotrainer validate`",
        )
    run = state.records.get("run")
    spec_digest = state.spec_digest
    if run is None:
        if not state.approved:
            if _auto_approvable(ctx, state):
                return VersionPlan(
                    state.name,
                    "OutOfSync",
                    "—",
                    Action("approve", "autonomy allows it within budget"),
                )
            return VersionPlan(
                state.name,
                "OutOfSync",
                "—",
                None,
                f"awaiting approval: evotrainer approve {state.name}",
            )
        if not _slot_free(ctx):
            return VersionPlan(
                state.name, "OutOfSync", "—", None, "waiting: max_concurrent_jobs reached"
            )
        return VersionPlan(state.name, "OutOfSync", "—", Action("launch", "approved, never run"))

    health = run["state"]
    drifted = run.get("spec_digest") != spec_digest
    sync = "Drifted" if drifted else "Synced"
    if drifted and _reapproved_after(state, run):
        return VersionPlan(
            state.name,
            sync,
            health,
            Action("retry", "spec changed after the run and was re-approved"),
        )
    if health in ("Pending", "Running", "Stalled"):
        status = ctx.backend(run["backend"]).status(job_for(ctx, state, run))
        if status.state is JobState.SUCCEEDED:
            return VersionPlan(state.name, sync, "Succeeded", Action("collect", "job finished"))
        if status.state in (JobState.FAILED, JobState.UNKNOWN):
            why = (
                status.detail
                if status.state is JobState.FAILED
                else ("the backend has no record of the job (artifact dir missing?)")
            )
            if health == "Pending" and status.state is JobState.UNKNOWN:
                return VersionPlan(
                    state.name, sync, health, Action("launch", "run recorded but job never started")
                )
            return VersionPlan(state.name, sync, "Failed", Action("fail", why))
        if status.state.value != health:
            return VersionPlan(
                state.name, sync, status.state.value, Action("poll", f"job is {status.state.value}")
            )
        return VersionPlan(state.name, sync, health, None, f"job {status.state.value.lower()}")
    if health == "Failed":
        if run["attempt"] < ctx.ws.project.get("max_attempts", 2) and not drifted:
            return VersionPlan(
                state.name, sync, health, Action("retry", f"attempt {run['attempt']} failed")
            )
        return VersionPlan(
            state.name,
            sync,
            health,
            None,
            f"failed after {run['attempt']} attempt(s); kept as negative evidence",
        )
    if drifted:
        return VersionPlan(
            state.name,
            sync,
            health,
            None,
            f"spec changed after the run: re-approve to retrain (evotrainer approve {state.name})",
        )

    parent = ctx.states.get(state.parent) if state.parent else None
    parent_ready = parent is None or (parent.records.get("run") or {}).get("state") == "Succeeded"
    diagnosis = state.records.get("diagnosis")
    if diagnosis is None:
        if not parent_ready:  # the version layer compares with the parent's scores
            return VersionPlan(
                state.name, sync, health, None, f"waiting for parent {parent.name} to be evaluated"
            )
        return VersionPlan(state.name, sync, health, Action("diagnose", "evidence collected"))
    if diagnosis["harness"]["digest"] != ctx.harness.digest:
        return VersionPlan(
            state.name,
            sync,
            health,
            Action(
                "rediagnose",
                f"harness changed: {diagnosis['harness']['name']} → "
                f"{ctx.harness.name} (no retraining)",
            ),
        )
    decision = state.records.get("decision")
    if decision is None or (decision.get("harness") or {}).get("digest") != ctx.harness.digest:
        if parent is not None and parent.records.get("diagnosis") is None:
            return VersionPlan(
                state.name, sync, health, None, f"waiting for parent {parent.name} to be evaluated"
            )
        return VersionPlan(state.name, sync, health, Action("gate", "diagnosed, not yet gated"))
    verdict = decision["verdict"]
    if verdict in ("promote", "baseline") and not _on_main(ctx, state):
        return VersionPlan(state.name, sync, health, Action("promote", f"verdict {verdict}"))
    if verdict == "prune" and state.name not in ctx.ws.git.tags(PRUNED_TAG_PREFIX):
        return VersionPlan(state.name, sync, health, Action("prune", "verdict prune"))
    if pending_evidence(ctx.ws, state.name, decision, ctx.states):
        return VersionPlan(
            state.name,
            sync,
            health,
            Action("evidence", f"file the {verdict} on the skills it applied"),
        )
    return VersionPlan(state.name, sync, health, None, f"done: {verdict}")


def plan(ctx: Context) -> list[VersionPlan]:
    return [plan_version(ctx, ctx.states[name]) for name in tree_order(ctx.states)]


def _on_main(ctx: Context, state: VersionState) -> bool:
    main = ctx.ws.git.rev("refs/heads/main")
    return main is not None and ctx.ws.git.is_ancestor(state.sha, main)


def _active_jobs(ctx: Context) -> int:
    return sum(
        (s.records.get("run") or {}).get("state") in ("Pending", "Running")
        for s in ctx.states.values()
    )


def _slot_free(ctx: Context) -> bool:
    limit = (ctx.ws.project.get("autonomy") or {}).get("max_concurrent_jobs", 1)
    return _active_jobs(ctx) < limit


def _reapproved_after(state: VersionState, run: dict) -> bool:
    approved_at = (state.spec.get("approval") or {}).get("at", "")
    return state.approved and approved_at > run.get("created_at", "")


def steps_spent(ctx: Context) -> int:
    """Training steps of every run recorded so far (the autonomy budget's unit)."""
    total = 0
    for state in ctx.states.values():
        run = state.records.get("run") or {}
        total += int((run.get("result") or {}).get("steps_done") or 0)
        total += sum(int(a.get("steps", 0)) for a in run.get("attempts") or [])
    return total


def _auto_approvable(ctx: Context, state: VersionState) -> bool:
    autonomy = ctx.ws.project.get("autonomy") or {}
    if autonomy.get("mode") != "auto" or (state.spec.get("proposal") or {}).get("escalation"):
        return False  # an escalation (rollback after repeated failures) waits for a human
    steps = 0 if state.spec.get("train") is False else job_recipe(ctx, state)["grpo"]["steps"]
    budget = autonomy.get("max_total_steps")
    return budget is None or steps_spent(ctx) + steps <= budget


# ---- applying -------------------------------------------------------------------------


class Reconciler:
    def __init__(
        self,
        ws: Workspace,
        log: Callable[[str], None] = print,
        backends: dict[str, Backend] | None = None,
    ) -> None:
        self.ws = ws
        self.backends = backends  # None: the recipe's backend by name
        self.log = log
        self._boundaries = 0
        self._fault_after = int(os.environ.get(FAULT_ENV, "0"))

    def boundary(self) -> None:
        """An action boundary: state is consistent here, so a crash here must be harmless."""
        self._boundaries += 1
        if self._fault_after and self._boundaries == self._fault_after:
            os._exit(99)

    def pass_once(self) -> tuple[list[VersionPlan], int]:
        """Plan every version from fresh state, apply every action; return plans and count."""
        applied = 0
        ctx = load_context(self.ws, self.backends)
        plans = plan(ctx)
        for version_plan in plans:
            if version_plan.action is None:
                continue
            # Earlier actions of this pass changed git: re-read before acting.
            ctx = load_context(self.ws, self.backends)
            current = plan_version(ctx, ctx.states[version_plan.version])
            if current.action is None:
                continue
            self.apply(ctx, ctx.states[current.version], current.action)
            applied += 1
            self.boundary()
        return plans, applied

    def run(
        self,
        wait: bool = False,
        poll_s: float = 2.0,
        on_wait: Callable[[list[VersionPlan]], None] | None = None,
    ) -> list[VersionPlan]:
        """Apply until nothing is left to do now (and, with `wait`, no job is running)."""
        while True:
            plans, applied = self.pass_once()
            if applied:
                continue
            running = [p for p in plans if p.health in ("Pending", "Running")]
            if not (wait and running):
                return plans
            if on_wait:
                on_wait(running)
            time.sleep(poll_s)

    def apply(self, ctx: Context, state: VersionState, action: Action) -> None:
        self.log(f"{state.name}: {action.kind} ({action.reason})")
        getattr(self, f"_{action.kind}")(ctx, state)

    # One method per action; each ends in exactly one commit (or one backend call).

    def _commit_run(self, state: VersionState, run: dict, message: str, action: str) -> None:
        self.ws.git.commit_files(
            branch_name(state.name),
            {run_path(state.name, "run.yaml"): record_text("run", run).encode()},
            message,
            {"Action": action, "Version": state.name},
        )

    def _approve(self, ctx: Context, state: VersionState) -> None:
        from evotrainer.control.versions import approve

        approve(self.ws, state.name, by="evotrainer autonomy")

    def _launch(
        self,
        ctx: Context,
        state: VersionState,
        attempt: int | None = None,
        history: list | None = None,
    ) -> None:
        previous = state.records.get("run") or {}
        attempt = attempt or previous.get("attempt", 1)
        recipe = job_recipe(ctx, state)
        ctx.backend(recipe["backend"]).check(recipe)
        recipe_digest = digest(recipe)
        jid = job_id(state.name, attempt, recipe_digest)
        run = {
            "apiVersion": API_VERSION,
            "kind": "Run",
            "version": state.name,
            "attempt": attempt,
            "job_id": jid,
            "backend": recipe["backend"],
            "spec_digest": state.spec_digest,
            "recipe_digest": recipe_digest,
            "train": state.spec.get("train", True),
            "state": "Pending",
            "created_at": previous.get("created_at")
            if previous.get("job_id") == jid
            else now_iso(),
            "artifact_dir": str(self.ws.artifact_dir(state.name, jid).relative_to(self.ws.root)),
        }
        if history or previous.get("attempts"):
            run["attempts"] = history if history is not None else previous["attempts"]
        if previous.get("job_id") != jid or previous.get("state") != "Pending":
            self._commit_run(state, run, f"Launch {state.name} attempt {attempt} ({jid})", "launch")
            self.boundary()
        workdir = self.ws.git.worktree_add(
            self.ws.worktree_path(state.name), self._spec_commit(state)
        )
        job = JobSpec(jid, state.name, recipe, workdir, self.ws.root / run["artifact_dir"])
        ctx.backend(recipe["backend"]).submit(job)

    def _spec_commit(self, state: VersionState) -> str:
        """The commit that last changed the version's spec: what the worktree trains from."""
        path = f"spec/versions/{state.name}.yaml"
        return self.ws.git.repo.git.log("-1", "--format=%H", state.sha, "--", path)

    def _retry(self, ctx: Context, state: VersionState) -> None:
        run = state.records["run"]
        history = list(run.get("attempts") or []) + [
            {
                "attempt": run["attempt"],
                "job_id": run["job_id"],
                "state": run["state"],
                "detail": run.get("detail", ""),
                "steps": int((run.get("result") or {}).get("steps_done") or 0),
            }
        ]
        self._launch(ctx, state, attempt=run["attempt"] + 1, history=history)

    def _poll(self, ctx: Context, state: VersionState) -> None:
        run = dict(state.records["run"])
        status = ctx.backend(run["backend"]).status(job_for(ctx, state, run))
        run["state"] = status.state.value
        run.setdefault("started_at", now_iso())
        self._commit_run(state, run, f"{state.name}: job {status.state.value}", "poll")

    def _fail(self, ctx: Context, state: VersionState) -> None:
        run = dict(state.records["run"])
        job = job_for(ctx, state, run)
        backend = ctx.backend(run["backend"])
        status = backend.status(job)
        run.update(
            state="Failed",
            finished_at=now_iso(),
            exit_code=status.exit_code,
            detail=status.detail,
            log_tail=backend.logs(job, tail=30),
        )
        self._commit_run(
            state, run, f"{state.name}: attempt {run['attempt']} failed: {status.detail}", "fail"
        )

    def _collect(self, ctx: Context, state: VersionState) -> None:
        run = dict(state.records["run"])
        job = job_for(ctx, state, run)
        collected = ctx.backend(run["backend"]).collect(job)
        artifacts = {}
        for name, path in (
            ("train_rollouts", collected.train_rollouts),
            ("val_rollouts", collected.val_rollouts),
            ("steps", collected.steps),
            ("scores", collected.scores),
        ):
            if path is not None:
                data = path.read_bytes()
                artifacts[name] = {
                    "path": str(path.relative_to(self.ws.root)),
                    "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
                    "bytes": len(data),
                }
        result = collected.result
        run.update(
            state="Succeeded",
            finished_at=now_iso(),
            artifacts=artifacts,
            result={
                key: result.get(key)
                for key in ("val_avg", "steps_done", "eval_k", "seeds", "wall_time_s")
                if key in result
            },
        )
        run.setdefault("started_at", run["finished_at"])
        score = result.get("val_avg")
        self.ws.git.commit_files(
            branch_name(state.name),
            {
                run_path(state.name, "run.yaml"): record_text("run", run).encode(),
                run_path(state.name, "scores.csv"): collected.scores.read_bytes(),
            },
            f"Collect {state.name}: val avg@k {score}",
            {"Action": "collect", "Version": state.name},
        )

    def _diagnose(self, ctx: Context, state: VersionState, action: str = "diagnose") -> dict:
        run = state.records["run"]
        artifact_dir = self.ws.root / run["artifact_dir"]
        if not artifact_dir.is_dir():
            raise EvoError(
                f"the artifacts of {state.name} are gone",
                where=str(artifact_dir),
                hint="the records in git are intact; restore the folder, or re-approve the "
                f"version to retrain it (evotrainer approve {state.name})",
            )
        from evotrainer.evidence.io import read_rollouts, read_steps

        rollouts = read_rollouts(artifact_dir / "rollouts")
        steps_file = artifact_dir / "steps.parquet"
        steps = read_steps(steps_file) if steps_file.is_file() else None
        parent_scores = recorded_scores(self.ws, state.parent) if state.parent else None
        result = diagnose(rollouts, steps, ctx.harness, parent_scores)
        document = diagnosis_document(result, state.name)
        document["created_at"] = now_iso()
        alerts = ", ".join(a["name"] for a in result["alerts"]) or "none"
        self.ws.git.commit_files(
            branch_name(state.name),
            {run_path(state.name, "diagnosis.yaml"): record_text("diagnosis", document).encode()},
            f"Diagnose {state.name} with {ctx.harness.name}: alerts {alerts}",
            {"Action": action, "Version": state.name, "Harness": ctx.harness.name},
        )
        return result

    def _rediagnose(self, ctx: Context, state: VersionState) -> None:
        self._diagnose(ctx, state, action="rediagnose")

    def _gate(self, ctx: Context, state: VersionState) -> None:
        decision = decide(self.ws, ctx.states, state, ctx.harness)
        self.ws.git.commit_files(
            branch_name(state.name),
            {run_path(state.name, "decision.yaml"): record_text("decision", decision).encode()},
            f"Gate {state.name}: {decision['verdict']} — {decision['reason']}",
            {
                "Action": "gate",
                "Version": state.name,
                "Harness": ctx.harness.name,
                "Verdict": decision["verdict"],
            },
        )

    def _promote(self, ctx: Context, state: VersionState) -> None:
        decision = state.records["decision"]
        self.ws.git.merge_into(
            "main",
            branch_name(state.name),
            f"Promote {state.name}: {decision['verdict']} — {decision['reason']}\n\n"
            f"Evotrainer-Action: promote\nEvotrainer-Version: {state.name}\n"
            f"Evotrainer-Verdict: {decision['verdict']}\n",
        )

    def _evidence(self, ctx: Context, state: VersionState) -> None:
        record_evidence(self.ws, state.name, state.records["decision"])

    def _prune(self, ctx: Context, state: VersionState) -> None:
        decision = state.records["decision"]
        self.ws.git.tag(
            PRUNED_TAG_PREFIX + state.name,
            branch_name(state.name),
            f"Pruned {state.name}: {decision['reason']} (kept as negative evidence)",
        )


def record_text(kind: str, document: dict) -> str:
    """A record as committed: floats to 6 significant digits and 12 decimals (readable diffs,
    and the same bytes whatever order a parallel aggregate summed in), schema-checked."""
    text = f"# yaml-language-server: $schema=../../spec/schemas/{kind}.schema.json\n" + specs.dump(
        _rounded(document)
    )
    specs.load_text(text, f"runs/{document['version']}/{kind}.yaml", kind.capitalize())
    return text


def _rounded(value):
    if isinstance(value, float):
        # Absolute rounding first: a slope of 1e-17 is float noise, not a trend.
        return float(f"{round(value, 12):.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def diagnose_version(ws: Workspace, name: str) -> tuple[dict, HarnessRevision]:
    """Diagnose a recorded version with the harness in force and commit its diagnosis.yaml
    (what reconcile does after collecting; here on demand)."""
    ctx = load_context(ws)
    state = ws.version(name, ctx.states)
    if (state.records.get("run") or {}).get("state") != "Succeeded":
        raise EvoError(
            f"{name} has no collected run to diagnose",
            hint="`evotrainer reconcile --wait` trains and collects it first",
        )
    return Reconciler(ws, log=lambda _: None)._diagnose(ctx, state), ctx.harness
