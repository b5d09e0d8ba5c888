"""The rules of reconcile: what one version does next, decided purely from what was observed.

`Observed` holds everything a rule reads about a version (its records, the backend's word on
its job, the few lineage-wide facts a rule needs); each `rule_*` is a pure function of it, and
`decide_next` takes the first that applies. Nothing here reads git, a backend or a file, so
the rules are tested on hand-made observations (tests/test_control_rules.py), and a pass
decides every version from one observation of the world (control/observe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from evotrainer.backends.base import JobStatus
from evotrainer.store.lineage import stop_progress, stopped_text
from evotrainer.store.records import (
    MERGING,
    DecisionRecord,
    DiagnosisRecord,
    JobState,
    RunRecord,
    Verdict,
)


@dataclass
class Action:
    # approve | launch | poll | stop | collect | diagnose | rediagnose | gate | promote |
    # prune | evidence | retry | fail: each applied by the Reconciler method of the same name
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



@dataclass(frozen=True)
class Observed:
    """What one version's next action is decided from: records from git, the backend's word
    on its job, and the few facts about the rest of the lineage the rules need. Gathered by
    `observe`; `decide` is pure over it, so the rules are tested without a backend."""

    name: str
    run: RunRecord | None = None
    approval: str = "unapproved"  # Workspace.approval_status
    spec_digest: str = ""
    reapproved_after_run: bool = False
    auto_approvable: bool = False
    held_for_review: str = ""  # why autonomy leaves it to a reviewer, whatever the budget
    slot_free: bool = True
    max_attempts: int = 2
    job: JobStatus | None = None  # only for a run still active, or Stopped and not yet pruned
    live_stop: dict | None = None  # the early stop the running job's live diagnosis decided
    live_error: str | None = None  # why the live diagnosis failed (the job keeps running)
    stopped: dict | None = None  # a Stopped run's `stopped`: the rule, alert and step
    parent: str | None = None
    parent_run_state: str | None = None
    parent_diagnosed: bool = True
    control: str | None = None  # a treatment's family control (gate/counterfactual.py)
    control_diagnosed: bool = True
    parent_policy: str | None = None  # model.init: parent: why the parent's policy is missing
    budget_refusal: str | None = None  # autonomy.max_gpu_hours: why no GPU job may launch now
    diagnosis: DiagnosisRecord | None = None
    decision: DecisionRecord | None = None
    harness_name: str = ""
    harness_digest: str = ""
    on_main: bool = False
    # A promotion whose branch changed since its approval: the files it did not see.
    unapproved_files: tuple[str, ...] = ()
    pruned: bool = False
    evidence_pending: bool = False

    @property
    def drifted(self) -> bool:
        return self.run is not None and self.run.spec_digest != self.spec_digest

    @property
    def sync(self) -> str:
        if self.run is None:
            return "OutOfSync"
        return "Drifted" if self.drifted else "Synced"

    @property
    def health(self) -> str:
        return self.run.state if self.run else "—"

    def plan(self, action: Action | None = None, note: str = "", health: str | None = None):
        return VersionPlan(self.name, self.sync, health or self.health, action, note)



# ---- the rules: each returns a plan when it applies, else None; the first that applies wins


def rule_drift_reapproved(o: Observed) -> VersionPlan | None:
    if o.drifted and o.approval == "approved" and o.reapproved_after_run:
        return launch_or_wait(o, Action("retry", "spec changed after the run and was "
                                        "re-approved"))
    return None


def rule_parent_stopped(o: Observed) -> VersionPlan | None:
    """A parent stopped early has no final scores: its child could train but never be
    compared or gated, so it is refused before it spends compute."""
    if o.parent_run_state != JobState.STOPPED or (o.run is not None and not o.run.active):
        return None
    return VersionPlan(
        o.name, o.sync, o.health, None,
        error=f"parent {o.parent} was stopped early (pruned) and has no scores to compare "
        f"with: fork this version from {o.parent}'s parent instead",
    )


def rule_not_run(o: Observed) -> VersionPlan | None:
    if o.run is not None:
        return None
    if o.approval != "approved":
        return approval_wait(o)
    if not o.slot_free:
        return o.plan(note="waiting: max_concurrent_jobs reached")
    return launch_or_wait(o, Action("launch", "approved, never run"))


def rule_active_job(o: Observed) -> VersionPlan | None:
    if o.run is None or o.job is None or not o.run.active:
        return None
    job, health = o.job, o.run.state
    if job.state is JobState.SUCCEEDED:
        return o.plan(Action("collect", "job finished"), health=JobState.SUCCEEDED.value)
    if job.state is JobState.UNKNOWN and health == JobState.PENDING:
        if o.approval != "approved":
            return approval_wait(o)
        return launch_or_wait(o, Action("launch", "run recorded but job never started"))
    if job.state in (JobState.FAILED, JobState.UNKNOWN):
        why = job.detail if job.state is JobState.FAILED else (
            "the backend has no record of the job (artifact dir missing?)")
        return o.plan(Action("fail", why), health=JobState.FAILED.value)
    if job.state.value != health:
        return o.plan(Action("poll", f"job is {job.state.value}"), health=job.state.value)
    note = f"job {job.state.value.lower()}{progress_text(job)}"
    if o.live_error:
        note += f"; live diagnosis failed: {o.live_error}"
    return o.plan(note=note)


def rule_early_stop(o: Observed) -> VersionPlan | None:
    """A rule of the harness's `early_stop` holds over the running job's evidence so far."""
    stop = o.live_stop
    job_running = o.job is not None and o.job.state is JobState.RUNNING
    if stop is None or o.run is None or not o.run.active or not job_running:
        return None
    return o.plan(Action("stop", f"early stop {stop['rule']} at {stop_progress(stop)}: "
                         f"{stop['reason']}"), health=JobState.STOPPED.value)


def rule_cancelled(o: Observed) -> VersionPlan | None:
    if o.run is None or o.run.state != JobState.CANCELLED:
        return None
    return o.plan(note=f"cancelled ({o.run.detail}); `evotrainer retry {o.name}` relaunches it")


def rule_stopped(o: Observed) -> VersionPlan | None:
    """A run stopped early has no final scores: nothing to collect, diagnose or gate; its
    prune decision was committed with it, so the verdict's actions follow."""
    if o.run is None or o.run.state != JobState.STOPPED:
        return None
    if o.job is not None and o.job.state.active:
        return o.plan(Action("stop", "the stopped job is still running"))
    decided = rule_verdict(o)
    if decided.action is None:
        decided.note = f"{stopped_text(o.stopped)}; {decided.note}"
    return decided


