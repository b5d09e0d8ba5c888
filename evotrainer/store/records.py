"""Typed views of the records a version branch carries (`runs/<v>/{run,diagnosis,decision}.yaml`).

The YAML stays the record; these small dataclasses are how code reads it, so a field's
name and default are written once instead of in every `(records.get("run") or {}).get(..)`.
`from_record` accepts what `Workspace.versions` read (a dict, or None when absent)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The states a run record holds; "Cancelled" is a user's `evotrainer cancel`.
ACTIVE_STATES = ("Pending", "Running", "Stalled")


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

    @classmethod
    def from_record(cls, data: dict | None) -> RunRecord | None:
        if not isinstance(data, dict):
            return None
        return cls(
            state=str(data.get("state") or "—"),
            attempt=int(data.get("attempt") or 1),
            job_id=str(data.get("job_id") or ""),
            backend=str(data.get("backend") or "local"),
            artifact_dir=str(data.get("artifact_dir") or ""),
            spec_digest=data.get("spec_digest"),
            recipe_digest=data.get("recipe_digest"),
            created_at=str(data.get("created_at") or ""),
            detail=str(data.get("detail") or ""),
            attempts=list(data.get("attempts") or []),
            result=dict(data.get("result") or {}),
            artifacts=dict(data.get("artifacts") or {}),
        )

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def succeeded(self) -> bool:
        """The job finished and was collected: its scores and artifacts are recorded."""
        return self.state == "Succeeded"

    @property
    def steps_done(self) -> int:
        return int(self.result.get("steps_done") or 0)

    @property
    def steps_spent(self) -> int:
        """Training steps of this run and of every earlier attempt (the budget's unit)."""
        return self.steps_done + sum(int(a.get("steps", 0)) for a in self.attempts)


@dataclass(frozen=True)
class DiagnosisRecord:
    harness_name: str
    harness_digest: str | None
    metrics: dict = field(default_factory=dict)
    alerts: list[dict] = field(default_factory=list)
    comparison: dict | None = None

    @classmethod
    def from_record(cls, data: dict | None) -> DiagnosisRecord | None:
        if not isinstance(data, dict):
            return None
        harness = data.get("harness") or {}
        return cls(
            harness_name=str(harness.get("name", "")),
            harness_digest=harness.get("digest"),
            metrics=dict(data.get("metrics") or {}),
            alerts=list(data.get("alerts") or []),
            comparison=data.get("comparison"),
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

    @classmethod
    def from_record(cls, data: dict | None) -> DecisionRecord | None:
        if not isinstance(data, dict):
            return None
        return cls(
            verdict=str(data.get("verdict") or ""),
            reason=str(data.get("reason") or ""),
            harness_digest=(data.get("harness") or {}).get("digest"),
            comparison=data.get("comparison"),
            decided_at=str(data.get("decided_at") or ""),
            blocked_by=list(data.get("blocked_by") or []),
            criterion=data.get("criterion"),
        )
