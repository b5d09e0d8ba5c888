"""Gate-procedure revisions: when the recorded decisions show that how the gate tests, not what
the harness measures, stands between the evidence and a reading.

Both findings read the lineage's recorded decisions, each through the comparison that decided
it (against main's frontier where the gate decided so, else against the parent:
evidence.deciding_comparison).

**Strata that disagree.** A decision whose comparison holds at least two data sources of
`MIN_STRATUM_TASKS` tasks or more, one with a positive Δ and one with a negative Δ, the two
apart beyond their noise: two sources with one and the same effect disagree in sign half the
time, so the largest gain and the largest loss must differ by more than z_{1-alpha/2}
standard errors of their difference (each stratum's standard error read back from its
interval; the two strata resample independently). The pooled Δ weighs each source by its
task count, so a gain on one source can carry a loss on another into a promotion that the
pooled interval alone cannot see. The revision adds the gate rule `stratum_loss` just before
the first promotion the interval decides (a promote rule that reads `ci_low`):

    ci_low > min_delta && strata.exists(s, s.n_tasks >= 20 && s.delta < 0.0
                                        && s.p_value * double(size(strata)) < alpha)

A version the pooled interval would promote is held inconclusive when a source with enough
tasks falls significantly on its own: its stratum's bootstrap p-value, Bonferroni-corrected
over the comparison's strata, is under alpha, so the chance that any source shows a loss it
does not have stays under alpha whatever the dependence between sources. The rule only
withholds a promotion; it never prunes and never promotes. A gain that shows on one source
alone is not promoted on that source's own interval: picking the comparison after seeing the
data would inflate false promotions. 20 tasks: the bootstrap interval of a mean is trusted
once the mean is roughly normal, which per-task scores of 0 to 1 reach after a couple of
dozen tasks; below that a stratum's sign is noise the rule must not read. A revision in force
that resamples across all sources (`strata: none`) records no per-source rows; the revision
then sets `strata: data_source` as well, which also holds each source at its share of the
validation set, as the set itself does.

**Intervals too wide to decide.** At least `WIDE_DECISIONS` inconclusive decisions whose
interval straddles zero with a half-width above the gate's `min_delta` (the smallest gain it
promotes on: the effect the project cares about). That width is sampling error, from the
tasks and seeds measured, and no gate procedure narrows it: more seeds or tasks do, which the
version planner's evidence reruns gather (evidence.py). A gate revision changes only how
exactly an interval is read, so it is proposed only where that can change a reading:

- more resamples, where an interval end lies within `MC_SIGMAS` Monte-Carlo standard errors
  of the threshold the gate reads it against (ci_low against min_delta, ci_high against 0).
  B replicates place the q-quantile with a standard error of about
  sqrt(q(1-q)/B) / φ(z_q) times the bootstrap's spread, read back from the interval's width;
  the revision asks for the resamples that put that end `MC_SIGMAS` errors from its threshold,
  within the schema's bound;
- BCa intervals, where recomputing a decision's comparison with BCa (bias- and skew-
  corrected; the same resamples, seed and strata) reads it differently from its recorded
  percentile interval.

An interval method picked for the reading it gives is a forking path: a proposal of BCa says
so, and the backtest lists every verdict the revision flips, either way.

Each proposal is a full HarnessRevision: named hN after every revision the workspace holds (a
built-in revision never changes meaning), parent the revision in force, its gate section
changed and nothing else, its backtest cases the recorded verdicts. It is backtested like a
metric revision and adopted only through the same path: a revision that flips a recorded
verdict fails that case, so `evolve --approve` leaves it on main for a reviewer
(`evotrainer harness diff`). The anthropic planner's `propose_gate_revision` drafts through
`gate_revision` too.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from evotrainer.agent.planners.base import HarnessProposal, PlannerResult, View, next_name
from evotrainer.agent.planners.evidence import deciding_comparison
from evotrainer.agent.planners.revisions import awaiting_review, in_force_document, recorded_cases
from evotrainer.diagnosis.gaps import Gap
from evotrainer.diagnosis.harness import HarnessRevision, parse_harness
from evotrainer.errors import EvoError
from evotrainer.gate.decision import recorded_scores
from evotrainer.gate.harness_backtest import backtest_harness
from evotrainer.stats import GateProcedure
from evotrainer.store import cel
from evotrainer.store.builtin import harness_file
from evotrainer.store.specs import schema_file

STRATA_DISAGREE, WIDE_INTERVALS = "strata_disagree", "wide_intervals"
# Tasks a data source needs before its own delta is read (see the module's docstring).
MIN_STRATUM_TASKS = 20
# "Several" inconclusive decisions: one wide interval is a version's bad luck, two a pattern.
WIDE_DECISIONS = 2
# An interval end this many Monte-Carlo standard errors from its threshold could fall on either
# side of it with other replicates (about a 5% two-sided chance at two).
MC_SIGMAS = 2.0
# What a revision's `gate:` may say, and the bounds it says it in.
GATE_SCHEMA = schema_file("gate.schema.json")
MAX_RESAMPLES = int(GATE_SCHEMA["properties"]["resamples"]["maximum"])
STRATUM_RULE = {
    "name": "stratum_loss",
    "when": (f"ci_low > min_delta && strata.exists(s, s.n_tasks >= {MIN_STRATUM_TASKS} "
             "&& s.delta < 0.0 && s.p_value * double(size(strata)) < alpha)"),
    "verdict": "inconclusive",
}


@dataclass
class _Finding:
    """What the recorded decisions show, and the gate fields that answer it (none when no gate
    revision can), with why."""

    gap: Gap
    why: str
    changes: dict[str, Any] = field(default_factory=dict)


def propose(view: View, result: PlannerResult, *, drafting: bool = True
            ) -> HarnessProposal | None:
    """The rules planner's gate revision for what the recorded decisions show, unless a
    revision of the harness in force awaits review; every finding is noted in `result`. With
    `drafting` off the findings are only noted."""
    findings = [f for f in (_split_strata(view), _wide_intervals(view)) if f is not None]
    for finding in findings:
        result.notes.append(f"gap {finding.gap.kind} on {finding.gap.version}: "
                            f"{finding.gap.reason}")
        if not finding.changes:
            result.notes.append(finding.why)
    answered = [f for f in findings if f.changes]
    if not answered:
        return None
    if not drafting:
        result.notes.append("harness evolution is off: no gate revision proposed")
        return None
    pending = awaiting_review(view)
    if pending is not None:
        result.notes.append(f"no gate revision: {pending}, a revision of "
                            f"{view.harness.name}, awaits review")
        return None
    changes: dict[str, Any] = {}
    for finding in answered:
        changes.update(finding.changes)
    rationale = " ".join(f"{f.gap.reason}. {f.why}." for f in answered)
    return gate_revision(view, changes, rationale, gap=answered[0].gap)


def gate_revision(view: View, changes: Mapping[str, Any], rationale: str,
                  gap: Gap | None = None) -> HarnessProposal:
    """The revision in force with the gate fields `changes` set, as a new revision: checked
    (gate.schema.json within the HarnessRevision schema, rules over known names), backtested
    on every recorded version with the recorded verdicts as its cases; the rationale ends
    with the verdicts it flips."""
    fields = ", ".join(GATE_SCHEMA["properties"])
    if not changes:
        raise EvoError("a gate revision changes at least one gate field",
                       hint=f"gate fields: {fields}")
    current = gate_settings(view.harness)
    same = [k for k, v in changes.items() if k in current and _comparable(k, v) == current[k]]
    if same:
        raise EvoError(f"the gate of {view.harness.name} already has "
                       f"{', '.join(f'{k}={current[k]!r}' for k in same)}",
                       field=f"gate.{same[0]}", hint="name only the fields that change")
    document = copy.deepcopy(in_force_document(view))
    name = next_name(view.ws.harness_names(), "h")
    document.update(name=name, parent=view.harness.name,
                    gate={**(document.get("gate") or {}), **copy.deepcopy(dict(changes))},
                    backtest_cases=recorded_cases(view))
    document["description"] = (f"{view.harness.name} with its gate procedure revised "
                               f"({_summary(current, changes)}). {rationale}")
    revision = parse_harness(document, source=harness_file(name))
    backtest = backtest_harness(view.ws, revision, view.harness)
    flips = flipped(backtest)
    rationale += (f" Backtest against {view.harness.name}: "
                  + (f"flips {'; '.join(flips)}." if flips else "flips no recorded verdict."))
    return HarnessProposal(document, rationale, backtest,
                           gap=gap.as_dict() if gap is not None else None)


def gate_settings(harness: HarnessRevision) -> dict[str, Any]:
    """Every gate field of `harness` as it decides: absent fields at the method's defaults."""
    procedure = harness.procedure
    return {"alpha": procedure.alpha, "min_delta": harness.min_delta,
            "ci_method": procedure.ci_method, "resamples": procedure.resamples,
            "strata": procedure.strata, "compare_with": list(procedure.compare_with),
            "correction": procedure.correction,
            "rules": [{"name": r.name, "when": r.when, "verdict": r.verdict}
                      for r in harness.gate_rules]}


