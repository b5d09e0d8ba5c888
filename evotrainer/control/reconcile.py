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
from dataclasses import dataclass, field, replace
from functools import cached_property

import git
import pyarrow as pa

from evotrainer import API_VERSION
from evotrainer.backends import Backends
from evotrainer.backends.base import Backend, JobSpec, JobState, JobStatus, job_id
from evotrainer.control.live import LiveView, observe_running, saved_stop, stop_records
from evotrainer.control.validation import Validation, check_workspace, job_env
from evotrainer.diagnosis.diagnose import diagnose, diagnosis_document
from evotrainer.diagnosis.gate import decide, recorded_scores
from evotrainer.diagnosis.harness import HarnessRevision, resolve_harness
from evotrainer.diagnosis.skills import pending_evidence, record_evidence
from evotrainer.errors import EvoError
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.store import specs
from evotrainer.store.checkpoints import (
    CHECKPOINT,
    checkpoint_record,
    init_mode,
    is_dropped,
    parent_checkpoint,
    verify_directory,
)
from evotrainer.store.clock import now_iso
from evotrainer.store.git import PRUNED_TAG_PREFIX, branch_name
from evotrainer.store.lineage import merged_into_main, stop_progress, stopped_text, tree_order
from evotrainer.store.recipe import deep_merge, digest
from evotrainer.store.records import DecisionRecord, DiagnosisRecord, RunRecord
from evotrainer.store.seal import KEY_ENV
from evotrainer.store.workspace import VersionState, Workspace, run_path
from evotrainer.trackers.records import log_gate, run_identity

# The job states in which a job still runs (or will): what an early stop cancels.
LIVE_JOB_STATES = (JobState.PENDING, JobState.RUNNING, JobState.STALLED)

# How long an early stop waits for its cancelled job to end before the pass goes on.
STOP_WAIT_S = 10.0

# What a version's action may fail with and still leave the other versions to proceed.
VERSION_ERRORS = (EvoError, OSError, git.GitCommandError)

# Hard exit after the N-th action boundary: the crash-safety tests walk N over every one.
FAULT_ENV = "EVOTRAINER_FAULT_AFTER"


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


@dataclass
class Context:
    """Everything a pass reads once: specs and records from git, the harness in force, and
    the few lineage-wide facts the rules need (jobs holding a slot, steps spent, pruned
    tags, versions on main), kept current as the pass acts (`refreshed`).

    `live`: whether observing a running job looks at its evidence now (reconcile: a live
    diagnosis, saved under .evotrainer/live/) or reads the last look saved there (`plan`,
    which writes nothing)."""

    ws: Workspace
    states: dict[str, VersionState]
    harness: HarnessRevision
    backends: Backends = field(default_factory=Backends)
    validation: Validation = field(default_factory=Validation)
    live: bool = False
    # (version, job id) → the live look this context took of that job: one per pass.
    live_looks: dict[tuple[str, str], LiveView] = field(default_factory=dict)
    # Jobs holding a `max_concurrent_jobs` slot and training steps spent: counted over all
    # versions when the context is read, then adjusted by each action's change.
    active_jobs: int | None = None
    steps_spent: int | None = None

    def __post_init__(self) -> None:
        if self.active_jobs is None:
            self.active_jobs = sum(_holds_slot(s) for s in self.states.values())
        if self.steps_spent is None:
            self.steps_spent = sum(_steps_of(s) for s in self.states.values())

    def backend(self, name: str) -> Backend:
        return self.backends[name]

    @cached_property
    def pruned(self) -> set[str]:
        return set(self.ws.git.tags(PRUNED_TAG_PREFIX))

    @cached_property
    def on_main(self) -> set[str]:
        return merged_into_main(self.ws)

    def refreshed(self, name: str, kind: str) -> Context | None:
        """This context after `kind` was applied to `name`: that version re-read from its
        branch and the lineage-wide facts adjusted by its change, at a cost that does not
        grow with the number of branches. None when the action may have changed more than
        that version's records (an approval rewrites its spec, a promotion or an evidence
        filing moves main; so may a commit someone else made to the spec meanwhile): the
        caller then reads everything again. The tags and main are read again on first use
        (one git call each)."""
        if kind in FULL_RELOAD_ACTIONS:
            return None
        before = self.states.get(name)
        states = self.ws.reread(self.states, [name])
        after = states.get(name)
        if before is None or after is None or after.spec_raw != before.spec_raw:
            return None
        return replace(  # the same validation: no spec changed
            self, states=states,
            active_jobs=self.active_jobs + _holds_slot(after) - _holds_slot(before),
            steps_spent=self.steps_spent + _steps_of(after) - _steps_of(before),
        )


