"""Typed views of the records a version branch carries (`runs/<v>/{run,diagnosis,decision}.yaml`).

The YAML stays the record; these small dataclasses are how code reads it, so a field's
name and default are written once instead of in every `(records.get("run") or {}).get(..)`.
`from_record` accepts what `Workspace.versions` read (a dict, or None when absent). A
record is branch content anyone can edit: a field of the wrong shape is an EvoError naming
it, not a traceback in whichever command reads it first."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.store.clock import now_iso


class JobState(str, Enum):
    """A job's state as its backend reports it, and the state its run record holds
    (run.schema.json). A state compares equal to its recorded string, so
    `run.state == JobState.FAILED` reads a record's value as it is; a record is written with
    the string itself (`JobState.FAILED.value`)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STALLED = "Stalled"  # alive but silent for longer than the watchdog allows
    UNKNOWN = "Unknown"  # the backend has no record of this job id (never recorded)
    CANCELLED = "Cancelled"  # a user's `evotrainer cancel` (recorded, never reported)
    STOPPED = "Stopped"  # an early stop's rule ended it (recorded, never reported)

    @property
    def active(self) -> bool:
        """The job runs, or will: it holds its machine (a Stalled job too)."""
        return self in ACTIVE_STATES

    @property
    def finished(self) -> bool:
        """The job ended, whichever way."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED,
                        JobState.STOPPED)


# The states a run is active in (one meaning: a Stalled job still holds its machine and its
# `max_concurrent_jobs` slot, and an early stop cancels it), and those `evotrainer retry`
# restarts (reconcile's next launch is then a new attempt).
ACTIVE_STATES = (JobState.PENDING, JobState.RUNNING, JobState.STALLED)
RETRIED_STATES = (JobState.FAILED, JobState.CANCELLED)


class Verdict(str, Enum):
    """What the gate decided of a version (decision.schema.json). A verdict compares equal to
    its recorded string, so `verdict in MERGING` reads a record's value as it is."""

    PROMOTE = "promote"
    PRUNE = "prune"
    REVERT = "revert"
    INCONCLUSIVE = "inconclusive"
    BASELINE = "baseline"  # the root: evaluated, not trained, merged as the reference


# The groupings every reader uses, each said once: the verdicts reconcile merges into main,
# those kept as negative evidence, and those of an intervention that did not earn its place.
MERGING = (Verdict.PROMOTE, Verdict.BASELINE)
NEGATIVE = (Verdict.PRUNE, Verdict.REVERT)
NO_GAIN = (*NEGATIVE, Verdict.INCONCLUSIVE)
# What `backends.base.job_id` generates: `evo-<version>-a<attempt>-<10 hex>`. Version names
# hold no `/`, and `..` is refused, so a job id never names a folder but its own.
JOB_ID = re.compile(r"evo-(?!.*\.\.)[a-z0-9._-]+-a[1-9][0-9]*-[0-9a-f]{10}")


