"""Observing the world for reconcile: one read of every version (specs and records from git,
validated once), the backend's word on each active job and at most one live look at each
running job a pass, gathered into the `Observed` each version's rules decide from
(control/decide.py).

`Context` is what a pass reads once; after an action only the acted version is read again
(`Context.refreshed`), so an action costs the same however many branches there are. The
work of a launch is done once: the job recipe is resolved and the parent's policy hashed
in `pending_launch`, and the backend checks that recipe once (`launch_record`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import git

from evotrainer import API_VERSION
from evotrainer.backends import Backends
from evotrainer.backends.base import Backend, JobSpec, job_id
from evotrainer.control.decide import Observed, VersionPlan, decide_next, error_plan
from evotrainer.control.live import LiveView, observe_running, saved_stop
from evotrainer.control.validation import (
    Validation,
    check_workspace,
    declared_data_roots,
    job_env,
)
from evotrainer.diagnosis.harness import HarnessRevision, resolve_harness
from evotrainer.errors import EvoError
from evotrainer.gate.counterfactual import control_of
from evotrainer.skills.library import pending_evidence
from evotrainer.skills.skill import RESTRICTED_PATCH_KEYS, restricted_keys
from evotrainer.store.checkpoints import CHECKPOINT, init_mode, is_dropped, parent_checkpoint
from evotrainer.store.clock import now_iso
from evotrainer.store.git import PRUNED_TAG_PREFIX
from evotrainer.store.lineage import merged_into_main, tree_order
from evotrainer.store.recipe import deep_merge, digest, resolve
from evotrainer.store.records import MERGING, JobState, RunRecord, Verdict
from evotrainer.store.seal import KEY_ENV
from evotrainer.store.workspace import VersionState, Workspace

# What a version's action may fail with and still leave the other versions to proceed.
VERSION_ERRORS = (EvoError, OSError, git.GitCommandError)


@dataclass
class Context:
    """Everything a pass reads once: specs and records from git, the harness in force, and
    the few lineage-wide facts the rules need (jobs holding a slot, steps and GPU-hours
    spent, pruned tags, versions on main), kept current as the pass acts (`refreshed`).

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
    # Jobs holding a `max_concurrent_jobs` slot, training steps and GPU-hours spent (a
    # running job's so far, at `now`): counted over all versions when the context is read,
    # then adjusted by each action's change.
    active_jobs: int | None = None
    steps_spent: int | None = None
    gpu_hours_spent: float | None = None
    now: str = field(default_factory=now_iso)
    # The project document and the restricted part of its recipe, which every unapproved
    # version's recipe is compared with (`_held_for_review`): resolved once a document.
    reviewed: tuple[Any, Any] = field(default=(None, None), repr=False, compare=False)
    # Each recipe mapping's restricted part, by identity (`_restricted_part`).
    restricted_parts: dict[int, tuple[Any, Any]] = field(default_factory=dict, repr=False,
                                                         compare=False)

    def __post_init__(self) -> None:
        if self.active_jobs is None:
            self.active_jobs = sum(_holds_slot(s) for s in self.states.values())
        if self.steps_spent is None:
            self.steps_spent = sum(_steps_of(s) for s in self.states.values())
        if self.gpu_hours_spent is None:
            self.gpu_hours_spent = sum(self.gpu_hours_of(s) for s in self.states.values())

    def gpu_hours_of(self, state: VersionState) -> float:
        return state.run.gpu_hours_spent(self.now) if state.run is not None else 0.0

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
            gpu_hours_spent=self.gpu_hours_spent + self.gpu_hours_of(after)
            - self.gpu_hours_of(before),
        )


# Actions whose commit reaches beyond the acted version's records (see Context.refreshed).
FULL_RELOAD_ACTIONS = frozenset({"approve", "promote", "evidence"})


def _holds_slot(state: VersionState) -> bool:
    # A Stalled job still holds its machine (a hung verl job keeps its GPUs, and its
    # GPU-hours keep counting), so it keeps its `max_concurrent_jobs` slot until it is
    # cancelled or ends: one meaning of active (JobState.active).
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
            artifact = (ctx.states[state.parent].run or NO_RUN).artifacts.get(CHECKPOINT) or {}
            policy = {"path": artifact.get("path"), "digest": artifact.get("digest")}
        path = ctx.ws.root / str(policy["path"])
        recipe = deep_merge(
            recipe, {"model": {"init_checkpoint": {"path": str(path), "digest": policy["digest"]}}}
        )
    return recipe


