"""Gap detection (diagnosis/gaps.py) and outcomes (gate/outcomes.py) on hand-made
diagnoses and comparisons: each gap fires on the case it names and not on its near misses."""

from __future__ import annotations

import math

import pytest

from evotrainer.diagnosis.gaps import (
    FiredSkill,
    indistinguishable_hypotheses,
    no_next_step,
    series_noise,
    unexplained_outcome,
)
from evotrainer.gate.outcomes import classify, pathology_status


def diagnosis(alerts=(), **metrics) -> dict:
    """{name: (value, layer, per-step values)} → a diagnosis document."""
    return {
        "alerts": [{"name": a, "severity": "warning"} for a in alerts],
        "metrics": {n: {"value": v, "layer": layer, "trend": None}
                    for n, (v, layer, _) in metrics.items()},
        "series": {n: [[i + 1, x] for i, x in enumerate(points)]
                   for n, (_, layer, points) in metrics.items() if points},
    }


GAIN = {"delta": 0.2, "ci_low": 0.1, "ci_high": 0.3}
LOSS = {"delta": -0.2, "ci_low": -0.3, "ci_high": -0.1}
FLAT = {"delta": 0.02, "ci_low": -0.05, "ci_high": 0.09}


def test_series_noise_is_the_pooled_per_step_standard_deviation():
    a = [[1, 0.2], [2, 0.4], [3, 0.3]]  # sample var 0.01
    b = [[1, 0.5], [2, 0.5], [3, 0.8]]  # sample var 0.03
    assert series_noise(a, b) == pytest.approx(math.sqrt(0.02))
    assert series_noise([[1, 0.3]], None) is None  # one step: no spread to measure
    assert series_noise(a, [[1, None], [2, 0.1]]) == pytest.approx(0.1)


@pytest.mark.parametrize("comparison", [GAIN, LOSS])
def test_a_significant_move_with_flat_signal_and_behavior_is_unexplained(comparison):
    parent = diagnosis(avg_at_k=(0.3, "score", None),
                       dead_group_ratio=(0.40, "signal", [0.35, 0.45, 0.40]),
                       turns_mean=(3.0, "behavior", [2.9, 3.1, 3.0]),
                       leak_ratio=(0.0, "behavior", None))
    version = diagnosis(avg_at_k=(0.5, "score", None),
                        dead_group_ratio=(0.42, "signal", [0.38, 0.46, 0.42]),
                        turns_mean=(3.05, "behavior", [3.0, 3.1, 3.05]),
                        leak_ratio=(0.0, "behavior", None))
    gap = unexplained_outcome("v2", comparison, version, parent)
    assert gap is not None and gap.kind == "unexplained_outcome" and gap.version == "v2"
    assert set(gap.details["metrics"]) == {"dead_group_ratio", "turns_mean"}  # score excluded
    assert gap.details["unjudged"] == ["leak_ratio"]  # no series: no noise estimate
    assert all(m["sigmas"] <= 2.0 for m in gap.details["metrics"].values())
    assert ("rose" if comparison is GAIN else "fell") in gap.reason


def test_a_signal_move_beyond_its_noise_or_a_changed_alert_explains_the_move():
    parent = diagnosis(dead_group_ratio=(0.40, "signal", [0.39, 0.41, 0.40]))
    moved = diagnosis(dead_group_ratio=(0.10, "signal", [0.11, 0.09, 0.10]))
    assert unexplained_outcome("v2", GAIN, moved, parent) is None
    flat_but_alerting = diagnosis(["truncation"],
                                  dead_group_ratio=(0.40, "signal", [0.39, 0.41, 0.40]))
    assert unexplained_outcome("v2", GAIN, flat_but_alerting, parent) is None
    # An alert the parent had too explains nothing new.
    parent_alerting = diagnosis(["truncation"],
                                dead_group_ratio=(0.40, "signal", [0.39, 0.41, 0.40]))
    assert unexplained_outcome("v2", GAIN, flat_but_alerting, parent_alerting) is not None
    # An alert that cleared explains it too: the main job's v2 closed v0's leak (its metrics
    # have no per-step series) and gained; the gain is the leak fix's, not a gap.
    leaky_parent = diagnosis(["leak"], leak_ratio=(0.3, "behavior", None))
    closed = diagnosis(leak_ratio=(0.0, "behavior", None))
    assert unexplained_outcome("v2", GAIN, closed, leaky_parent) is None


def test_a_move_inside_the_ci_is_no_gap_whatever_the_metrics():
    parent = diagnosis(dead_group_ratio=(0.40, "signal", [0.39, 0.41, 0.40]))
    assert unexplained_outcome("v2", FLAT, parent, parent) is None
    assert unexplained_outcome("v2", None, parent, parent) is None
    assert unexplained_outcome("v2", GAIN, parent, None) is None  # a root: nothing to explain


