"""The harness's gate rules over one comparison: the variables a rule reads (the version's
metrics and alerts, the comparison's numbers, the parent's metrics), the first rule that
holds, and a version's own falsifiable criterion over the same variables."""

from __future__ import annotations

from typing import Any

from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.errors import EvoError
from evotrainer.store.cel import evaluate_unless_null, holds


def metric_values(diagnosis: dict | None) -> dict:
    """{name: value} from a diagnosis record's {name: {value, layer, trend}}."""
    metrics = (diagnosis or {}).get("metrics") or {}
    return {name: (m.get("value") if isinstance(m, dict) else m) for name, m in metrics.items()}


def gate_verdict(
    harness: HarnessRevision,
    diagnosis: dict,
    comparison: dict | None = None,
    parent_metrics: dict[str, float | None] | None = None,
) -> dict:
    """Apply the gate: the first rule whose `when` holds decides; none holding means
    inconclusive. A rule that reads a null value does not hold."""
    comparison = comparison or diagnosis.get("comparison") or {}
    alerts = diagnosis["alerts"]
    variables = {
        **diagnosis["metrics"],
        "delta": comparison.get("delta"),
        "ci_low": comparison.get("ci_low"),
        "ci_high": comparison.get("ci_high"),
        "p_value": comparison.get("p_bootstrap"),
        "p_wilcoxon": comparison.get("p_wilcoxon"),
        # Each data_source's own comparison: a pooled gain may carry a loss on one source.
        "strata": [_stratum(row) for row in comparison.get("strata") or []],
        "parent": dict(parent_metrics or {}),
        "alpha": harness.alpha,
        "min_delta": harness.min_delta,
        "critical_alerts": sum(a["severity"] == "critical" for a in alerts),
        # Critical behavior alerts (leak, abandonment) say the score itself cannot be
        # trusted; critical signal alerts (dead groups) say what to fix next.
        "critical_behavior_alerts": sum(
            a["severity"] == "critical" and a.get("layer") == "behavior" for a in alerts
        ),
        "warning_alerts": sum(a["severity"] == "warning" for a in alerts),
        "alerts": [a["name"] for a in alerts],
        "params": harness.params,
    }
    for rule in harness.gate_rules:
        if holds(rule.when, variables, where=harness.source, field=f"gate rule {rule.name}"):
            return {"verdict": rule.verdict, "rule": rule.name, "variables": _plain(variables)}
    return {"verdict": "inconclusive", "rule": None, "variables": _plain(variables)}


def criterion_holds(expression: str, variables: dict) -> bool | None:
    """The version's falsifiable criterion; None when it reads a metric that is null (or an
    expression that no longer evaluates: the criterion was checked when it was proposed)."""
    try:
        held = evaluate_unless_null(expression, variables)
    except EvoError:
        return None
    return None if held is None else held is True


def _stratum(row: dict[str, Any]) -> dict[str, Any]:
    """One row of a comparison's `strata` as a gate rule reads it (`p_value` is the stratum's
    bootstrap p, as the pooled `p_value` is the comparison's)."""
    return {"data_source": row["data_source"], "n_tasks": row["n_tasks"],
            "delta": row["delta"], "ci_low": row["ci_low"], "ci_high": row["ci_high"],
            "p_value": row["p_bootstrap"]}


def _plain(variables: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in variables.items() if k != "params"}