# Actions whose commit reaches beyond the acted version's records (see Context.refreshed).
FULL_RELOAD_ACTIONS = frozenset({"approve", "promote", "evidence"})


def _holds_slot(state: VersionState) -> bool:
    # A Stalled job still holds its machine (a hung verl job keeps its GPUs), so it keeps
    # its `max_concurrent_jobs` slot until it is cancelled or ends: one meaning of active.
    return state.run is not None and state.run.active


def _steps_of(state: VersionState) -> int:
    return state.run.steps_spent if state.run is not None else 0


def load_context(
    ws: Workspace, backends: Backends | Mapping[str, Backend] | None = None, live: bool = False
) -> Context:
    """Read the pass's inputs and run `validate`'s checks on them. Problems of the
    workspace-wide files (project, harness revisions, skills) refuse the whole pass.
    `backends`: the ones to use by name (default: the registry's, made on first use);
    `live`: look at running jobs' evidence now (reconcile) rather than read the last look."""
    if not isinstance(backends, Backends):
        backends = Backends(backends, ws.artifact_root / "cache")
    states = ws.versions()
    validation = check_workspace(ws, states, backends=backends, remember=live)
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
    return Context(ws, states, resolve_harness(harness_name, ws.root), backends, validation,
                   live=live)


# ---- planning: observe, then decide ---------------------------------------------------


def job_recipe(ctx: Context, state: VersionState, verify_parent: bool = False) -> dict:
    """The recipe the backend runs: an evaluation-only version trains for 0 steps; a version
    continuing from its parent (`model.init: parent`) carries the parent's recorded policy
    as `model.init_checkpoint` — checked against its digest when `verify_parent` (at launch:
    a child never starts from other weights), read from the record otherwise (polls)."""
    recipe = ctx.ws.resolved_recipe(state.name, ctx.states)
    if state.spec.get("train") is False:
        recipe = deep_merge(recipe, {"grpo": {"steps": 0}})
    if init_mode(recipe) == "parent" and state.parent:
        parent_run = ctx.states[state.parent].records.get("run")
        if verify_parent:
            policy = parent_checkpoint(ctx.ws, state.parent, parent_run)
        else:
            artifact = (ctx.states[state.parent].run or _NO_RUN).artifacts.get(CHECKPOINT) or {}
            policy = {"path": artifact.get("path"), "digest": artifact.get("digest")}
        path = ctx.ws.root / str(policy["path"])
        recipe = deep_merge(
            recipe, {"model": {"init_checkpoint": {"path": str(path), "digest": policy["digest"]}}}
        )
    return recipe


def recipe_steps(ctx: Context, state: VersionState) -> int:
    """The training steps a version's job would run (0 for an evaluation-only version)."""
    if state.spec.get("train") is False:
        return 0
    return int(ctx.ws.resolved_recipe(state.name, ctx.states)["grpo"]["steps"])


def within_budget(ctx: Context, state: VersionState) -> bool:
    """Would training `state` stay within `autonomy.max_total_steps`? (The one budget rule:
    reconcile's auto-approval and evolve's both ask it.)"""
    budget = (ctx.ws.project.get("autonomy") or {}).get("max_total_steps")
    return budget is None or steps_spent(ctx) + recipe_steps(ctx, state) <= budget


def job_for(ctx: Context, state: VersionState, run: dict) -> JobSpec:
    return JobSpec(
        job_id=run["job_id"],
        version=state.name,
        recipe=job_recipe(ctx, state),
        workdir=ctx.ws.worktree_path(state.name),
        artifact_dir=ctx.ws.run_dir(state.name, run),
        env=job_env(ctx.ws),
    )


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
    slot_free: bool = True
    max_attempts: int = 2
    job: JobStatus | None = None  # only for a run still active, or Stopped and not yet pruned
    live_stop: dict | None = None  # the early stop the running job's live diagnosis decided
    live_error: str | None = None  # why the live diagnosis failed (the job keeps running)
    stopped: dict | None = None  # a Stopped run's `stopped`: the rule, alert and step
    parent: str | None = None
    parent_run_state: str | None = None
    parent_diagnosed: bool = True
    parent_policy: str | None = None  # model.init: parent: why the parent's policy is missing
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