def test_a_flat_series_makes_any_change_a_move():
    parent = diagnosis(truncation_rate=(0.0, "signal", [0.0, 0.0, 0.0]))
    version = diagnosis(truncation_rate=(0.01, "signal", [0.01, 0.01, 0.01]))
    assert unexplained_outcome("v2", GAIN, version, parent) is None


def test_skills_firing_on_the_same_metric_without_a_ranking_backtest_are_indistinguishable():
    fired = [FiredSkill("std-group-filter", "filter", frozenset({"dead_group_ratio"}), None),
             FiredSkill("aux-continuous-reward", "reward", frozenset({"dead_group_ratio"}), None),
             FiredSkill("raise-length-budget", "eval-protocol",
                        frozenset({"truncation_rate"}), None)]
    gap = indistinguishable_hypotheses("v1", fired)
    assert gap is not None and gap.kind == "indistinguishable_hypotheses"
    assert gap.details["skills"] == ["aux-continuous-reward", "std-group-filter"]
    assert gap.details["metrics"] == ["dead_group_ratio"]


def test_backtests_that_separate_the_skills_rank_them():
    ranked = [FiredSkill("std-group-filter", "filter", frozenset({"dead_group_ratio"}), 0.9),
              FiredSkill("aux-continuous-reward", "reward", frozenset({"dead_group_ratio"}), 0.1)]
    assert indistinguishable_hypotheses("v1", ranked) is None
    tied = [FiredSkill("a", "filter", frozenset({"dead_group_ratio"}), 0.50),
            FiredSkill("b", "reward", frozenset({"dead_group_ratio"}), 0.52)]
    assert indistinguishable_hypotheses("v1", tied) is not None
    apart = [FiredSkill("a", "filter", frozenset({"dead_group_ratio"})),
             FiredSkill("b", "eval-protocol", frozenset({"truncation_rate"}))]
    assert indistinguishable_hypotheses("v1", apart) is None  # different evidence
    assert indistinguishable_hypotheses("v1", tied[:1]) is None


def test_no_next_step_needs_no_trigger_and_a_stalled_frontier():
    gap = no_next_step("v3", False, ["v4", "v5"])
    assert gap is not None and gap.kind == "no_next_step" and gap.details["stalled"] == ["v4",
                                                                                        "v5"]
    assert no_next_step("v3", True, ["v4"]) is None  # a trigger fired: a next step exists
    assert no_next_step("v3", False, []) is None  # nothing tried yet from the frontier


# ---- outcomes ----------------------------------------------------------------------------

TRUNCATION_FIX = {"trigger": {"skill": "raise-length-budget",
                              "expression": 'truncation_rate > 0.15 || "truncation" in alerts',
                              "alerts": ["truncation"]}}


def test_the_issue_case_a_removed_pathology_with_a_gain_inside_the_ci_is_mixed_evidence():
    after = diagnosis(truncation_rate=(0.0, "signal", [0.0, 0.0, 0.0]))
    status = pathology_status(TRUNCATION_FIX, after)
    assert status["removed"] and status["trigger_holds"] is False
    outcome = classify(FLAT, pathology=status)
    assert outcome.kind == "mixed_evidence" and "not refuted" in outcome.reason


def test_a_persisting_pathology_inside_the_ci_is_insufficient_evidence():
    after = diagnosis(["truncation"], truncation_rate=(0.99, "signal", [0.99, 0.99, 0.99]))
    status = pathology_status(TRUNCATION_FIX, after)
    assert not status["removed"] and status["still_firing"] == ["truncation"]
    assert classify(FLAT, pathology=status).kind == "insufficient_evidence"
    assert classify(FLAT).kind == "insufficient_evidence"  # a move that targeted nothing


def test_significant_moves_and_blocks_decide_before_the_pathology():
    gone = pathology_status(TRUNCATION_FIX, diagnosis(truncation_rate=(0.0, "signal", None)))
    assert classify(GAIN, pathology=gone).kind == "improvement"
    assert classify(LOSS, pathology=gone).kind == "regression"
    assert classify(GAIN, blocked_by=["leak"]).kind == "regression"
    # Above zero but not above the gate's min_delta is not an improvement.
    assert classify(GAIN, min_delta=0.15).kind == "insufficient_evidence"
    assert classify(None) is None


def test_an_undecidable_trigger_leaves_the_motivating_alerts_to_decide():
    proposal = {"trigger": {"expression": "recipe.grpo.temperature < 0.5", "alerts": ["collapse"]}}
    gone = pathology_status(proposal, diagnosis())  # no recipe: the trigger cannot be read
    assert gone["trigger_holds"] is None and gone["removed"]
    assert pathology_status({"trigger": {"alerts": [], "values": {}}}, diagnosis()) is None
    assert pathology_status(None, diagnosis()) is None
