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

import git
import pyarrow as pa

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
from evotrainer.store.validation import Validation, check_workspace, job_env
from evotrainer.store.workspace import VersionState, Workspace, run_path

# What a version's action may fail with and still leave the other versions to proceed.
VERSION_ERRORS = (EvoError, OSError, git.GitCommandError)

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
    error: str | None = None  # the version is refused (invalid) or its action failed

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "sync": self.sync,
            "health": self.health,
            "action": self.action.kind if self.action else None,
            "reason": self.action.reason if self.action else (self.error or self.note),
            "error": self.error,
        }


def error_plan(name: str, message: str, health: str = "—") -> VersionPlan:
    return VersionPlan(name, "Invalid", health, None, error=message)


@dataclass
class Context:
    """Everything a pass reads once: specs and records from git, the harness in force."""

    ws: Workspace
    states: dict[str, VersionState]
    harness: HarnessRevision
    backends: dict[str, Backend] = field(default_factory=dict)
    validation: Validation = field(default_factory=Validation)

    def backend(self, name: str) -> Backend:
        if name not in self.backends:
            self.backends[name] = get_backend(name, self.ws.artifact_root / "cache")
        return self.backends[name]


def load_context(ws: Workspace, backends: dict[str, Backend] | None = None) -> Context:
    """Read the pass's inputs and run `validate`'s checks on them. Problems of the
    workspace-wide files (project, harness revisions, skills) refuse the whole pass."""
    states = ws.versions()
    validation = check_workspace(ws, states, backends=backends)
    if validation.workspace:
        first = validation.workspace[0]
        more = len(validation.workspace) - 1
        raise EvoError(
            first.message + (f" (and {more} more problem(s))" if more else ""),
            where=first.where,
            field=first.field,
            hint=(first.hint + "; " if first.hint else "") + "`evotrainer validate` lists all",
        )
    harness_name = ws.project.get("harness", "h0")
    return Context(
        ws, states, resolve_harness(harness_name, ws.root), dict(backends or {}), validation
    )


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
        env=job_env(ctx.ws),
    )


def plan_version(ctx: Context, state: VersionState) -> VersionPlan:
    """The next action of one version; a version's own error never stops the others."""
    refusal = ctx.validation.refusal(state.name, ctx.states)
    if refusal is not None:
        return error_plan(state.name, f"invalid: {refusal}")
    try:
        return _plan_version(ctx, state)
    except VERSION_ERRORS as err:
        run = state.records.get("run") or {}
        return error_plan(state.name, str(err), run.get("state", "—"))


def _approval_wait(ctx: Context, state: VersionState, status: str) -> VersionPlan:
    """A version that may not launch as it is: approve it now (autonomy) or say why not."""
    sync = "Drifted" if state.records.get("run") else "OutOfSync"
    health = (state.records.get("run") or {}).get("state", "—")
    if _auto_approvable(ctx, state):
        return VersionPlan(
            state.name, sync, health, Action("approve", "autonomy allows it within budget")
        )
    if status == "stale":
        return VersionPlan(
            state.name,
            sync,
            health,
            None,
            "awaiting re-approval: the spec or its inherited recipe changed since it was "
            f"approved (evotrainer approve {state.name})",
        )
    return VersionPlan(
        state.name, sync, health, None, f"awaiting approval: evotrainer approve {state.name}"
    )


def _plan_version(ctx: Context, state: VersionState) -> VersionPlan:
    run = state.records.get("run")
    spec_digest = state.spec_digest
    approval = ctx.ws.approval_status(state, ctx.states)
    if run is None:
        if approval != "approved":
            return _approval_wait(ctx, state, approval)
        if not _slot_free(ctx):
            return VersionPlan(
                state.name, "OutOfSync", "—", None, "waiting: max_concurrent_jobs reached"
            )
        return VersionPlan(state.name, "OutOfSync", "—", Action("launch", "approved, never run"))

    health = run["state"]
    drifted = run.get("spec_digest") != spec_digest
    sync = "Drifted" if drifted else "Synced"
    if drifted and approval == "approved" and _reapproved_after(state, run):
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
                if approval != "approved":
                    return _approval_wait(ctx, state, approval)
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
        if infrastructure_failure(run.get("detail", "")):
            return VersionPlan(
                state.name,
                sync,
                health,
                None,
                f"infrastructure failure ({run.get('detail', '')}): not the run's own; fix it, "
                f"then `evotrainer retry {state.name}`",
            )
        if own_failures(run) < ctx.ws.project.get("max_attempts", 2) and not drifted:
            if approval != "approved":
                return _approval_wait(ctx, state, approval)
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
    return state.approval.get("at", "") > run.get("created_at", "")