def rule_failed(o: Observed) -> VersionPlan | None:
    if o.run is None or o.run.state != JobState.FAILED:
        return None
    if infrastructure_failure(o.run.detail):
        return o.plan(note=f"infrastructure failure ({o.run.detail}): not the run's own; fix "
                      f"it, then `evotrainer retry {o.name}`")
    if own_failures(o.run) < o.max_attempts and not o.drifted:
        if o.approval != "approved":
            return approval_wait(o)
        return launch_or_wait(o, Action("retry", f"attempt {o.run.attempt} failed"))
    return o.plan(note=f"failed after {o.run.attempt} attempt(s); kept as negative evidence")


def rule_drifted(o: Observed) -> VersionPlan | None:
    if o.drifted:
        return o.plan(note="spec changed after the run: re-approve to retrain "
                      f"(evotrainer approve {o.name})")
    return None


def rule_diagnose(o: Observed) -> VersionPlan | None:
    if o.diagnosis is not None:
        return None
    if o.parent is not None and o.parent_run_state != JobState.SUCCEEDED:
        # the version layer compares with the parent's scores
        return o.plan(note=f"waiting for parent {o.parent} to be evaluated")
    return o.plan(Action("diagnose", "evidence collected"))


def rule_rediagnose(o: Observed) -> VersionPlan | None:
    if o.diagnosis is None or o.diagnosis.harness_digest == o.harness_digest:
        return None
    return o.plan(Action("rediagnose", f"harness changed: {o.diagnosis.harness_name} → "
                         f"{o.harness_name} (no retraining)"))


def rule_gate(o: Observed) -> VersionPlan | None:
    if o.decision is not None and o.decision.harness_digest == o.harness_digest:
        return None
    if not o.parent_diagnosed:
        return o.plan(note=f"waiting for parent {o.parent} to be evaluated")
    if not o.control_diagnosed:
        return o.plan(note=f"waiting for its family's control {o.control} to be evaluated")
    return o.plan(Action("gate", "diagnosed, not yet gated"))