_NO_RUN = RunRecord(state="—", attempt=0, job_id="", backend="", artifact_dir="")


def observe(ctx: Context, state: VersionState) -> Observed:
    """Read what the rules decide from; only the facts a rule may still need are fetched
    (the backend is asked about active jobs only, git about promotion once gated)."""
    run, diagnosis, decision = state.run, state.diagnosis, state.decision
    parent = ctx.states.get(state.parent) if state.parent else None
    parent_run = parent.run if parent else None
    verdict = decision.verdict if decision else None
    pruned = verdict == "prune" and state.name in ctx.pruned
    job, live_stop, live_error = None, None, None
    # A Stopped run's job is asked about until the version is pruned: a pass that died
    # between the stop's commit and the cancel left it running.
    if run is not None and (run.active or run.state == "Stopped" and not pruned):
        job = ctx.backend(run.backend).status(job_for(ctx, state, state.records["run"]))
    if job is not None and run.active and job.state is JobState.RUNNING:
        live_stop, live_error = _live_stop(ctx, state)
    on_main = verdict in ("promote", "baseline") and state.name in ctx.on_main
    promoting = verdict in ("promote", "baseline") and not on_main
    # The approval (a digest of the branch's whole tree) is checked only where a rule reads
    # it: before a launch, a relaunch or a retry (a run not yet started, pending or failed,
    # or a spec drifted from its run) and before a promotion. Elsewhere no rule asks.
    approval = (
        ctx.ws.approval_status(state, ctx.states)
        if run is None or run.state in ("Pending", "Failed") or promoting
        or run.spec_digest != state.spec_digest
        else "not needed"
    )
    unapproved_files: tuple[str, ...] = ()
    if promoting and approval != "approved":
        unapproved_files = tuple(ctx.ws.unapproved_changes(state))
    parent_policy = None  # read by a launch only, which an approval precedes
    if (parent is not None and approval == "approved"
            and init_mode(ctx.ws.resolved_recipe(state.name, ctx.states)) == "parent"):
        parent_policy = _parent_policy_gap(parent.name, parent_run)
    return Observed(
        name=state.name,
        run=run,
        approval=approval,
        spec_digest=state.spec_digest,
        reapproved_after_run=run is not None
        and state.approval.get("at", "") > run.created_at,
        auto_approvable=approval not in ("approved", "not needed")
        and _auto_approvable(ctx, state),
        slot_free=_slot_free(ctx),
        max_attempts=int(ctx.ws.project.get("max_attempts", 2)),
        job=job,
        live_stop=live_stop,
        live_error=live_error,
        stopped=run.stopped if run is not None else None,
        parent=parent.name if parent else None,
        parent_run_state=parent_run.state if parent_run else None,
        parent_diagnosed=parent is None or parent.diagnosis is not None,
        parent_policy=parent_policy,
        diagnosis=diagnosis,
        decision=decision,
        harness_name=ctx.harness.name,
        harness_digest=ctx.harness.digest,
        on_main=on_main,
        unapproved_files=unapproved_files,
        pruned=pruned,
        evidence_pending=decision is not None
        and bool(pending_evidence(ctx.ws, state.name, state.records["decision"], ctx.states)),
    )


def _live_stop(ctx: Context, state: VersionState) -> tuple[dict | None, str | None]:
    """(the early stop decided for the running job, or None; why the live look failed, or
    None). In a read-only context (`plan`) the stop is the one the last live look saved,
    if it was for this job and this harness. Whatever goes wrong reading or diagnosing
    evidence that is still being written (a torn file, a harness rule erring on partial
    data) must never stop reconcile nor the job: it becomes the plan's note, and the full
    diagnosis after collect decides."""
    if not ctx.live:
        return saved_stop(ctx.ws, state.name, (state.run or _NO_RUN).job_id, ctx.harness), None
    try:
        view = live_look(ctx, state)
    except EvoError as err:
        return None, err.message
    except Exception as err:  # noqa: BLE001 — see above: any failure is reported, not raised
        return None, f"{err.__class__.__name__}: {err}"
    return view.stop, None


