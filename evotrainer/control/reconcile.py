"""Reconcile: make the recorded reality (runs/ on each version branch) match the specs.

Level-triggered, like a Kubernetes controller: every pass re-derives the state of every
version from git and the backend, plans the next action for each, and applies it with one
commit per state change. Nothing is remembered between passes, so a pass that crashed is
repaired by the next one:

- a run record (state Pending, deterministic job id) is committed *before* the launch, and
  the backend adopts a job it already knows instead of launching it again;
- records are written in one commit each (plumbing: no half-written file is ever committed);
- promotion merges into `main`, pruning tags `pruned/<v>`; nothing is deleted;
- an early stop (a harness `early_stop` rule holding over a running job's live diagnosis)
  commits the stopped run, its diagnosis and its prune decision in one commit, then cancels
  the job: a pass that died in between finds the Stopped run's job still alive and cancels
  it again (the records are never written twice).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import pyarrow as pa

from evotrainer.backends import Backends
from evotrainer.backends.base import Backend
from evotrainer.control.decide import Action, VersionPlan, error_plan
from evotrainer.control.live import stop_records
from evotrainer.control.observe import (
    NO_RUN,
    VERSION_ERRORS,
    Context,
    attempt_history,
    job_for,
    launch_record,
    live_look,
    load_context,
    pending_launch,
    plan,
    plan_version,
    steps_spent,
    within_budget,
)
from evotrainer.diagnosis.diagnose import diagnose, diagnosis_document
from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.errors import EvoError
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.gate.decision import decide, recorded_scores
from evotrainer.skills.library import record_evidence
from evotrainer.store import specs
from evotrainer.store.checkpoints import CHECKPOINT, checkpoint_record, is_dropped, verify_directory
from evotrainer.store.clock import now_iso
from evotrainer.store.git import PRUNED_TAG_PREFIX, branch_name
from evotrainer.store.records import RETRIED_STATES, JobState, ended_run
from evotrainer.store.workspace import VersionState, Workspace, run_path
from evotrainer.trackers.records import log_gate, run_identity

# The names callers have always imported from here (commands, the agent's loop, jobs, render).
__all__ = [
    "Context", "Reconciler", "VersionPlan", "diagnose_version", "error_plan",
    "job_for", "pending_launch", "load_context", "plan", "record_text", "request_retry",
    "steps_spent", "within_budget",
]

# How long an early stop waits for its cancelled job to end before the pass goes on.
STOP_WAIT_S = 10.0

# Hard exit after the N-th action boundary: the crash-safety tests walk N over every one.
FAULT_ENV = "EVOTRAINER_FAULT_AFTER"


def request_retry(ws: Workspace, name: str, by: str) -> dict:
    """`evotrainer retry V`: commit the next attempt's Pending record for a failed run (the
    next reconcile launches it). For failures of the machine, or a run given another chance
    after `max_attempts`; the approval must still hold."""
    ctx = load_context(ws)
    state = ws.version(name, ctx.states)
    refusal = ctx.validation.refusal(name, ctx.states)
    if refusal:
        raise EvoError(f"{name} is invalid: {refusal}", hint="fix it; `evotrainer validate`")
    run = state.run
    if run is None or run.state not in RETRIED_STATES:
        raise EvoError(
            f"{name} has no failed or cancelled run to retry "
            f"(state: {run.state if run else 'not run'})",
            hint="retry restarts a Failed or Cancelled run; `evotrainer plan` shows what "
            "reconcile does",
        )
    if ws.approval_status(state, ctx.states) != "approved":
        raise EvoError(
            f"{name} is not approved as it is now",
            hint=f"review and approve it first: evotrainer approve {name}",
        )
    history = attempt_history(state.records["run"])
    history[-1]["retried_by"] = by
    record = launch_record(ctx, state, attempt=run.attempt + 1, history=history)
    ws.commit_records(
        name,
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
        backends: Backends | Mapping[str, Backend] | None = None,
    ) -> None:
        self.ws = ws
        # One registry for every pass, so a backend keeps what it knows between passes.
        self.backends = (
            backends if isinstance(backends, Backends)
            else Backends(backends, ws.artifact_root / "cache")
        )
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
        applied, acted = 0, False
        ctx = load_context(self.ws, self.backends, live=True)
        plans = plan(ctx)
        for i, version_plan in enumerate(plans):
            if version_plan.error:
                self._error(version_plan.version, version_plan.error)
            if version_plan.action is None:
                continue
            current = version_plan
            if acted:  # an earlier action of this pass (even one that failed half-way)
                # may have changed what this version's decision reads: decide again
                if current.version not in ctx.states:
                    continue
                current = plan_version(ctx, ctx.states[current.version])
                if current.action is None:
                    continue
            acted = True
            try:
                self.apply(ctx, ctx.states[current.version], current.action)
            except VERSION_ERRORS as err:
                message = f"{current.action.kind} failed: {err}"
                self._error(current.version, message)
                plans[i] = error_plan(current.version, message, current.health)
                continue
            finally:
                # What the action (or its failure half-way) changed, re-read: that version
                # alone where only its records changed, else everything.
                looks = ctx.live_looks
                ctx = (ctx.refreshed(current.version, current.action.kind)
                       or load_context(self.ws, self.backends, live=True))
                ctx.live_looks = looks  # each running job is looked at once a pass
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
            running = [p for p in plans
                       if p.health in (JobState.PENDING, JobState.RUNNING) and not p.error]
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
        self.ws.commit_records(
            state.name,
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
        run, job = pending_launch(ctx, state, attempt, history)
        jid, attempt = run["job_id"], run["attempt"]
        # The worktree first: one that cannot move (uncommitted work in it) refuses the launch
        # before anything is recorded, so no attempt is spent on a job never submitted.
        self.ws.git.worktree_add(job.workdir, self.ws.spec_commit(state))
        if previous.get("job_id") != jid or previous.get("state") != JobState.PENDING:
            self._commit_run(state, run, f"Launch {state.name} attempt {attempt} ({jid})", "launch")
            self.boundary()
        job.artifact_dir.mkdir(parents=True, exist_ok=True)
        launched = replace(state, records={**state.records, "run": run})
        run_identity(self.ws, launched, ctx.states).write(job.artifact_dir)  # tracker tags
        ctx.backend(job.recipe["backend"]).submit(job)

    def _retry(self, ctx: Context, state: VersionState) -> None:
        run = state.records["run"]
        self._launch(ctx, state, attempt=run["attempt"] + 1, history=attempt_history(run))

    def _poll(self, ctx: Context, state: VersionState) -> None:
        run = dict(state.records["run"])
        status = ctx.backend(run["backend"]).status(job_for(ctx, state, run))
        if not status.state.active:
            # It ended since it was planned (a live look takes a while): recording that
            # state here would skip the collect; the next pass collects or fails it.
            return
        run["state"] = status.state.value
        run.setdefault("started_at", now_iso())
        self._commit_run(state, run, f"{state.name}: job {status.state.value}", "poll")

    def _fail(self, ctx: Context, state: VersionState) -> None:
        run = dict(state.records["run"])
        job = job_for(ctx, state, run)
        backend = ctx.backend(run["backend"])
        status = backend.status(job)
        run = ended_run(
            run, now_iso(),
            state=JobState.FAILED.value,
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
        if collected.checkpoint is not None:  # the trained policy, recorded by its digest
            artifacts[CHECKPOINT] = checkpoint_record(
                collected.checkpoint, self.ws.record_path(collected.checkpoint)
            )
        result = collected.result
        run = ended_run(
            run, now_iso(),
            state=JobState.SUCCEEDED.value,
            artifacts=artifacts,
            result={
                key: result.get(key)
                for key in ("val_avg", "steps", "steps_done", "eval_k", "seeds", "wall_time_s",
                            "judges")
                if key in result
            },
        )
        score = result.get("val_avg")
        self.ws.commit_records(
            state.name,
            {
                run_path(state.name, "run.yaml"): record_text("run", run).encode(),
                run_path(state.name, "scores.csv"): collected.scores.read_bytes(),
            },
            f"Collect {state.name}: val avg@k {score}",
            {"Action": "collect", "Version": state.name},
        )

    def _diagnose(self, ctx: Context, state: VersionState, action: str = "diagnose") -> dict:
        artifact_dir = self.ws.run_dir(state.name, state.records["run"])
        if not artifact_dir.is_dir():
            raise EvoError(
                f"the artifacts of {state.name} are gone",
                where=str(artifact_dir),
                hint="the records in git are intact; restore the folder, or re-approve the "
                f"version to retrain it (evotrainer approve {state.name})",
            )
        from evotrainer.evidence.io import read_rollouts, read_steps

        # The policy is checked when a child starts from it, not before every diagnosis.
        verify_artifacts(self.ws, state, skip=(CHECKPOINT,))
        files = RunArtifacts(artifact_dir)
        steps_file = files.steps
        try:
            rollouts = read_rollouts(files.rollouts_dir)
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
        # The recorded comparison is the one the gate reuses: this version's committed scores.
        result = diagnose(
            rollouts, steps, ctx.harness, parent_scores,
            scores=recorded_scores(self.ws, state.name),
        )
        document = diagnosis_document(result, state.name)
        document["created_at"] = now_iso()
        alerts = ", ".join(a["name"] for a in result["alerts"]) or "none"
        self.ws.commit_records(
            state.name,
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
        self.ws.commit_records(
            state.name,
            {run_path(state.name, "decision.yaml"): record_text("decision", decision).encode()},
            f"Gate {state.name}: {decision['verdict']} — {decision['reason']}",
            {
                "Action": "gate",
                "Version": state.name,
                "Harness": ctx.harness.name,
                "Verdict": decision["verdict"],
            },
        )
        self._log_verdict(ctx, state, decision)

    def _log_verdict(self, ctx: Context, state: VersionState, decision: dict) -> None:
        """The verdict on the tracker runs: a tracker's trouble never blocks the gate."""
        try:
            log_gate(self.ws, state, ctx.states, decision)
        except EvoError as err:
            self.log(f"{state.name}: warning: the gate was not logged to the trackers: {err}")

    def _stop(self, ctx: Context, state: VersionState) -> None:
        """Early stop: commit the stopped run, the live diagnosis and the prune decision in
        one commit, then cancel the job. Recording first (as `evotrainer cancel` does) means
        no pass ever reads the killed job as a failure to retry; a crash before the cancel
        leaves a Stopped run whose job still runs, and the next pass only cancels it."""
        run = state.records["run"]
        if run["state"] != JobState.STOPPED:
            view = live_look(ctx, state)
            records = stop_records(state, run, ctx.harness, view)
            self.ws.commit_records(
                state.name,
                {
                    run_path(state.name, "run.yaml"): record_text("run", records.run).encode(),
                    run_path(state.name, "diagnosis.yaml"): record_text(
                        "diagnosis", records.diagnosis).encode(),
                    run_path(state.name, "decision.yaml"): record_text(
                        "decision", records.decision).encode(),
                },
                records.message,
                records.trailers,
            )
            self.boundary()
        backend, job = ctx.backend(run["backend"]), job_for(ctx, state, run)
        backend.cancel(job)
        # A cancelled job takes a moment to go (the engine's SIGTERM handler, Ray's stop):
        # waiting a little spares the next pass a second, harmless, cancel.
        deadline = time.monotonic() + STOP_WAIT_S
        while backend.status(job).state.active and time.monotonic() < deadline:
            time.sleep(0.2)
        if run["state"] != JobState.STOPPED:
            stopped = replace(state, records={**state.records, "run": records.run,
                                              "diagnosis": records.diagnosis,
                                              "decision": records.decision})
            self._log_verdict(ctx, stopped, records.decision)

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


