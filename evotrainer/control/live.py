"""Live runs: the evidence a running job has written so far, diagnosed as it grows with the
harness in force, its progress, and the harness's early-stop decision.

What is read is the job's backend's to say (`Backend.live_evidence`): the embedded engine's
files are read whole when they changed, a verl job's dumps from where the last read stopped.
The diagnosis is incremental (`diagnose_incremental`): work proportional to the new rows.

Where live state lives: `.evotrainer/live/<version>/`, git-ignored like the rest of
`.evotrainer/`. A watched run polled every few seconds would otherwise flood the version's
branch with diagnosis commits. The one record stays the one at the end: the diagnosis after
collect, or, when an early-stop rule stops the job, the last live diagnosis committed with
the stopped run and the decision in one commit (`stop_records`).

  state.json            job id, harness digest, what the backend read (handed back at the
                        next look), progress, the stop once decided
  diagnosis-state.json  the incremental DiagnosisState (JSON, no pickle)
  diagnosis.json        the latest live diagnosis (what `evotrainer watch` shows)
  backend/              what the backend keeps between looks (verl: the rows read so far)
"""

from __future__ import annotations

import fcntl
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evotrainer.backends import get_backend
from evotrainer.backends.base import Backend, JobSpec, LiveEvidence
from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.errors import EvoError
from evotrainer.store.cel import evaluate_unless_null
from evotrainer.store.clock import now_iso
from evotrainer.store.files import atomic_write, read_json
from evotrainer.store.records import JobState, ended_run
from evotrainer.store.workspace import VersionState, Workspace

if TYPE_CHECKING:
    import pyarrow as pa

    from evotrainer.engine.outputs import JobProgress

# The diagnosis (pyarrow, DuckDB) and the gate's records are imported where a running job is
# diagnosed or stopped: `plan` and `validate` import this module and never do either.

LIVE_DIR = "live"
STATE_FILE = "state.json"
DIAGNOSIS_STATE_FILE = "diagnosis-state.json"
DIAGNOSIS_FILE = "diagnosis.json"
BACKEND_CACHE = "backend"