def live_look(ctx: Context, state: VersionState) -> LiveView:
    """The context's one live look at the version's running job (taken on first use)."""
    key = (state.name, (state.run or _NO_RUN).job_id)
    if key not in ctx.live_looks:
        ctx.live_looks[key] = observe_running(ctx.ws, state, state.records["run"], ctx.harness,
                                              job_recipe(ctx, state))
    return ctx.live_looks[key]


def _parent_policy_gap(parent: str, parent_run: RunRecord | None) -> str | None:
    """Why a continuing child cannot start yet (None: the parent's policy is recorded).
    Cheap: the digest is checked at launch, not on every plan."""
    if parent_run is None or parent_run.state != "Succeeded":
        return f"waiting for {parent}'s trained policy (model.init: parent)"
    artifact = parent_run.artifacts.get(CHECKPOINT)
    if not artifact:
        return f"error: {parent} finished without a recorded policy (model.init: parent)"
    if is_dropped(artifact):
        return (f"error: {parent}'s policy was dropped by the retention policy; retry "
                f"{parent} or set model.init: base")
    return None


# ---- the rules: each returns a plan when it applies, else None; the first that applies wins


def rule_drift_reapproved(o: Observed) -> VersionPlan | None:
    if o.drifted and o.approval == "approved" and o.reapproved_after_run:
        return o.plan(Action("retry", "spec changed after the run and was re-approved"))
    return None


def rule_parent_stopped(o: Observed) -> VersionPlan | None:
    """A parent stopped early has no final scores: its child could train but never be
    compared or gated, so it is refused before it spends compute."""
    if o.parent_run_state != "Stopped" or (o.run is not None and not o.run.active):
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
        return o.plan(Action("collect", "job finished"), health="Succeeded")
    if job.state is JobState.UNKNOWN and health == "Pending":
        if o.approval != "approved":
            return approval_wait(o)
        return launch_or_wait(o, Action("launch", "run recorded but job never started"))
    if job.state in (JobState.FAILED, JobState.UNKNOWN):
        why = job.detail if job.state is JobState.FAILED else (
            "the backend has no record of the job (artifact dir missing?)")
        return o.plan(Action("fail", why), health="Failed")
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
                         f"{stop['reason']}"), health="Stopped")


def rule_cancelled(o: Observed) -> VersionPlan | None:
    if o.run is None or o.run.state != "Cancelled":
        return None
    return o.plan(note=f"cancelled ({o.run.detail}); `evotrainer retry {o.name}` relaunches it")


def rule_stopped(o: Observed) -> VersionPlan | None:
    """A run stopped early has no final scores: nothing to collect, diagnose or gate; its
    prune decision was committed with it, so the verdict's actions follow."""
    if o.run is None or o.run.state != "Stopped":
        return None
    if o.job is not None and o.job.state in LIVE_JOB_STATES:
        return o.plan(Action("stop", "the stopped job is still running"))
    decided = rule_verdict(o)
    if decided.action is None:
        decided.note = f"{stopped_text(o.stopped)}; {decided.note}"
    return decided


def rule_failed(o: Observed) -> VersionPlan | None:
    if o.run is None or o.run.state != "Failed":
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
    if o.parent is not None and o.parent_run_state != "Succeeded":
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
    return o.plan(Action("gate", "diagnosed, not yet gated"))


def rule_verdict(o: Observed) -> VersionPlan | None:
    verdict = o.decision.verdict if o.decision else None
    if verdict in ("promote", "baseline") and not o.on_main:
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
    if verdict == "prune" and not o.pruned:
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
    if o.approval == "stale":
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
    """A launch, unless the version continues from a parent whose policy is not there."""
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