def rule_verdict(o: Observed) -> VersionPlan | None:
    verdict = o.decision.verdict if o.decision else None
    if verdict in MERGING and not o.on_main:
        if o.approval != "approved":  # main gets exactly what a reviewer approved, or nothing
            changed = ", ".join(o.unapproved_files[:10]) or "its approval"
            more = len(o.unapproved_files) - 10
            return VersionPlan(
                o.name, o.sync, o.health, None,
                error=f"not promoted: the branch is not what was approved ({o.approval}; "
                f"changed since: {changed}{f' and {more} more' if more > 0 else ''}); "
                f"revert those commits, or have a reviewer approve it as it is now "
                f"(evotrainer approve {o.name}) — its run is not repeated",
            )
        return o.plan(Action("promote", f"verdict {verdict}"))
    if verdict == Verdict.PRUNE and not o.pruned:
        return o.plan(Action("prune", "verdict prune"))
    if o.evidence_pending:
        return o.plan(Action("evidence", f"file the {verdict} on the skills it applied"))
    return o.plan(note=f"done: {verdict}")


RULES: tuple[Callable[[Observed], VersionPlan | None], ...] = (
    rule_drift_reapproved,
    rule_parent_stopped,
    rule_not_run,
    rule_early_stop,
    rule_active_job,
    rule_cancelled,
    rule_stopped,
    rule_failed,
    rule_drifted,
    rule_diagnose,
    rule_rediagnose,
    rule_gate,
    rule_verdict,
)


def decide_next(o: Observed) -> VersionPlan:
    """The first rule that applies (`rule_verdict` always does)."""
    for rule in RULES:
        decided = rule(o)
        if decided is not None:
            return decided
    raise AssertionError("rule_verdict always decides")  # pragma: no cover


def approval_wait(o: Observed) -> VersionPlan:
    """A version that may not launch as it is: approve it now (autonomy) or say why not."""
    sync = "Drifted" if o.run else "OutOfSync"
    if o.auto_approvable:
        return VersionPlan(o.name, sync, o.health, Action("approve",
                                                          "autonomy allows it within budget"))
    if o.held_for_review:
        note = f"awaiting a reviewer: {o.held_for_review} (evotrainer approve {o.name})"
    elif o.approval == "stale":
        note = ("awaiting re-approval: the branch or its inherited recipe changed since it "
                f"was approved (evotrainer approve {o.name})")
    elif o.approval == "unsigned":
        note = ("awaiting a signed approval: main keeps allowed signers "
                f"(spec/allowed_signers) and no allowed key signed it: evotrainer approve "
                f"{o.name} with git's signing configured")
    elif o.approval == "forged":
        note = ("awaiting approval: its approval block was not written by this controller "
                f"(no valid seal), so it is not one: evotrainer approve {o.name}")
    else:
        note = f"awaiting approval: evotrainer approve {o.name}"
    return VersionPlan(o.name, sync, o.health, None, note)


def launch_or_wait(o: Observed, action: Action) -> VersionPlan:
    """A launch, unless the GPU budget is spent or the version continues from a parent
    whose policy is not there."""
    if o.budget_refusal is not None:
        return o.plan(note=f"waiting: {o.budget_refusal}")
    if o.parent_policy is None:
        return o.plan(action)
    if o.parent_policy.startswith("error: "):
        return VersionPlan(o.name, "Invalid", o.health, None,
                           error=o.parent_policy.removeprefix("error: "))
    return o.plan(note=o.parent_policy)


def progress_text(job: JobStatus) -> str:
    """`: step 3 of 8, ~2m left` from what the backend could tell, or nothing."""
    if job.steps_total is None or job.steps_done is None:
        return ""
    text = f": step {job.steps_done} of {job.steps_total}"
    if job.seconds_left is not None:
        minutes, seconds = divmod(int(job.seconds_left), 60)
        text += f", ~{minutes}m{seconds:02d}s left" if minutes else f", ~{seconds}s left"
    return text



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


def own_failures(run: RunRecord) -> int:
    """Failed attempts that were the run's own fault, the current one included."""
    history = [a for a in run.attempts if a.get("state") == JobState.FAILED]
    count = sum(not infrastructure_failure(a.get("detail", "")) for a in history)
    if run.state == JobState.FAILED and not infrastructure_failure(run.detail):
        count += 1
    return count