def recipe_steps(ctx: Context, state: VersionState) -> int:
    """The training steps a version's job would run, every seed's (0 for an evaluation-only
    version): the unit its run record's `steps_done` counts."""
    if state.spec.get("train") is False:
        return 0
    recipe = ctx.ws.resolved_recipe(state.name, ctx.states)
    return int(recipe["grpo"]["steps"]) * len(recipe.get("seeds") or [0])


def within_budget(ctx: Context, state: VersionState) -> bool:
    """Would training `state` stay within `autonomy.max_total_steps` and
    `autonomy.max_gpu_hours`? (The one budget rule: reconcile's auto-approval and evolve's
    both ask it; a launch asks `gpu_budget_refusal`.)"""
    budget = (ctx.ws.project.get("autonomy") or {}).get("max_total_steps")
    steps_ok = budget is None or steps_spent(ctx) + recipe_steps(ctx, state) <= budget
    return steps_ok and gpu_budget_refusal(ctx, state) is None


def requested_resources(ctx: Context, recipe: dict) -> dict[str, int]:
    """What a job of `recipe` asks its backend for ({nodes, gpus_per_node, gpus}), in the
    backend's own words."""
    return ctx.backend(recipe["backend"]).resources(recipe)


def gpu_budget_refusal(ctx: Context, state: VersionState) -> str | None:
    """Why `state`'s job may not launch under `autonomy.max_gpu_hours`, or None. A run's
    GPU-hours are known only as it runs, so the budget binds at the launch: a job asking for
    GPUs starts only while the GPU-hours recorded (every attempt, running jobs until now)
    are below it; a CPU job spends none and always may."""
    budget = (ctx.ws.project.get("autonomy") or {}).get("max_gpu_hours")
    if budget is None:
        return None
    recipe = ctx.ws.resolved_recipe(state.name, ctx.states, shared=True)
    gpus = requested_resources(ctx, recipe)["gpus"]
    spent = ctx.gpu_hours_spent or 0.0
    if gpus == 0 or spent < budget:
        return None
    return (f"autonomy.max_gpu_hours ({budget:g}) is spent: {spent:.3g} GPU-hours recorded, "
            f"and {state.name}'s job asks for {gpus} GPU(s); raise the budget in "
            f"spec/project.yaml to launch it")


def job_for(ctx: Context, state: VersionState, run: dict) -> JobSpec:
    return JobSpec(
        job_id=run["job_id"],
        version=state.name,
        recipe=job_recipe(ctx, state),
        workdir=ctx.ws.worktree_path(state.name),
        artifact_dir=ctx.ws.run_dir(state.name, run),
        env=job_env(ctx.ws),
    )



NO_RUN = RunRecord(state="—", attempt=0, job_id="", backend="", artifact_dir="")