def plan_version(ctx: Context, state: VersionState) -> VersionPlan:
    """The next action of one version; a version's own error never stops the others."""
    refusal = ctx.validation.refusal(state.name, ctx.states)
    if refusal is not None:
        return error_plan(state.name, f"invalid: {refusal}")
    if state.record_errors:  # unreadable first (it names the field), then forged
        kind, err = next(iter(state.record_errors.items()))
        if kind == "seal":
            return error_plan(state.name, str(err))
        return error_plan(state.name, f"unreadable {kind} record: {err.message}")
    if state.unverified:
        run = state.run
        return VersionPlan(
            state.name, "Unverified", run.state if run else "—", None,
            note="its records and approval cannot be verified here: this machine holds no "
            f"record key (set {KEY_ENV} to the controller's); nothing is done with them",
        )
    try:
        return decide_next(observe(ctx, state))
    except VERSION_ERRORS as err:
        return error_plan(state.name, str(err), (state.run or _NO_RUN).state)


def plan(ctx: Context) -> list[VersionPlan]:
    return [plan_version(ctx, ctx.states[name]) for name in tree_order(ctx.states)]


def _slot_free(ctx: Context) -> bool:
    limit = (ctx.ws.project.get("autonomy") or {}).get("max_concurrent_jobs", 1)
    return (ctx.active_jobs or 0) < limit


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
    history = [a for a in run.attempts if a.get("state") == "Failed"]
    count = sum(not infrastructure_failure(a.get("detail", "")) for a in history)
    if run.state == "Failed" and not infrastructure_failure(run.detail):
        count += 1
    return count


def steps_spent(ctx: Context) -> int:
    """Training steps of every run recorded so far (the autonomy budget's unit)."""
    return ctx.steps_spent or 0


def _auto_approvable(ctx: Context, state: VersionState) -> bool:
    autonomy = ctx.ws.project.get("autonomy") or {}
    if autonomy.get("mode") != "auto" or (state.spec.get("proposal") or {}).get("escalation"):
        return False  # an escalation (rollback after repeated failures) waits for a human
    return within_budget(ctx, state)


def launch_job(
    ctx: Context, state: VersionState, attempt: int | None = None, history: list | None = None
) -> tuple[dict, JobSpec]:
    """The Pending run record and the job reconcile submits for it — and what `render`
    prints: one function builds both (the parent's policy is checked once)."""
    recipe = job_recipe(ctx, state, verify_parent=True)
    run = launch_record(ctx, state, attempt, history, recipe)
    job = JobSpec(run["job_id"], state.name, recipe, ctx.ws.worktree_path(state.name),
                  ctx.ws.run_dir(state.name, run), job_env(ctx.ws))
    return run, job


def launch_record(
    ctx: Context,
    state: VersionState,
    attempt: int | None = None,
    history: list | None = None,
    recipe: dict | None = None,
) -> dict:
    """The Pending run record committed before a job starts (its id is deterministic);
    `recipe`: the job recipe when the caller has it."""
    previous = state.records.get("run") or {}
    attempt = attempt or previous.get("attempt", 1)
    recipe = recipe or job_recipe(ctx, state, verify_parent=True)
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
    run = state.run
    if run is None or run.state not in ("Failed", "Cancelled"):
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
        run, job = launch_job(ctx, state, attempt, history)
        jid, attempt = run["job_id"], run["attempt"]
        if previous.get("job_id") != jid or previous.get("state") != "Pending":
            self._commit_run(state, run, f"Launch {state.name} attempt {attempt} ({jid})", "launch")
            self.boundary()
        self.ws.git.worktree_add(job.workdir, self.ws.spec_commit(state))
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
        if status.state not in LIVE_JOB_STATES:
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
        if collected.checkpoint is not None:  # the trained policy, recorded by its digest
            artifacts[CHECKPOINT] = checkpoint_record(
                collected.checkpoint, self.ws.record_path(collected.checkpoint)
            )
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
        if run["state"] != "Stopped":
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
        while backend.status(job).state in LIVE_JOB_STATES and time.monotonic() < deadline:
            time.sleep(0.2)
        if run["state"] != "Stopped":
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
    for kind, artifact in (state.run or _NO_RUN).artifacts.items():
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
    if state.run is None or not state.run.succeeded:
        raise EvoError(
            f"{name} has no collected run to diagnose",
            hint="`evotrainer reconcile --wait` trains and collects it first",
        )
    return Reconciler(ws, log=lambda _: None)._diagnose(ctx, state), ctx.harness
