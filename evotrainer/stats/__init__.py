"""The gate's statistics: how the gate tests a version, and the paired comparison it runs.

How the gate runs the test is a harness field (`gate:` in a revision, gate.schema.json), read
into a `GateProcedure`: the CI method (percentile, or BCa: bias-corrected and accelerated,
Efron 1987, with the acceleration from the jackknife over tasks), the number of resamples B,
the strata (by data_source, or none), and the comparison family with its multiple-comparison
correction (gate/decision.py). Absent fields keep the method's defaults, so a revision without
them decides exactly as before.

The comparison itself is stats/paired.py's `compare_tables`. It is a module of its own, for
numpy and pyarrow: checking a revision's gate settings (`validate`, `plan`) reads this
module alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from evotrainer.errors import EvoError

if TYPE_CHECKING:
    import pyarrow as pa

CI_METHODS = ("percentile", "bca")
CORRECTIONS = ("holm", "bonferroni")


@dataclass(frozen=True)
class GateProcedure:
    """How the gate tests a version (defaults: the method's paired bootstrap, §7)."""

    alpha: float = 0.05
    ci_method: str = "percentile"
    resamples: int = 10_000
    strata: str = "data_source"
    compare_with: tuple[str, ...] = ("parent",)
    correction: str = "holm"

    @classmethod
    def from_gate(cls, gate: Mapping[str, Any] | None) -> GateProcedure:
        """From a harness revision's `gate:` section (schema-checked: gate.schema.json)."""
        gate = gate or {}
        default = cls()
        compare_with = tuple(gate.get("compare_with") or default.compare_with)
        if "parent" not in compare_with:
            compare_with = ("parent", *compare_with)  # the verdict is always against the parent
        return cls(
            alpha=float(gate.get("alpha", default.alpha)),
            ci_method=gate.get("ci_method", default.ci_method),
            resamples=int(gate.get("resamples", default.resamples)),
            strata=gate.get("strata", default.strata),
            compare_with=compare_with,
            correction=gate.get("correction", default.correction),
        )

    @property
    def stratified(self) -> bool:
        return self.strata != "none"

    def compare(self, a: pa.Table, b: pa.Table, alpha: float | None = None) -> dict:
        """`compare_tables` under this procedure (at `alpha`, when a correction lowers it)."""
        from evotrainer.stats.paired import compare_tables

        return compare_tables(a, b, B=self.resamples, alpha=self.alpha if alpha is None else alpha,
                              ci_method=self.ci_method, stratified=self.stratified)


def confidence_label(comparison: Mapping[str, Any]) -> str:
    """"95% CI", at the confidence the comparison recorded: a family correction computes a
    parent's interval at a lower alpha (97.5% with two comparisons), and it says so."""
    confidence = comparison.get("confidence")
    if confidence is None:
        return "CI"
    return f"{float(confidence) * 100:.1f}".removesuffix(".0") + "% CI"


def adjust_p(p_values: list[float], correction: str) -> list[float]:
    """Family-wise adjusted p-values, in the given order: Bonferroni (m·p) or Holm's
    step-down (the k-th smallest times m-k+1, kept monotone), capped at 1."""
    m = len(p_values)
    if correction == "bonferroni":
        return [min(1.0, m * p) for p in p_values]
    if correction != "holm":
        raise EvoError(f"unknown correction {correction!r}",
                       hint=f"one of {', '.join(CORRECTIONS)}")
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted
