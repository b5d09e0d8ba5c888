"""From the workspace's records to tracker runs: a version's lineage identity, the gate's
summary, and the replay of a recorded version (`evotrainer export --to TRACKER`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc

from evotrainer.errors import EvoError
from evotrainer.evidence.io import read_steps
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.store import recipe as recipes
from evotrainer.store.workspace import VersionState, Workspace
from evotrainer.trackers import RunIdentity, logger_names, open_trackers


def run_identity(
    ws: Workspace, state: VersionState, states: dict[str, VersionState]
) -> RunIdentity:
    """The version's lineage as tracker tags. What a launch hands its job (`write`), and what
    an export recomputes, so both land in the same tracker run."""
    spec = state.spec or {}
    intervention = spec.get("intervention") or {}
    run = state.run
    recipe_digest = (run.recipe_digest if run else None) or recipes.digest(
        ws.resolved_recipe(state.name, states))
    tags = {
        "version": state.name,
        "parent": state.parent or "",
        "intervention": str(intervention.get("rationale") or spec.get("description") or ""),
        "skills": ",".join(str(s) for s in intervention.get("skills") or []),
        "harness": ws.harness_in_force(state),
        "recipe_digest": recipe_digest,
        "spec_commit": ws.spec_commit(state),
    }
    hypothesis = intervention.get("hypothesis") or {}
    if hypothesis.get("criterion"):
        tags["criterion"] = str(hypothesis["criterion"])
    if run:
        tags["backend"] = run.backend
    return RunIdentity(
        project=str(ws.project.get("name") or ws.root.name),
        version=state.name,
        job_id=(run.job_id if run else "") or "unlaunched",
        store_root=str(ws.artifact_root.resolve()),
        tags=tags,
    )


def run_dir_of(ws: Workspace, state: VersionState) -> Path:
    """The run's artifact dir, checked (`Workspace.run_dir`): trackers write only there."""
    return ws.run_dir(state.name, state.records["run"])


@dataclass(frozen=True)
class GateSummary:
    values: dict[str, float]
    tags: dict[str, str]


def gate_summary(decision: dict | None, diagnosis: dict | None) -> GateSummary:
    """The gate's verdict, Δ with its CI, and the diagnosis's alerts, as a run summary."""
    decision, diagnosis = decision or {}, diagnosis or {}
    comparison = decision.get("comparison") or {}
    values = {
        f"gate/{key}": float(comparison[key])
        for key in ("delta", "ci_low", "ci_high", "p_bootstrap", "mean_a", "mean_b")
        if isinstance(comparison.get(key), (int, float))
    }
    alerts = [a for a in diagnosis.get("alerts") or [] if isinstance(a, dict)]
    tags = {"alerts": ",".join(str(a.get("name", "?")) for a in alerts)}
    tags |= {f"alerts/{a.get('name', '?')}": str(a.get("severity", "")) for a in alerts}
    if decision.get("verdict"):
        tags["gate/verdict"] = str(decision["verdict"])
        tags["gate/reason"] = str(decision.get("reason", ""))
        tags["gate/blocked_by"] = ",".join(str(b) for b in decision.get("blocked_by") or [])
    return GateSummary(values, tags)


@dataclass(frozen=True)
class Exported:
    version: str
    seeds: list[int]
    steps: int  # steps logged, summed over the seeds
    where: Path


def export_version(
    ws: Workspace,
    name: str,
    loggers: list[str],
    states: dict[str, VersionState] | None = None,
    emit: Callable[[str], None] | None = None,
) -> Exported:
    """Replay a recorded version into `loggers`: one run per seed with its lineage tags,
    every recorded step's metrics from `steps.parquet`, and the gate's summary. A run the
    tracker already holds for the same version, job and seed is replaced, not duplicated."""
    states = states if states is not None else ws.versions()
    state = ws.version(name, states)
    run = state.run
    if run is None or not run.succeeded:
        raise EvoError(f"{name} has no finished run to export", where=state.spec_source,
                       hint="export versions that `evotrainer lineage` shows as trained")
    run_dir = run_dir_of(ws, state)
    steps_file = RunArtifacts(run_dir).steps
    if not steps_file.is_file():
        raise EvoError(f"the step metrics of {name} are gone", where=str(steps_file),
                       hint="the records in git are intact; restore the artifact folder")
    steps = read_steps(steps_file)
    identity = run_identity(ws, state, states)
    summary = gate_summary(state.records.get("decision"), state.records.get("diagnosis"))
    seeds = sorted({int(s) for s in steps.column("seed").to_pylist()}) or [
        int(s) for s in run.result.get("seeds") or [0]]
    written = 0
    for seed in seeds:
        rows = steps.filter(pc.equal(steps.column("seed"), seed)).to_pylist()
        by_step: dict[int, dict[str, float]] = {}
        for row in rows:
            by_step.setdefault(int(row["step"]), {})[row["metric"]] = row["value"]
        with open_trackers(loggers, run_dir, identity, seed=seed, emit=emit,
                           replace=True) as trackers:
            for step in sorted(by_step):  # W&B drops a step lower than one already logged
                trackers.log(step, by_step[step])
            final = run.seed_steps or trackers.last_step
            trackers.summary(summary.values, summary.tags, step=max(final, trackers.last_step))
        written += len(by_step)
    return Exported(name, seeds, written, run_dir)


def log_gate(
    ws: Workspace,
    state: VersionState,
    states: dict[str, VersionState],
    decision: dict,
    emit: Callable[[str], None] | None = None,
) -> None:
    """At gate time: add the verdict, Δ, CI and alerts to the runs the version's training
    logged (reopened by their key), for the loggers its recipe lists."""
    run = state.run
    if run is None or not run.artifact_dir:
        return  # never launched: no tracker run to add to
    # Without `emit` the console logger is left out: reconcile prints the gate's own line,
    # and a summary on stderr would say it twice.
    loggers = [name for name in logger_names(ws.resolved_recipe(state.name, states),
                                             where=state.spec_source)
               if name != "console" or emit is not None]
    identity = run_identity(ws, state, states)
    summary = gate_summary(decision, state.records.get("diagnosis"))
    for seed in run.result.get("seeds") or [0]:
        with open_trackers(loggers, run_dir_of(ws, state), identity, seed=int(seed),
                           emit=emit) as trackers:
            trackers.summary(summary.values, summary.tags, step=run.seed_steps)