def flipped(backtest: Mapping[str, Any]) -> list[str]:
    """`version: before → after on the numbers, what moved` for each verdict that changes."""
    return [f"{row['version']}: {row['flip']['why']}" for row in backtest["versions"]
            if row.get("flip")]


def _comparable(key: str, value: Any) -> Any:
    """A changed field as `gate_settings` shows the one in force."""
    if key == "rules":
        return [{k: r.get(k) for k in ("name", "when", "verdict")} for r in value]
    if key == "compare_with":
        return list(GateProcedure.from_gate({"compare_with": value}).compare_with)
    return value


def _summary(current: Mapping[str, Any], changes: Mapping[str, Any]) -> str:
    out = []
    for key, value in changes.items():
        if key == "rules":
            before = {r["name"] for r in current["rules"]}
            after = [r.get("name") for r in value]
            added = [n for n in after if n not in before]
            removed = sorted(before - set(after))
            out.append("rules" + (f" + {', '.join(added)}" if added else "")
                       + (f" - {', '.join(removed)}" if removed else ""))
        else:
            out.append(f"{key} {current.get(key)} → {value}")
    return "; ".join(out)


# ---- strata that disagree --------------------------------------------------------------


def _split_strata(view: View) -> _Finding | None:
    """Decisions whose sources of `MIN_STRATUM_TASKS` tasks or more moved in opposite
    directions; the rule that keeps a pooled gain from promoting a significant loss."""
    split = []
    for name in view.decided_order():
        decided = deciding_comparison(view, name)
        if decided is None:
            continue
        against, comparison = decided
        rows = [r for r in comparison.get("strata") or [] if r["n_tasks"] >= MIN_STRATUM_TASKS]
        gains = [r for r in rows if r["delta"] > 0.0]
        losses = [r for r in rows if r["delta"] < 0.0]
        if not (gains and losses):
            continue
        gain = max(gains, key=lambda r: r["delta"])
        loss = min(losses, key=lambda r: r["delta"])
        level = _z(comparison)
        apart = (gain["delta"] - loss["delta"]) / math.hypot(
            _standard_error(gain, level), _standard_error(loss, level))
        if apart > level:
            split.append({"version": name, "against": against, "verdict": view.verdict(name),
                          "delta": comparison["delta"], "ci_low": comparison["ci_low"],
                          "ci_high": comparison["ci_high"], "gain": _stratum(gain),
                          "loss": _stratum(loss), "z": apart, "z_critical": level})
    if not split:
        return None
    shown = "; ".join(_split_text(case) for case in split[-3:])
    gap = Gap(STRATA_DISAGREE, split[-1]["version"],
              f"Per-stratum deltas disagree in sign beyond their noise in {len(split)} "
              f"decision(s), on data sources of at least {MIN_STRATUM_TASKS} tasks: {shown}",
              {"decisions": split})
    rules = view.harness.gate_rules
    reading = next((r.name for r in rules if "strata" in cel.names(r.when)), None)
    if reading is not None:
        return _Finding(gap, f"the gate of {view.harness.name} reads per-stratum results "
                        f"already (rule {reading}): no gate revision for the split strata")
    guarded = next((i for i, r in enumerate(rules)
                    if r.verdict == "promote" and "ci_low" in cel.names(r.when)), None)
    if guarded is None:
        return _Finding(gap, f"no promote rule of {view.harness.name} reads the interval "
                        "(ci_low): there is no pooled promotion for a per-stratum rule to "
                        "hold back")
    listed = list((in_force_document(view).get("gate") or {}).get("rules") or [])
    changes: dict[str, Any] = {
        "rules": [*listed[:guarded], dict(STRATUM_RULE), *listed[guarded:]]}
    why = (f"The pooled Δ weighs each source by its task count, so a gain on one source can "
           f"carry a loss on another into a promotion. The revision adds the rule "
           f"{STRATUM_RULE['name']} before {rules[guarded].name}: a version the pooled "
           f"interval would promote is held inconclusive when a source of at least "
           f"{MIN_STRATUM_TASKS} tasks falls significantly on its own (its bootstrap p times "
           "the number of strata under alpha: Bonferroni, so a loss no source has is read "
           "with at most alpha's chance). It never prunes and never promotes: a gain on one "
           "source alone is not promoted on that source's interval, which would pick the test "
           "after seeing the data")
    if not view.harness.procedure.stratified:
        changes["strata"] = "data_source"
        why += (f"; {view.harness.name} resamples across all sources (strata: none) and "
                "records no per-source rows, so the revision resamples within each "
                "data_source again")
    return _Finding(gap, why, changes)


