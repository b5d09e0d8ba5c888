"""A gated version's outcome as the paper names it, recorded beside the verdict: improvement,
regression, mixed evidence or insufficient evidence.

The verdict says what happens to the branch (promote, prune, ...); the outcome says what the
version taught. They differ where it matters to the next proposal: a fix that removed the
pathology it was proposed for while its score gain stays inside the CI is **mixed evidence**
— inconclusive on the score, yet not refuted — and the planner builds on it instead of
marking the skill refuted and going back.

- regression: the score fell significantly (CI of Δ below 0), or a critical behavior alert
  blocked the version (the score cannot be trusted: the change made something worse);
- improvement: the score rose significantly (CI of Δ above the gate's `min_delta`);
- mixed evidence: Δ inside the CI and the targeted pathology is gone: none of the alerts
  that motivated the proposal fires any more and its trigger no longer holds;
- insufficient evidence: Δ inside the CI and nothing shows the change did what it was for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.skills.skill import trigger_variables
from evotrainer.store.cel import evaluate_unless_null

IMPROVEMENT, REGRESSION, MIXED, INSUFFICIENT = OUTCOMES = (
    "improvement", "regression", "mixed_evidence", "insufficient_evidence")
# Outcomes that support building on a version (a frontier for proposals, a bundle's factor).
SUPPORTED = (IMPROVEMENT, MIXED)


@dataclass(frozen=True)
class Outcome:
    kind: str
    reason: str
    pathology: dict[str, Any] | None = None  # what the proposal targeted, and whether it went

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "reason": self.reason}
        if self.pathology is not None:
            out["pathology"] = self.pathology
        return out


def pathology_status(
    proposal: Mapping[str, Any] | None,
    diagnosis: Mapping[str, Any],
    recipe: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """What the proposal targeted (`proposal.trigger`: the alerts that fired and the skill
    trigger that held when it was proposed) and whether it is gone from `diagnosis`; None
    when the proposal targeted nothing (a default move, a hand-made version)."""
    trigger = (proposal or {}).get("trigger") or {}
    alerts = sorted(set(trigger.get("alerts") or []))
    expression = trigger.get("expression")
    if not alerts and not expression:
        return None
    firing = {a["name"] for a in diagnosis.get("alerts") or [] if "name" in a}
    still = sorted(firing & set(alerts))
    holds = None
    if expression:
        try:
            holds = evaluate_unless_null(expression, trigger_variables(dict(diagnosis),
                                                                       dict(recipe or {})))
        except EvoError:
            holds = None  # a trigger that no longer evaluates says nothing either way
    # Gone: no motivating alert fires, and the trigger (when it can be decided) no longer
    # holds. An undecidable trigger leaves the alerts to decide, when there were any.
    removed = not still and (holds is False or (holds is None and bool(alerts)))
    return {"alerts": alerts, "expression": expression, "still_firing": still,
            "trigger_holds": None if holds is None else holds is True, "removed": removed}


def classify(
    comparison: Mapping[str, Any] | None,
    *,
    blocked_by: list[str] | tuple[str, ...] = (),
    pathology: Mapping[str, Any] | None = None,
    min_delta: float = 0.0,
) -> Outcome | None:
    """The outcome of a version compared with its parent; None without a comparison (a
    root is the baseline, not an outcome)."""
    if not comparison:
        return None
    low, high = comparison["ci_low"], comparison["ci_high"]
    numbers = f"Δ {comparison['delta']:+.4f}, CI [{low:+.4f}, {high:+.4f}]"
    status = dict(pathology) if pathology is not None else None
    if blocked_by:
        return Outcome(REGRESSION, f"blocked by critical alert(s) {', '.join(blocked_by)} "
                       f"({numbers})", status)
    if high < 0.0:
        return Outcome(REGRESSION, f"the score fell significantly ({numbers})", status)
    if low > min_delta:
        return Outcome(IMPROVEMENT, f"the score rose significantly ({numbers})", status)
    if status and status["removed"]:
        targeted = ", ".join(status["alerts"]) or status["expression"]
        return Outcome(MIXED, f"the pathology it was proposed for ({targeted}) is gone, while the "
                       f"score change is inside the CI ({numbers}): not refuted", status)
    return Outcome(INSUFFICIENT, f"the score change is inside the CI ({numbers}) and nothing "
                   "shows the targeted pathology gone", status)