def observe(ctx: Context, state: VersionState) -> Observed:
    """Read what the rules decide from; only the facts a rule may still need are fetched
    (the backend is asked about active jobs only, git about promotion once gated)."""
    run, diagnosis, decision = state.run, state.diagnosis, state.decision
    parent = ctx.states.get(state.parent) if state.parent else None
    parent_run = parent.run if parent else None
    control = control_of(state.spec)  # a treatment is gated once its control is diagnosed
    control_state = ctx.states.get(control) if control else None
    verdict = decision.verdict if decision else None
    pruned = verdict == Verdict.PRUNE and state.name in ctx.pruned
    job, live_stop, live_error = None, None, None
    # A Stopped run's job is asked about until the version is pruned: a pass that died
    # between the stop's commit and the cancel left it running.
    if run is not None and (run.active or run.state == JobState.STOPPED and not pruned):
        job = ctx.backend(run.backend).status(job_for(ctx, state, state.records["run"]))
    if job is not None and run.active and job.state is JobState.RUNNING:
        live_stop, live_error = _live_stop(ctx, state)
    on_main = verdict in MERGING and state.name in ctx.on_main
    promoting = verdict in MERGING and not on_main
    # The approval (a digest of the branch's whole tree) is checked only where a rule reads
    # it: before a launch, a relaunch or a retry (a run not yet started, pending or failed,
    # or a spec drifted from its run) and before a promotion. Elsewhere no rule asks.
    approval = (
        ctx.ws.approval_status(state, ctx.states)
        if run is None or run.state in (JobState.PENDING, JobState.FAILED) or promoting
        or run.spec_digest != state.spec_digest
        else "not needed"
    )
    unapproved_files: tuple[str, ...] = ()
    if promoting and approval != "approved":
        unapproved_files = tuple(ctx.ws.unapproved_changes(state))
    parent_policy = budget_refusal = None  # read by a launch only, which an approval precedes
    if approval == "approved":
        budget_refusal = gpu_budget_refusal(ctx, state)
    if (parent is not None and approval == "approved"
            and init_mode(ctx.ws.resolved_recipe(state.name, ctx.states)) == "parent"):
        parent_policy = _parent_policy_gap(parent.name, parent_run)
    return Observed(
        name=state.name,
        run=run,
        approval=approval,
        spec_digest=state.spec_digest,
        # Timestamps are to the second, so an approval in the launch's own second counts:
        # drifted, an approval that holds binds content other than what ran, and only an
        # older one (a restored approval block) must not retrain it.
        reapproved_after_run=run is not None
        and state.approval.get("at", "") >= run.created_at,
        auto_approvable=approval not in ("approved", "not needed")
        and _auto_approvable(ctx, state),
        held_for_review=_held_for_review(ctx, state) if approval not in (
            "approved", "not needed") else "",
        slot_free=_slot_free(ctx),
        max_attempts=int(ctx.ws.project.get("max_attempts", 2)),
        job=job,
        live_stop=live_stop,
        live_error=live_error,
        stopped=run.stopped if run is not None else None,
        parent=parent.name if parent else None,
        parent_run_state=parent_run.state if parent_run else None,
        parent_diagnosed=parent is None or parent.diagnosis is not None,
        control=control,
        control_diagnosed=control is None
        or control_state is not None and control_state.diagnosis is not None,
        parent_policy=parent_policy,
        budget_refusal=budget_refusal,
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
        return saved_stop(ctx.ws, state.name, (state.run or NO_RUN).job_id, ctx.harness), None
    try:
        view = live_look(ctx, state)
    except EvoError as err:
        return None, err.message
    except Exception as err:  # noqa: BLE001 — see above: any failure is reported, not raised
        return None, f"{err.__class__.__name__}: {err}"
    return view.stop, None


def live_look(ctx: Context, state: VersionState) -> LiveView:
    """The context's one live look at the version's running job (taken on first use)."""
    key = (state.name, (state.run or NO_RUN).job_id)
    if key not in ctx.live_looks:
        recipe = job_recipe(ctx, state)
        ctx.live_looks[key] = observe_running(ctx.ws, state, state.records["run"], ctx.harness,
                                              recipe, ctx.backend(recipe["backend"]))
    return ctx.live_looks[key]


def _parent_policy_gap(parent: str, parent_run: RunRecord | None) -> str | None:
    """Why a continuing child cannot start yet (None: the parent's policy is recorded).
    Cheap: the digest is checked at launch, not on every plan."""
    if parent_run is None or parent_run.state != JobState.SUCCEEDED:
        return f"waiting for {parent}'s trained policy (model.init: parent)"
    artifact = parent_run.artifacts.get(CHECKPOINT)
    if not artifact:
        return f"error: {parent} finished without a recorded policy (model.init: parent)"
    if is_dropped(artifact):
        return (f"error: {parent}'s policy was dropped by the retention policy; retry "
                f"{parent} or set model.init: base")
    return None



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
        decided = decide_next(observe(ctx, state))
    except VERSION_ERRORS as err:
        return error_plan(state.name, str(err), (state.run or NO_RUN).state)
    if state.changed_after_record and state.run is not None and decided.error is None:
        # Commits after its records nobody recorded or reviewed: a child forked from this
        # tip carries them into main, so the version says so instead of "done".
        files = state.changed_after_record
        shown = ", ".join(files[:10]) + (f" and {len(files) - 10} more" if len(files) > 10
                                         else "")
        decided.error = (
            f"changed after its records: evo/{state.name} holds commits the controller did "
            f"not record ({shown}); a version forked from it carries them into main. "
            f"Revert those commits on evo/{state.name}, and review `git diff main...evo/V` "
            "of its children before approving them")
    return decided


def plan(ctx: Context) -> list[VersionPlan]:
    return [plan_version(ctx, ctx.states[name]) for name in tree_order(ctx.states)]


def _slot_free(ctx: Context) -> bool:
    limit = (ctx.ws.project.get("autonomy") or {}).get("max_concurrent_jobs", 1)
    return (ctx.active_jobs or 0) < limit



def steps_spent(ctx: Context) -> int:
    """Training steps of every run recorded so far (the autonomy budget's unit)."""
    return ctx.steps_spent or 0


def _auto_approvable(ctx: Context, state: VersionState) -> bool:
    autonomy = ctx.ws.project.get("autonomy") or {}
    if autonomy.get("mode") != "auto" or (state.spec.get("proposal") or {}).get("escalation"):
        return False  # an escalation (rollback after repeated failures) waits for a human
    return not _held_for_review(ctx, state) and within_budget(ctx, state)


def _held_for_review(ctx: Context, state: VersionState) -> str:
    """Why autonomy may not approve `state` even within budget: its resolved recipe runs a
    command, reaches an endpoint or names a secret (skills.RESTRICTED_PATCH_KEYS) other than
    main's project recipe does. Anyone who can push an `evo/*` branch could otherwise have
    the controller run their command; such a version waits for a reviewer."""
    try:
        recipe = ctx.ws.resolved_recipe(state.name, ctx.states, shared=True)
    except EvoError:
        return ""  # validation reports it; nothing is approved or launched meanwhile
    project = ctx.ws.project
    if ctx.reviewed[0] is not project:
        reviewed = resolve(project.get("recipe") or {}, [])
        ctx.reviewed = (project, _restricted_part(reviewed, ctx.restricted_parts))
    if _restricted_part(recipe, ctx.restricted_parts) == ctx.reviewed[1]:
        return ""
    keys = ", ".join(sorted(set(restricted_keys(recipe)))[:5])
    return (f"its recipe's commands, endpoints or secrets ({keys}) are not main's project "
            "recipe's, and those need a reviewer")


def _restricted_part(tree: Any, memo: dict[int, tuple[Any, Any]]) -> Any:
    """Only the parts of a recipe under a restricted key (with the path that leads there).
    Resolved recipes share the subtrees their overrides leave alone (recipe.deep_merge), so
    a mapping's part is found once and kept in `memo` by its identity (the mapping is kept
    there too, so its id is not reused); no reader changes a resolved recipe."""
    if isinstance(tree, dict):
        known = memo.get(id(tree))
        if known is not None and known[0] is tree:
            return known[1]
        kept = {k: (v if k in RESTRICTED_PATCH_KEYS else _restricted_part(v, memo))
                for k, v in tree.items()}
        part = {k: v for k, v in kept.items() if v not in (None, {}, [])}
        memo[id(tree)] = (tree, part)
        return part
    if isinstance(tree, list):
        parts = (_restricted_part(item, memo) for item in tree)
        return [part for part in parts if part not in (None, {}, [])]
    return None


def pending_launch(
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
    # The backend's checks, once: the pass's validation already ran them on a job recipe
    # that is the version's resolved recipe (one that continues from its parent or trains
    # no step differs from it, and is checked here, with the data roots a job is given).
    with declared_data_roots(ctx.ws):
        problem = ctx.validation.recipe_problem(recipe, ctx.backend(recipe["backend"]))
    if problem is not None:
        raise problem
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
        "state": JobState.PENDING.value,
        "created_at": previous.get("created_at")
        if previous.get("job_id") == jid
        else now_iso(),
        "artifact_dir": ctx.ws.record_path(ctx.ws.artifact_dir(state.name, jid)),
        "resources": requested_resources(ctx, recipe),
    }
    if history or previous.get("attempts"):
        run["attempts"] = history if history is not None else previous["attempts"]
    return run


def attempt_history(run: dict) -> list[dict]:
    """The attempts so far, the current (failed) one appended: what a retry carries, its
    steps and hours with it (the budgets count every attempt)."""
    typed = RunRecord.from_record(run) or NO_RUN
    return list(run.get("attempts") or []) + [
        {
            "attempt": run["attempt"],
            "job_id": run["job_id"],
            "state": run["state"],
            "detail": run.get("detail", ""),
            "steps": int((run.get("result") or {}).get("steps_done") or 0),
            "wall_hours": typed.wall_hours(),
            "gpu_hours": typed.gpu_hours(),
        }
    ]