# What a failure of the machine (not of the training) looks like in a job's detail.
INFRASTRUCTURE_MARKERS = (
    "No space left on device",
    "Disk quota exceeded",
    "Errno 28",
    "Errno 122",
    "Read-only file system",
    "Cannot allocate memory",
)


def infrastructure_failure(detail: str) -> bool:
    """A failure the run did not cause (disk full, quota, read-only disk, out of memory):
    it does not count against `max_attempts`, and `evotrainer retry` restarts it."""
    return any(marker in (detail or "") for marker in INFRASTRUCTURE_MARKERS)


def own_failures(run: dict) -> int:
    """Failed attempts that were the run's own fault, the current one included."""
    history = [a for a in run.get("attempts") or [] if a.get("state") == "Failed"]
    count = sum(not infrastructure_failure(a.get("detail", "")) for a in history)
    if run.get("state") == "Failed" and not infrastructure_failure(run.get("detail", "")):
        count += 1
    return count


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


def launch_record(
    ctx: Context, state: VersionState, attempt: int | None = None, history: list | None = None
) -> dict:
    """The Pending run record committed before a job starts (its id is deterministic)."""
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
        "artifact_dir": ctx.ws.record_path(ctx.ws.artifact_dir(state.name, jid)),
    }
    if history or previous.get("attempts"):
        run["attempts"] = history if history is not None else previous["attempts"]
    return run


def attempt_history(run: dict) -> list[dict]:
    """The attempts so far, the current (failed) one appended: what a retry carries."""
    return list(run.get("attempts") or []) + [
        {
            "attempt": run["attempt"],
            "job_id": run["job_id"],
            "state": run["state"],
            "detail": run.get("detail", ""),
            "steps": int((run.get("result") or {}).get("steps_done") or 0),
        }
    ]