@dataclass(frozen=True)
class RunRecord:
    state: str
    attempt: int
    job_id: str
    backend: str
    artifact_dir: str
    spec_digest: str | None = None
    recipe_digest: str | None = None
    created_at: str = ""
    detail: str = ""
    attempts: list[dict] = field(default_factory=list)
    result: dict = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)
    started_at: str = ""
    finished_at: str = ""
    exit_code: int | None = None  # a failed job's, as its backend reported it
    log_tail: str = ""  # a failed job's last log lines
    stopped: dict | None = None  # an early stop's rule, alert and step (state Stopped)
    # What the job asked its backend for ({nodes, gpus_per_node, gpus}), written at launch.
    resources: dict = field(default_factory=dict)
    # What it used ({wall_hours, gpu_hours}), written when the run ended (`ended_run`).
    usage: dict = field(default_factory=dict)

    @classmethod
    def from_record(cls, data: dict | None, where: str | None = None) -> RunRecord | None:
        if not isinstance(data, dict):
            return None
        where = where or "run.yaml"
        job_id = str(data.get("job_id") or "")
        if not JOB_ID.fullmatch(job_id):
            raise EvoError(
                f"job_id {job_id[:80]!r} is not an id the controller generates "
                "(evo-<version>-a<attempt>-<10 hex digits>)",
                where=where, field="job_id",
                hint="a run record names only its own job; restore the record",
            )
        return cls(
            state=str(data.get("state") or "—"),
            attempt=_whole_number(data, "attempt", 1, where),
            job_id=job_id,
            backend=str(data.get("backend") or "local"),
            artifact_dir=str(data.get("artifact_dir") or ""),
            spec_digest=data.get("spec_digest"),
            recipe_digest=data.get("recipe_digest"),
            created_at=str(data.get("created_at") or ""),
            detail=str(data.get("detail") or ""),
            attempts=_mappings(data, "attempts", where),
            result=_mapping(data, "result", where),
            artifacts=_mapping(data, "artifacts", where),
            started_at=str(data.get("started_at") or ""),
            finished_at=str(data.get("finished_at") or ""),
            exit_code=None if data.get("exit_code") is None
            else _whole_number(data, "exit_code", 0, where),
            log_tail=str(data.get("log_tail") or ""),
            stopped=_optional_mapping(data, "stopped", where),
            resources=_numbers(data, "resources", where),
            usage=_numbers(data, "usage", where),
        )

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def succeeded(self) -> bool:
        """The job finished and was collected: its scores and artifacts are recorded."""
        return self.state == JobState.SUCCEEDED

    @property
    def steps_done(self) -> int:
        return int(self.result.get("steps_done") or 0)

    @property
    def seed_steps(self) -> int:
        """The step each seed's training ends at: its recipe's steps (trackers log the gate
        there). A record from before `steps_done` counted every seed says it as steps_done."""
        return int(self.result.get("steps") or self.steps_done)

    @property
    def steps_spent(self) -> int:
        """Training steps of this run and of every earlier attempt (the budget's unit)."""
        return self.steps_done + sum(int(a.get("steps", 0)) for a in self.attempts)

    @property
    def gpus(self) -> int:
        """GPUs the job holds while it runs (0: the local backend's engine runs on the CPU)."""
        return int(self.resources.get("gpus") or 0)

    def wall_hours(self, now: str | None = None) -> float:
        """Hours the job held its machine: as recorded when it ended; until then from its
        start (its submission when it was never seen running) to `now` (default: now)."""
        if "wall_hours" in self.usage:
            return float(self.usage["wall_hours"])
        end = self.finished_at or (now or now_iso() if self.active else "")
        return hours_between(self.started_at or self.created_at, end)

    def gpu_hours(self, now: str | None = None) -> float:
        """GPUs × wall hours (the `max_gpu_hours` budget's unit), as recorded at the end."""
        if "gpu_hours" in self.usage:
            return float(self.usage["gpu_hours"])
        return self.gpus * self.wall_hours(now)

    def gpu_hours_spent(self, now: str | None = None) -> float:
        """GPU-hours of this run and of every earlier attempt (the budget counts them all)."""
        return self.gpu_hours(now) + sum(_hours(a, "gpu_hours") for a in self.attempts)

    def wall_hours_spent(self, now: str | None = None) -> float:
        return self.wall_hours(now) + sum(_hours(a, "wall_hours") for a in self.attempts)


def hours_between(start: str, end: str) -> float:
    """Hours from one record timestamp (ISO 8601) to another; 0 when either is missing or
    unreadable (a record of an old version without them), never negative."""
    try:
        seconds = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    except (TypeError, ValueError):
        return 0.0
    return max(seconds, 0.0) / 3600


def ended_run(run: dict, at: str, **changes: Any) -> dict:
    """The run record `run` ended at `at` (with `changes`: its state, detail, result...): its
    start is its submission when it was never seen running, and what it used is written
    beside it, so the spend of a run is recorded, not recomputed from a clock later."""
    out = {**run, **changes, "finished_at": at}
    out.setdefault("started_at", run.get("created_at") or at)
    wall = hours_between(out["started_at"], at)
    gpus = (out.get("resources") or {}).get("gpus") or 0
    out["usage"] = {"wall_hours": wall, "gpu_hours": gpus * wall}
    return out