def _z(comparison: Mapping[str, Any]) -> float:
    """z_{1-a/2} of the comparison's intervals (at the confidence it recorded)."""
    return NormalDist().inv_cdf(1.0 - (1.0 - float(comparison.get("confidence") or 0.95)) / 2)


def _standard_error(row: Mapping[str, Any], z: float) -> float:
    """The standard error of a comparison's (or a stratum's) Δ, read back from its interval's
    width."""
    return max((row["ci_high"] - row["ci_low"]) / (2 * z), 1e-12)


def _stratum(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("data_source", "n_tasks", "delta", "ci_low", "ci_high")}


def _split_text(case: Mapping[str, Any]) -> str:
    def source(row: Mapping[str, Any]) -> str:
        return (f"{row['data_source']} Δ {row['delta']:+.4f} (CI [{row['ci_low']:+.4f}, "
                f"{row['ci_high']:+.4f}], {row['n_tasks']} tasks)")

    return (f"{case['version']} against {case['against']}: {source(case['gain'])} and "
            f"{source(case['loss'])} apart by {case['z']:.1f} standard errors (beyond "
            f"{case['z_critical']:.2f}), pooled Δ {case['delta']:+.4f} (CI "
            f"[{case['ci_low']:+.4f}, {case['ci_high']:+.4f}], {case['verdict']})")


