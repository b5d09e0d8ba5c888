"""Diagnostic gaps: when the recorded evidence cannot explain an outcome, tell hypotheses
apart, or point at a next step (method.md §6, the harness evolution protocol). A gap is what
makes the harness evolve: the planner answers it with a catalogue metric that closes it.

Pure functions over recorded documents (diagnoses, gate comparisons, what fired), so each is
tested on hand-made records and re-derived by anyone reading `git log`.

- `unexplained_outcome`: the score moved significantly (the gate's paired-bootstrap CI
  excludes 0, either way) and nothing outside the score layer explains it: no signal or
  behavior metric moved beyond its own noise, and no alert fired that did not fire on the
  parent, or cleared that did (a fix that removed the leak explains its own gain). A
  metric's **noise** is the spread of its per-step series over training (the sample
  standard deviation of the parent's and the version's per-step values, pooled): what the
  metric does between steps of one run with no intervention. A move beyond `NOISE_SIGMAS`
  of it is a move. A metric recorded without a series has no noise estimate: it is listed
  as `unjudged` and explains nothing either way.
- `indistinguishable_hypotheses`: two or more skills fired on the same evidence (their
  triggers read a common metric) and the recorded numbers cannot rank them: neither has a
  backtest, or their backtests show the same effect.
- `no_next_step`: no skill trigger fired and the frontier is not improving (versions decided
  from it since it became the frontier all failed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from evotrainer.diagnosis.catalogue import GAPS

UNEXPLAINED, INDISTINGUISHABLE, NO_NEXT_STEP = GAPS
# Layers whose metrics can explain a score move: the score layer is the move itself, the
# version layer (paired comparisons) restates it.
EXPLAINING_LAYERS = ("signal", "behavior")
# A move larger than this many standard deviations of a metric's per-step spread is beyond
# its noise (two: about a 5% two-sided chance under a normal spread).
NOISE_SIGMAS = 2.0
# Two backtest effects closer than this (shares of dead groups fixed) do not rank skills.
EFFECT_TOLERANCE = 0.05


@dataclass(frozen=True)
class Gap:
    """One detected gap: which (from catalogue.GAPS, or a finding about the gate's procedure
    that a planner names), on which version, why, and the numbers behind it (what a reviewer
    checks)."""

    kind: str
    version: str
    reason: str
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "version": self.version, "reason": self.reason,
                "details": self.details}


# ---- (a) unexplained outcome ---------------------------------------------------------


def series_noise(*series: Iterable[Iterable[float]] | None) -> float | None:
    """The pooled per-step standard deviation of one metric over one or more runs' series
    ([[step, value], ...]); None when no run has two finite per-step values."""
    variances = []
    for points in series:
        values = [p[1] for p in points or () if p[1] is not None and math.isfinite(p[1])]
        if len(values) >= 2:
            mean = sum(values) / len(values)
            variances.append(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    if not variances:
        return None
    return math.sqrt(sum(variances) / len(variances))


def _value(diagnosis: Mapping[str, Any], name: str) -> float | None:
    entry = (diagnosis.get("metrics") or {}).get(name)
    value = entry.get("value") if isinstance(entry, Mapping) else entry
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _layer(diagnosis: Mapping[str, Any], name: str) -> str | None:
    entry = (diagnosis.get("metrics") or {}).get(name)
    if isinstance(entry, Mapping) and entry.get("layer"):
        return entry["layer"]
    return (diagnosis.get("layers") or {}).get(name)  # an in-memory diagnosis keeps layers apart


def _alert_names(diagnosis: Mapping[str, Any]) -> set[str]:
    return {a["name"] for a in diagnosis.get("alerts") or [] if "name" in a}


def significant(comparison: Mapping[str, Any] | None) -> bool:
    """The paired-bootstrap CI of Δ excludes 0, either way."""
    low, high = (comparison or {}).get("ci_low"), (comparison or {}).get("ci_high")
    return low is not None and high is not None and (low > 0.0 or high < 0.0)


def metric_moves(
    diagnosis: Mapping[str, Any], parent_diagnosis: Mapping[str, Any]
) -> tuple[dict[str, dict[str, float]], list[str]]:
    """({metric: {parent, version, delta, noise, sigmas}} for every signal/behavior metric
    both record with a noise estimate, [metrics with a value but no noise estimate])."""
    judged: dict[str, dict[str, float]] = {}
    unjudged = []
    for name in sorted(diagnosis.get("metrics") or {}):
        if _layer(diagnosis, name) not in EXPLAINING_LAYERS:
            continue
        now, before = _value(diagnosis, name), _value(parent_diagnosis, name)
        if now is None or before is None:
            continue
        noise = series_noise((diagnosis.get("series") or {}).get(name),
                             (parent_diagnosis.get("series") or {}).get(name))
        if noise is None:
            unjudged.append(name)
            continue
        delta = now - before
        # A flat series has no spread: any change at all is beyond it.
        sigmas = abs(delta) / noise if noise > 0 else (math.inf if delta else 0.0)
        judged[name] = {"parent": before, "version": now, "delta": delta, "noise": noise,
                        "sigmas": sigmas}
    return judged, unjudged


def unexplained_outcome(
    version: str,
    comparison: Mapping[str, Any] | None,
    diagnosis: Mapping[str, Any],
    parent_diagnosis: Mapping[str, Any] | None,
) -> Gap | None:
    """Gap (a): a significant score move that no signal/behavior metric or change of alerts
    explains; None when the move is not significant or something explains it."""
    if comparison is None or not significant(comparison) or parent_diagnosis is None:
        return None
    judged, unjudged = metric_moves(diagnosis, parent_diagnosis)
    moved = sorted(n for n, m in judged.items() if m["sigmas"] > NOISE_SIGMAS)
    # An alert that fires now and did not, or fired on the parent and cleared.
    changed_alerts = _alert_names(diagnosis) ^ _alert_names(parent_diagnosis)
    if moved or changed_alerts:
        return None
    direction = "rose" if comparison["ci_low"] > 0 else "fell"
    largest = max(judged.items(), key=lambda item: item[1]["sigmas"], default=None)
    why = (f"; the largest move is {largest[0]} at {largest[1]['sigmas']:.2g}σ of its per-step "
           "spread" if largest else "")
    return Gap(
        UNEXPLAINED, version,
        f"Avg@k {direction} significantly (Δ {comparison['delta']:+.4f}, CI "
        f"[{comparison['ci_low']:+.4f}, {comparison['ci_high']:+.4f}]) and no signal or "
        f"behavior metric moved beyond {NOISE_SIGMAS:g}σ of its own noise, nor did an alert "
        f"fire or clear ({len(judged)} metric(s) judged{why})",
        {"delta": comparison["delta"], "ci": [comparison["ci_low"], comparison["ci_high"]],
         "noise": "pooled sd of the per-step series", "sigmas": NOISE_SIGMAS,
         "metrics": {n: {k: round(v, 6) if math.isfinite(v) else None for k, v in m.items()}
                     for n, m in judged.items()},
         "unjudged": unjudged},
    )


# ---- (b) indistinguishable hypotheses --------------------------------------------------


@dataclass(frozen=True)
class FiredSkill:
    """A skill whose trigger fired: the metrics it read and its backtest effect (the share of
    the dead groups it fixes on the stored rollouts), None without a backtest."""

    name: str
    category: str
    reads: frozenset[str]
    effect: float | None = None


def _ranked(a: FiredSkill, b: FiredSkill) -> bool:
    return (a.effect is not None and b.effect is not None
            and abs(a.effect - b.effect) > EFFECT_TOLERANCE)


def indistinguishable_hypotheses(version: str, fired: list[FiredSkill]) -> Gap | None:
    """Gap (b): skills that fired on a shared metric of `version`'s diagnosis and that no
    recorded number ranks; None when at most one hypothesis stands on each piece of
    evidence, or the backtests separate them."""
    competing: set[str] = set()
    shared: set[str] = set()
    for i, a in enumerate(fired):
        for b in fired[i + 1:]:
            common = a.reads & b.reads
            if common and not _ranked(a, b):
                competing |= {a.name, b.name}
                shared |= common
    if len(competing) < 2:
        return None
    names = sorted(competing)
    effects = {s.name: s.effect for s in fired if s.name in competing}
    return Gap(
        INDISTINGUISHABLE, version,
        f"{', '.join(names)} all fire on {', '.join(sorted(shared))} and the recorded metrics "
        "cannot rank them (no backtest, or backtests within "
        f"{EFFECT_TOLERANCE:g} of each other)",
        {"skills": names, "metrics": sorted(shared),
         "categories": sorted({s.category for s in fired if s.name in competing}),
         "effects": effects},
    )


# ---- (c) no next step ------------------------------------------------------------------


def no_next_step(frontier: str, next_step_offered: bool, stalled: list[str]) -> Gap | None:
    """Gap (c): no fired skill offers a next step (none fired, or each that fired is already
    applied or refuted) and the frontier is not improving (`stalled`: the versions decided
    since it became the frontier, all failed; none tried means it may yet improve with the
    defaults)."""
    if next_step_offered or not stalled:
        return None
    return Gap(
        NO_NEXT_STEP, frontier,
        f"no skill trigger offers a next step on {frontier} (none fires, or each that fires "
        "is applied or refuted) and the frontier is not improving "
        f"({len(stalled)} version(s) since failed: {', '.join(stalled)})",
        {"stalled": list(stalled)},
    )