@dataclass(frozen=True)
class DiagnosisRecord:
    harness_name: str
    harness_digest: str | None
    metrics: dict = field(default_factory=dict)
    alerts: list[dict] = field(default_factory=list)
    comparison: dict | None = None

    @classmethod
    def from_record(cls, data: dict | None, where: str | None = None) -> DiagnosisRecord | None:
        if not isinstance(data, dict):
            return None
        where = where or "diagnosis.yaml"
        harness = _mapping(data, "harness", where)
        return cls(
            harness_name=str(harness.get("name") or ""),
            harness_digest=harness.get("digest"),
            metrics=_mapping(data, "metrics", where),
            alerts=_mappings(data, "alerts", where),
            comparison=_optional_mapping(data, "comparison", where),
        )


@dataclass(frozen=True)
class DecisionRecord:
    verdict: str
    reason: str
    harness_digest: str | None = None
    comparison: dict | None = None
    decided_at: str = ""
    blocked_by: list[str] = field(default_factory=list)
    criterion: dict | None = None  # {expression, held, ...} when the spec states one
    # {version, verdict, rule, comparison}: main's frontier, when the gate decided against it
    # because the parent is not on main
    against_main: dict | None = None

    @property
    def deciding_comparison(self) -> tuple[str | None, dict]:
        """The comparison the verdict came from and the version it is against (None: the
        parent): main's frontier where the gate decided against it, else the parent."""
        if self.against_main and isinstance(self.against_main.get("comparison"), dict):
            return self.against_main.get("version"), self.against_main["comparison"]
        return None, self.comparison or {}

    @classmethod
    def from_record(cls, data: dict | None, where: str | None = None) -> DecisionRecord | None:
        if not isinstance(data, dict):
            return None
        where = where or "decision.yaml"
        return cls(
            verdict=str(data.get("verdict") or ""),
            reason=str(data.get("reason") or ""),
            harness_digest=_mapping(data, "harness", where).get("digest"),
            comparison=_optional_mapping(data, "comparison", where),
            decided_at=str(data.get("decided_at") or ""),
            blocked_by=[str(b) for b in _list(data, "blocked_by", where)],
            criterion=_optional_mapping(data, "criterion", where),
            against_main=_optional_mapping(data, "against_main", where),
        )


def _malformed(key: str, wanted: str, value: Any, where: str) -> EvoError:
    return EvoError(f"the record's {key} must be {wanted}, not {type(value).__name__}",
                    where=where, field=key, hint="restore the record from the branch's history")


def _whole_number(data: dict, key: str, default: int, where: str) -> int:
    value = data.get(key) or default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _malformed(key, "a whole number", value, where)
    try:
        return int(value)
    except (ValueError, OverflowError):  # "many", .nan, .inf
        raise _malformed(key, "a whole number", value, where) from None


def _mapping(data: dict, key: str, where: str) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise _malformed(key, "a mapping", value, where)
    return dict(value)


def _numbers(data: dict, key: str, where: str) -> dict:
    """A mapping of non-negative numbers (`resources`, `usage`)."""
    value = _mapping(data, key, where)
    for name, number in value.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not number >= 0:
            raise EvoError(f"the record's {key}.{name} must be a non-negative number, not "
                           f"{str(number)[:40]!r}", where=where, field=f"{key}.{name}",
                           hint="restore the record from the branch's history")
    return value


def _hours(attempt: dict, key: str) -> float:
    """An earlier attempt's recorded hours (0 for an attempt recorded without them)."""
    value = attempt.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _optional_mapping(data: dict, key: str, where: str) -> dict | None:
    return None if data.get(key) is None else _mapping(data, key, where)


def _list(data: dict, key: str, where: str) -> list:
    value = data.get(key) or []
    if not isinstance(value, list):
        raise _malformed(key, "a list", value, where)
    return list(value)


def _mappings(data: dict, key: str, where: str) -> list[dict]:
    """A list whose entries are read as mappings (`attempts`, `alerts`)."""
    entries = _list(data, key, where)
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise _malformed(f"{key}[{index}]", "a mapping", entry, where)
    return entries