# ---- intervals too wide to decide ------------------------------------------------------


def _wide_intervals(view: View) -> _Finding | None:
    """Inconclusive decisions whose interval straddles zero wider than min_delta, and what a
    gate revision can change about their reading (more resamples, BCa) — nothing, mostly."""
    min_delta = view.harness.min_delta
    wide = []
    for name in view.decided_order():
        decided = deciding_comparison(view, name) if view.verdict(name) == "inconclusive" \
            else None
        if decided is None:
            continue
        against, comparison = decided
        low, high = comparison["ci_low"], comparison["ci_high"]
        if low <= 0.0 <= high and (high - low) / 2 > min_delta:
            wide.append((name, against, comparison))
    if len(wide) < WIDE_DECISIONS:
        return None
    shown = ", ".join(
        f"{name} (Δ {c['delta']:+.4f}, CI [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}], "
        f"half-width {(c['ci_high'] - c['ci_low']) / 2:.4f})" for name, _, c in wide)
    gap = Gap(WIDE_INTERVALS, wide[-1][0],
              f"{len(wide)} inconclusive decisions have intervals too wide to decide, each "
              f"straddling 0 with a half-width above min_delta {min_delta:+.4f}: {shown}",
              {"decisions": [{"version": n, "against": a, "delta": c["delta"],
                              "ci_low": c["ci_low"], "ci_high": c["ci_high"]}
                             for n, a, c in wide]})
    sampling = ("Their width is sampling error, from the tasks and seeds measured, which no "
                "gate procedure narrows: more seeds or tasks do, and the version planner's "
                "evidence reruns gather them (a second seed, pooled by the gate)")
    procedure = view.harness.procedure
    changes: dict[str, Any] = {}
    said = []
    resamples, close = _resamples_needed(wide, procedure.resamples, min_delta)
    if close:
        changes["resamples"] = resamples
        said.append(f"more resamples, {procedure.resamples} → {resamples}, where an end lies "
                    f"within {MC_SIGMAS:g} Monte-Carlo errors of its threshold ({close}): "
                    "they make the ends exact, not the interval narrower")
    turned = _turned_by_bca(view, wide, procedure, min_delta)
    if turned:
        changes["ci_method"] = "bca"
        said.append(f"BCa intervals, which correct the percentile interval's bias and skew "
                    f"and read {turned}")
    if not changes:
        bca = ", and BCa reads them alike" if procedure.ci_method == "percentile" else ""
        return _Finding(gap, f"{sampling}. No gate revision changes their reading: every end "
                        f"lies beyond {MC_SIGMAS:g} Monte-Carlo errors of its threshold at "
                        f"{procedure.resamples} resamples{bca}")
    why = (f"{sampling}. A gate revision changes only how exactly an interval is read: "
           f"{'; and '.join(said)}")
    if turned:
        why += (". An interval method picked for the reading it gives is a forking path: the "
                "backtest lists every verdict the revision flips, either way")
    return _Finding(gap, why, changes)