def verify_artifacts(
    ws: Workspace, state: VersionState, only: tuple[str, ...] = (), skip: tuple[str, ...] = ()
) -> None:
    """Check the sha256 of each artifact the run record names (all, or `only` those, less
    `skip`) before anything is concluded from it: a file swapped or damaged under a recorded
    run is refused, naming the file. The committed scores.csv is held to its recorded digest
    too; a recorded policy (a directory) to its manifest digest, unless it was dropped."""
    for kind, artifact in (state.run or NO_RUN).artifacts.items():
        if only and kind not in only or kind in skip or not artifact.get("digest"):
            continue
        if kind == CHECKPOINT:
            if not is_dropped(artifact):
                verify_directory(ws.root / artifact["path"], artifact, state.name)
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
    path = run_path(document["version"], f"{kind}.yaml")
    text = specs.schema_modeline(path, kind.capitalize()) + specs.dump(_rounded(document))
    specs.load_text(text, path, kind.capitalize())
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
    if state.run is not None and state.run.stopped:
        stop = state.run.stopped
        raise EvoError(
            f"{name} was stopped early by rule {stop.get('rule')} at step {stop.get('step')}: "
            "its diagnosis is the one recorded at the stop",
            hint=f"read it with `git show {branch_name(name)}:{run_path(name, 'diagnosis.yaml')}`"
            " or `evotrainer report`",
        )
    if state.run is None or not state.run.succeeded:
        raise EvoError(
            f"{name} has no collected run to diagnose",
            hint="`evotrainer reconcile --wait` trains and collects it first",
        )
    return Reconciler(ws, log=lambda _: None)._diagnose(ctx, state), ctx.harness