@dataclass
class LiveView:
    """One look at a running job: progress, the live diagnosis, the early-stop decision."""

    version: str
    job_id: str
    backend: str
    step: int = 0  # training steps done, summed over seeds
    steps: int = 0  # training steps the job runs, summed over seeds
    rows: int = 0  # train rollouts written so far
    val_rows: int = 0
    elapsed_s: float | None = None
    step_s: float | None = None  # seconds a training step takes, where the job records it
    diagnosis: dict | None = None  # None: no evidence written yet
    stop: dict | None = None  # {rule, reason, alert, step, steps, rows, at} once a rule held
    fresh: bool = False  # whether this look diagnosed new evidence

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the steps' own pace where the job records it; otherwise at the pace
        since the job started. None before the pace is known."""
        if not self.step or self.step >= self.steps:
            return None
        if self.step_s is not None:
            return self.step_s * (self.steps - self.step)
        if self.elapsed_s:
            return self.elapsed_s * (self.steps - self.step) / self.step
        return None

    def as_dict(self) -> dict:
        diagnosis = self.diagnosis or {}
        return {
            "version": self.version,
            "job_id": self.job_id,
            "backend": self.backend,
            "step": self.step,
            "steps": self.steps,
            "rows": self.rows,
            "val_rows": self.val_rows,
            "elapsed_s": self.elapsed_s,
            "eta_s": self.eta_s,
            "alerts": [
                {k: a[k] for k in ("name", "severity", "metric", "value")}
                for a in diagnosis.get("alerts", [])
            ],
            "stop": self.stop,
        }


def live_dir(ws: Workspace, version: str) -> Path:
    return ws.state_dir / LIVE_DIR / version


def saved_stop(
    ws: Workspace, version: str, job_id: str, harness: HarnessRevision
) -> dict | None:
    """The early stop the last live look at job `job_id` decided under `harness`, read
    without looking again and without writing anything (what `plan` shows; reconcile
    looks again before it stops a job)."""
    saved = read_json(live_dir(ws, version) / STATE_FILE)
    if not isinstance(saved, dict) or (saved.get("job_id"), saved.get("harness_digest")) != (
        job_id, harness.digest
    ):
        return None
    return saved.get("stop")


def observe_running(
    ws: Workspace,
    state: VersionState,
    run: dict,
    harness: HarnessRevision,
    recipe: dict | None = None,
    backend: Backend | None = None,
) -> LiveView:
    """Read what the job of `run` (the version's run record) has written since the last look,
    diagnose it incrementally with `harness`, and decide whether a rule of the harness's
    `early_stop` says the job must stop. `recipe` is the job's recipe (default: the one the
    job was given, else the version's resolved recipe); `backend` the one running it
    (default: the registry's, by the run record's name). Safe to call from several processes
    (reconcile and watch): each look holds the version's live lock."""
    folder = live_dir(ws, state.name)
    folder.mkdir(parents=True, exist_ok=True)
    artifact_dir = ws.root / run["artifact_dir"]
    recipe = recipe or read_json(artifact_dir / "recipe.json") or ws.resolved_recipe(state.name)
    with _locked(folder):
        saved = read_json(folder / STATE_FILE) or {}
        if saved.get("job_id") != run["job_id"]:
            _reset(folder)
            saved = {}
        view = LiveView(state.name, run["job_id"], run.get("backend", recipe["backend"]))
        backend = backend or get_backend(view.backend)
        job = JobSpec(run["job_id"], state.name, recipe, ws.worktree_path(state.name),
                      artifact_dir)
        seeds = recipe.get("seeds") or [0]
        view.steps = int(recipe["grpo"]["steps"]) * len(seeds)
        # A look at unchanged evidence reuses the last diagnosis of the same harness.
        diagnosis = (
            read_json(folder / DIAGNOSIS_FILE)
            if saved.get("harness_digest") == harness.digest
            else None
        )
        evidence = backend.live_evidence(job, folder / BACKEND_CACHE, saved.get("read") or {},
                                         force=diagnosis is None)
        if evidence.changed:
            diagnosis = None
        if evidence.rollouts is not None and evidence.rollouts.num_rows and diagnosis is None:
            diagnosis = _diagnose(folder, evidence, harness)
            view.fresh = True
        view.diagnosis = diagnosis
        if evidence.rollouts is not None:
            view.rows, view.val_rows = evidence.rows
        else:  # unchanged evidence, not read again
            progress = saved.get("progress") or {}
            view.rows, view.val_rows = progress.get("rows", 0), progress.get("val_rows", 0)
        job_progress = backend.progress(job)
        view.step = _steps_done(job_progress, evidence.steps, seeds, view.steps)
        view.elapsed_s = _elapsed(evidence.started_at or run.get("started_at")
                                  or run.get("created_at"))
        if job_progress is not None:
            view.step_s = job_progress.seconds_per_step
        view.stop = saved.get("stop") if saved.get("harness_digest") == harness.digest else None
        if view.stop is None and diagnosis is not None:
            view.stop = early_stop(harness, view)
        atomic_write(
            folder / STATE_FILE,
            json.dumps(
                {
                    "job_id": run["job_id"],
                    "harness_digest": harness.digest,
                    "read": evidence.read,
                    "progress": {
                        "step": view.step,
                        "steps": view.steps,
                        "rows": view.rows,
                        "val_rows": view.val_rows,
                    },
                    "stop": view.stop,
                    "updated_at": now_iso(),
                },
                indent=2,
            ).encode(),
        )
    return view


def early_stop(harness: HarnessRevision, view: LiveView) -> dict | None:
    """The first `early_stop` rule of `harness` that holds over the live diagnosis, as the
    stop to record; None when none holds, when the job has no steps left to save, or before
    any evidence. A rule reading a null (a metric the evidence cannot compute) does not hold."""
    if view.diagnosis is None or view.step >= view.steps:
        return None
    variables = stop_variables(harness, view)
    for rule in harness.early_stop:
        try:
            holds = evaluate_unless_null(rule.when, variables) is True
        except EvoError as err:
            raise EvoError(
                err.message, where=harness.source, field=f"early_stop.{rule.name}.when"
            ) from None
        if holds:
            return {
                "rule": rule.name,
                "reason": rule.reason,
                "alert": rule.alert,
                "step": view.step,
                "steps": view.steps,
                "rows": view.rows,
                "elapsed_s": view.elapsed_s,
                "at": now_iso(),
            }
    return None


def stop_variables(harness: HarnessRevision, view: LiveView) -> dict[str, Any]:
    """What an early-stop rule reads (harness.EARLY_STOP_VARIABLES and the metric names)."""
    diagnosis = view.diagnosis or {"metrics": {}, "alerts": [], "series": {}}
    alerts = diagnosis["alerts"]
    return {
        **diagnosis["metrics"],
        "alerts": [a["name"] for a in alerts],
        "critical": [a["name"] for a in alerts if a["severity"] == "critical"],
        "critical_alerts": sum(a["severity"] == "critical" for a in alerts),
        "critical_behavior_alerts": sum(
            a["severity"] == "critical" and a.get("layer") == "behavior" for a in alerts
        ),
        "warning_alerts": sum(a["severity"] == "warning" for a in alerts),
        "rows": view.rows,
        "val_rows": view.val_rows,
        "step": view.step,
        "steps": view.steps,
        "latest": {name: points[-1][1] for name, points in diagnosis["series"].items() if points},
        "params": harness.params,
    }


@dataclass
class StopRecords:
    """What reconcile commits, in one commit, when it stops a job early."""

    run: dict
    diagnosis: dict
    decision: dict
    message: str
    trailers: dict[str, str] = field(default_factory=dict)


def stop_records(
    state: VersionState, run: dict, harness: HarnessRevision, view: LiveView
) -> StopRecords:
    """The run record (state Stopped, with the stop), the live diagnosis as the version's
    diagnosis record, and the decision: pruned by the rule's alert, as the gate prunes a run
    a critical alert blocks. `view.stop` must be set."""
    stop = view.stop
    if stop is None or view.diagnosis is None:
        raise EvoError(f"{state.name} has no early stop to record")
    at = now_iso()
    progress = f"step {stop['step']} of {stop['steps']}, {stop['rows']} train rollouts"
    fired = {a["name"] for a in view.diagnosis["alerts"]}
    blocked_by = [stop["alert"]] if stop["alert"] in fired else []
    stopped_run = ended_run(
        run, at,
        state=JobState.STOPPED.value,
        detail=f"stopped early by rule {stop['rule']} at {progress}: {stop['reason']}",
        stopped=stop,
        result={**(run.get("result") or {}), "steps_done": stop["step"]},
    )
    from evotrainer.diagnosis.diagnose import diagnosis_document
    from evotrainer.gate.decision import decision_header

    diagnosis = diagnosis_document(view.diagnosis, state.name)
    diagnosis["created_at"] = at
    diagnosis["live"] = {"step": stop["step"], "steps": stop["steps"], "rows": stop["rows"]}
    by = f"alert {stop['alert']}" if blocked_by else f"rule {stop['rule']}"
    decision = {
        **decision_header(state, harness),
        "verdict": "prune",
        "reason": f"stopped early by {by} (early_stop rule {stop['rule']}) at {progress}: "
        f"{stop['reason']}",
        "rule": f"early_stop.{stop['rule']}",
        "blocked_by": blocked_by,
        "comparison": None,
        "decided_at": at,
    }
    return StopRecords(
        stopped_run,
        diagnosis,
        decision,
        f"Stop {state.name} early: {stop['rule']} at {progress}",
        {"Action": "stop", "Version": state.name, "Harness": harness.name, "Verdict": "prune"},
    )


def _diagnose(folder: Path, evidence: LiveEvidence, harness: HarnessRevision) -> dict:
    """The live diagnosis, from the saved incremental state; the state and the diagnosis are
    saved for the next look."""
    from evotrainer.diagnosis.incremental import DiagnosisState, diagnose_incremental

    state_file = folder / DIAGNOSIS_STATE_FILE
    previous = DiagnosisState.from_json(state_file.read_text()) if state_file.is_file() else None
    diagnosis, state = diagnose_incremental(
        evidence.rollouts, evidence.steps, harness, previous, evidence_digest=evidence.digest
    )
    text = state.to_json()
    if text is None:
        state_file.unlink(missing_ok=True)
    else:
        atomic_write(state_file, text.encode())
    atomic_write(folder / DIAGNOSIS_FILE, json.dumps(diagnosis, default=str).encode())
    return diagnosis


def _steps_done(progress: JobProgress | None, steps: pa.Table | None, seeds: list,
                total: int) -> int:
    """Training steps done over all seeds: the job's own progress record where it keeps one
    (after each step: finer than evidence flushed at each evaluation); otherwise the latest
    step of each seed's metrics."""
    if progress is not None:
        return min(progress.steps_done, total)
    latest: dict[int, int] = {}
    if steps is not None and steps.num_rows:
        grouped = steps.group_by("seed").aggregate([("step", "max")])
        latest = dict(zip(grouped.column("seed").to_pylist(),
                          grouped.column("step_max").to_pylist(), strict=True))
    return sum(latest.get(int(seed), 0) for seed in seeds)


def _elapsed(started_at: str | None) -> float | None:
    """Seconds since the job started."""
    if not started_at:
        return None
    try:
        return max(0.0, time.time() - datetime.fromisoformat(started_at).timestamp())
    except ValueError:
        return None


def _reset(folder: Path) -> None:
    """Forget what was read for another job (a retry starts over)."""
    for name in (STATE_FILE, DIAGNOSIS_STATE_FILE, DIAGNOSIS_FILE):
        (folder / name).unlink(missing_ok=True)
    shutil.rmtree(folder / BACKEND_CACHE, ignore_errors=True)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / "lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