def request_retry(ws: Workspace, name: str, by: str) -> dict:
    """`evotrainer retry V`: commit the next attempt's Pending record for a failed run (the
    next reconcile launches it). For failures of the machine, or a run given another chance
    after `max_attempts`; the approval must still hold."""
    ctx = load_context(ws)
    state = ws.version(name, ctx.states)
    refusal = ctx.validation.refusal(name, ctx.states)
    if refusal:
        raise EvoError(f"{name} is invalid: {refusal}", hint="fix it; `evotrainer validate`")
    run = state.records.get("run") or {}
    if run.get("state") != "Failed":
        raise EvoError(
            f"{name} has no failed run to retry (state: {run.get('state', 'not run')})",
            hint="retry restarts a Failed run; `evotrainer plan` shows what reconcile does",
        )
    if ws.approval_status(state, ctx.states) != "approved":
        raise EvoError(
            f"{name} is not approved as it is now",
            hint=f"review and approve it first: evotrainer approve {name}",
        )
    history = attempt_history(run)
    history[-1]["retried_by"] = by
    record = launch_record(ctx, state, attempt=run["attempt"] + 1, history=history)
    ws.git.commit_files(
        branch_name(name),
        {run_path(name, "run.yaml"): record_text("run", record).encode()},
        f"Retry {name}: attempt {record['attempt']} requested by {by}",
        {"Action": "retry", "Version": name},
    )
    return record


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
        self.errors: dict[str, str] = {}  # version → its last error in this run

    def boundary(self) -> None:
        """An action boundary: state is consistent here, so a crash here must be harmless."""
        self._boundaries += 1
        if self._fault_after and self._boundaries == self._fault_after:
            os._exit(99)

    def pass_once(self) -> tuple[list[VersionPlan], int]:
        """Plan every version from fresh state, apply every action; return plans and count.

        An error belongs to its version: it is logged and kept in the plan (and in
        `errors`), and the pass goes on with the others."""
        applied = 0
        ctx = load_context(self.ws, self.backends)
        plans = plan(ctx)
        for i, version_plan in enumerate(plans):
            if version_plan.error:
                self._error(version_plan.version, version_plan.error)
            if version_plan.action is None:
                continue
            # Earlier actions of this pass changed git: re-read before acting.
            ctx = load_context(self.ws, self.backends)
            current = plan_version(ctx, ctx.states[version_plan.version])
            if current.action is None:
                continue
            try:
                self.apply(ctx, ctx.states[current.version], current.action)
            except VERSION_ERRORS as err:
                message = f"{current.action.kind} failed: {err}"
                self._error(current.version, message)
                plans[i] = error_plan(current.version, message, current.health)
                continue
            applied += 1
            self.boundary()
        return plans, applied

    def _error(self, version: str, message: str) -> None:
        if self.errors.get(version) != message:  # a waiting loop logs each error once
            self.log(f"{version}: error: {message}")
        self.errors[version] = message

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
            # A version in error waits for a human, not for its job.
            running = [p for p in plans if p.health in ("Pending", "Running") and not p.error]
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
        run = launch_record(ctx, state, attempt, history)
        recipe, jid, attempt = job_recipe(ctx, state), run["job_id"], run["attempt"]
        if previous.get("job_id") != jid or previous.get("state") != "Pending":
            self._commit_run(state, run, f"Launch {state.name} attempt {attempt} ({jid})", "launch")
            self.boundary()
        workdir = self.ws.git.worktree_add(
            self.ws.worktree_path(state.name), self._spec_commit(state)
        )
        job = JobSpec(
            jid, state.name, recipe, workdir, self.ws.root / run["artifact_dir"], job_env(self.ws)
        )
        ctx.backend(recipe["backend"]).submit(job)

    def _spec_commit(self, state: VersionState) -> str:
        """The commit that last changed the version's spec: what the worktree trains from."""
        path = f"spec/versions/{state.name}.yaml"
        return self.ws.git.repo.git.log("-1", "--format=%H", state.sha, "--", path)

    def _retry(self, ctx: Context, state: VersionState) -> None:
        run = state.records["run"]
        self._launch(ctx, state, attempt=run["attempt"] + 1, history=attempt_history(run))

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
                    "path": self.ws.record_path(path),
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

        verify_artifacts(self.ws, state)
        steps_file = artifact_dir / "steps.parquet"
        try:
            rollouts = read_rollouts(artifact_dir / "rollouts")
            steps = read_steps(steps_file) if steps_file.is_file() else None
        except (pa.ArrowException, OSError) as exc:
            raise EvoError(
                f"the evidence of {state.name} cannot be read: {exc.__class__.__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}",
                where=str(artifact_dir),
                hint="the job wrote a corrupt file; re-approve the version to retrain it "
                f"(evotrainer approve {state.name}) or restore the folder",
            ) from None
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
        for name in filter(None, (state.name, state.parent)):
            verify_artifacts(self.ws, ctx.states[name], only=("scores",))
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


def verify_artifacts(ws: Workspace, state: VersionState, only: tuple[str, ...] = ()) -> None:
    """Check the sha256 of each artifact the run record names (all, or `only` those) before
    anything is concluded from it: a file swapped or damaged under a recorded run is
    refused, naming the file. The committed scores.csv is held to its recorded digest too."""
    run = state.records.get("run") or {}
    for kind, artifact in (run.get("artifacts") or {}).items():
        if only and kind not in only or not artifact.get("digest"):
            continue
        if kind == "scores":
            data = ws.git.read(branch_name(state.name), run_path(state.name, "scores.csv"))
            where = f"{branch_name(state.name)}:{run_path(state.name, 'scores.csv')}"
        else:
            path = ws.root / artifact["path"]
            data = path.read_bytes() if path.is_file() else None
            where = str(path)
        if data is None:
            raise EvoError(
                f"recorded artifact {kind} of {state.name} is missing",
                where=where,
                hint="restore it, or re-approve the version to retrain it "
                f"(evotrainer approve {state.name})",
            )
        found = "sha256:" + hashlib.sha256(data).hexdigest()
        if found != artifact["digest"]:
            raise EvoError(
                f"recorded artifact {kind} of {state.name} changed since it was recorded "
                f"(digest {found[:19]}…, recorded {artifact['digest'][:19]}…)",
                where=where,
                hint="restore the recorded file; nothing is diagnosed or gated on evidence "
                "that is not what was recorded",
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