def monte_carlo_error(comparison: Mapping[str, Any], resamples: int) -> float:
    """The standard error, from resampling alone, of the comparison's interval ends with
    `resamples` replicates: sqrt(q(1-q)/B) / φ(z_q) times the bootstrap's spread (a normal
    approximation), the spread read back from the interval's width at its confidence."""
    z = _z(comparison)
    q = 1.0 - NormalDist().cdf(z)
    return (math.sqrt(q * (1 - q) / resamples) / NormalDist().pdf(z)
            * _standard_error(comparison, z))


def _resamples_needed(
    wide: list[tuple[str, str, dict]], resamples: int, min_delta: float
) -> tuple[int, str]:
    """The resamples that put every interval end now within `MC_SIGMAS` Monte-Carlo errors of
    its threshold that far from it (rounded up to ten thousand, at most the schema's bound),
    and which ends those are; (resamples, "") when none is that close or the bound is
    reached."""
    if resamples >= MAX_RESAMPLES:
        return resamples, ""
    needed, close = resamples, []
    for name, _, comparison in wide:
        error = monte_carlo_error(comparison, resamples)
        for end, threshold, label in (("ci_low", min_delta, "lower"),
                                      ("ci_high", 0.0, "upper")):
            margin = abs(comparison[end] - threshold)
            if margin >= MC_SIGMAS * error:
                continue
            want = (MAX_RESAMPLES if margin == 0.0
                    else math.ceil(resamples * (MC_SIGMAS * error / margin) ** 2))
            needed = max(needed, min(MAX_RESAMPLES, math.ceil(want / 10_000) * 10_000))
            close.append(f"{name}'s {label} end {comparison[end]:+.4f}, {margin:.4f} from "
                         f"{threshold:+.4f} with a Monte-Carlo error of ±{error:.4f}")
    return needed, "; ".join(close)


def _turned_by_bca(
    view: View, wide: list[tuple[str, str, dict]], procedure: GateProcedure, min_delta: float
) -> str:
    """The wide decisions that BCa reads otherwise than their recorded percentile interval,
    each recomputed from the recorded scores with the same resamples, seed, strata and
    confidence; "" when the gate in force reads BCa already, or none turns."""
    if procedure.ci_method != "percentile":
        return ""
    turned = []
    for name, against, comparison in wide:
        if comparison.get("ci_method") == "bca":
            continue
        bca = dataclasses.replace(
            procedure, ci_method="bca",
            resamples=int(comparison.get("resamples") or procedure.resamples),
            strata="none" if comparison.get("stratified") is False else "data_source")
        alpha = 1.0 - float(comparison.get("confidence") or 1.0 - procedure.alpha)
        try:
            again = bca.compare(recorded_scores(view.ws, against),
                                recorded_scores(view.ws, name), alpha)
        except EvoError:
            continue  # its scores are gone: nothing to recompute
        before = _reading(comparison, min_delta)
        after = _reading(again, min_delta)
        if after != before:
            turned.append(f"{name} as {after} (CI [{again['ci_low']:+.4f}, "
                          f"{again['ci_high']:+.4f}]) where the percentile interval reads "
                          f"{before}")
    return "; ".join(turned)


def _reading(comparison: Mapping[str, Any], min_delta: float) -> str:
    """What the interval says to the gate's interval rules: a gain, a loss, or undecided."""
    if comparison["ci_low"] > min_delta:
        return "a gain"
    if comparison["ci_high"] < 0.0:
        return "a loss"
    return "undecided"
