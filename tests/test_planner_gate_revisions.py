"""Gate-procedure revisions (agent/planners/gate_revisions.py) over real lineages: stand-in runs
whose validation set has two data sources (tests/standin_strata.py), the real diagnosis, gate
and backtest."""

from __future__ import annotations

import numpy as np
import pytest
from standin import propose as train
from standin_strata import StrataBackend, converge

from evotrainer.agent.planners import gate_revisions
from evotrainer.agent.planners.base import PlannerResult, View
from evotrainer.agent.propose import propose
from evotrainer.backends import BACKEND_TYPES
from evotrainer.control.validation import validate_workspace
from evotrainer.errors import EvoError
from evotrainer.gate.harness_backtest import adopt_harness
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.specs import load_yaml
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")

BUILT_IN = ("h0", "h1", "h2")


@pytest.fixture
def strata(workspace, monkeypatch) -> Workspace:
    monkeypatch.setitem(BACKEND_TYPES, "local", StrataBackend)
    return workspace


def built_in_untouched(ws: Workspace) -> bool:
    """The built-in revisions, in the workspace and on main, are byte for byte as shipped."""
    return all(
        ws.harness_path(name).read_bytes()
        == ws.git.read("main", f"harness_revisions/{name}.yaml")
        == (builtin_dir("harness_revisions") / f"{name}.yaml").read_bytes()
        for name in BUILT_IN)


def with_gate(ws: Workspace, field: str) -> Workspace:
    """h3 (h0 with one more gate `field`, a YAML line) committed and put in force."""
    text = ws.harness_path("h0").read_text()
    text = text.replace("name: h0\n", "name: h3\nparent: h0\n", 1).replace(
        "gate:\n  alpha: 0.05\n", f"gate:\n  alpha: 0.05\n  {field}\n", 1)
    ws.git.commit_files("main", {"harness_revisions/h3.yaml": text.encode()},
                        f"h0 with {field}", {})
    adopt_harness(ws, "h3")
    return Workspace(ws.root)


def test_strata_that_disagree_get_a_gate_revision_that_names_them(strata):
    """v1 gains on src_a and loses on src_b, both significantly, and the pooled gain promotes
    it. The planner proposes h3 (h2 is built in): h0 plus a rule that holds such a version
    back, backtested, its flip of v1 listed, so it is not adopted without a reviewer."""
    ws = strata
    train(ws, "v1", strata_skill={"src_a": 0.9, "src_b": 0.05}, standin_skill=0.6)
    converge(ws)
    decision = ws.version("v1").records["decision"]
    assert decision["verdict"] == "promote"
    by_source = {s["data_source"]: s for s in decision["comparison"]["strata"]}
    assert by_source["src_a"]["delta"] > 0 > by_source["src_b"]["delta"]

    result = propose(ws, "rules", 1)
    [revision] = result.harness
    assert (revision.name, revision.document["parent"]) == ("h3", "h0")
    assert revision.gap["kind"] == "strata_disagree" and revision.gap["version"] == "v1"
    assert ("src_a Δ +0.6000 (CI [+0.5374, +0.6625], 40 tasks) and src_b Δ -0.2750 "
            "(CI [-0.3250, -0.2219], 40 tasks)") in revision.rationale
    # The gate section changes and nothing else: one rule, before the promotion it guards.
    h0 = View.load(ws).harness
    rules = revision.document["gate"]["rules"]
    assert [r["name"] for r in rules] == ["integrity_alert", "leak_closed", "stratum_loss",
                                          "significant_gain", "significant_loss", "otherwise"]
    assert rules[2]["verdict"] == "inconclusive" and "s.p_value * double(size(strata))" in \
        rules[2]["when"]
    assert len(revision.document["metrics"]) == len(h0.metrics)
    # Backtested like a metric revision: the flip is listed, and its case (the recorded
    # verdict) fails, so the revision waits for a reviewer.
    [flip] = [r for r in revision.backtest["versions"] if r["flip"]]
    assert flip["version"] == "v1" and flip["flip"]["before"]["verdict"] == "promote"
    assert (flip["flip"]["after"]["verdict"], flip["flip"]["after"]["rule"]) == (
        "inconclusive", "stratum_loss")
    assert "flips v1: promote (rule significant_gain) → inconclusive (rule stratum_loss)" in \
        revision.rationale
    assert not revision.backtest["passed"]
    assert ws.git.read("main", "harness_revisions/h3.yaml") is not None
    with pytest.raises(EvoError, match="fails 1 backtest case"):
        adopt_harness(ws, "h3")
    assert Workspace(ws.root).harness_in_force() == "h0"
    assert validate_workspace(Workspace(ws.root)) == []  # `strata` type-checks in a rule
    assert built_in_untouched(ws)


def test_a_gate_that_resamples_across_sources_gets_its_strata_back(strata):
    """The split was recorded under h0; h3, in force since, resamples across all sources and
    records no per-source rows for the rule to read: the revision sets strata again."""
    ws = strata
    train(ws, "v1", strata_skill={"src_a": 0.9, "src_b": 0.05}, standin_skill=0.6)
    converge(ws)
    ws = with_gate(ws, "strata: none")
    result = PlannerResult()
    revision = gate_revisions.propose(View.load(ws), result)
    assert revision is not None and (revision.name, revision.document["parent"]) == ("h4", "h3")
    gate = revision.document["gate"]
    assert gate["strata"] == "data_source" and "stratum_loss" in {r["name"] for r in gate["rules"]}
    assert "resamples across all sources (strata: none)" in revision.rationale
    assert built_in_untouched(ws)


def test_strata_that_agree_get_no_gate_revision(strata):
    ws = strata
    train(ws, "v1", strata_skill={"src_a": 0.6, "src_b": 0.5}, standin_skill=0.6)
    converge(ws)
    assert ws.version("v1").records["decision"]["verdict"] == "promote"
    result = PlannerResult()
    assert gate_revisions.propose(View.load(ws), result) is None
    assert result.notes == []


def test_wide_intervals_beyond_the_monte_carlo_error_get_more_seeds_not_a_gate_revision(
        strata):
    """Two inconclusive versions, their intervals straddling 0 (one with sources that
    disagree in sign only within their noise): no gate field can change their reading, and
    the planner says that only more seeds or tasks narrow them."""
    ws = strata
    train(ws, "v1", strata_skill={"src_a": 0.31, "src_b": 0.31})
    train(ws, "v2", strata_skill={"src_a": 0.33, "src_b": 0.33})
    converge(ws)
    assert [ws.version(v).records["decision"]["verdict"] for v in ("v1", "v2")] == [
        "inconclusive"] * 2
    result = PlannerResult()
    assert gate_revisions.propose(View.load(ws), result) is None
    gap, why = result.notes
    assert gap.startswith("gap wide_intervals on v2: 2 inconclusive decisions")
    assert "no gate procedure narrows" in why and "evidence reruns" in why
    assert "No gate revision changes their reading" in why and "BCa reads them alike" in why


def test_wide_intervals_within_the_monte_carlo_error_get_more_resamples(strata):
    """Under a gate of 200 resamples two lower ends lie within two Monte-Carlo errors of 0:
    the revision asks for the resamples that settle them, says that this makes the ends
    exact and not the intervals narrower, and is backtested on the recorded versions."""
    ws = with_gate(strata, "resamples: 200")
    train(ws, "v1", strata_skill={"src_a": 0.36, "src_b": 0.36})
    train(ws, "v2", strata_skill={"src_a": 0.36, "src_b": 0.36})
    converge(ws)
    result = PlannerResult()
    revision = gate_revisions.propose(View.load(ws), result)
    assert revision is not None and (revision.name, revision.document["parent"]) == ("h4", "h3")
    assert revision.gap["kind"] == "wide_intervals"
    gate = revision.document["gate"]
    assert gate["resamples"] == 10_000 and "ci_method" not in gate
    h3 = load_yaml(ws.harness_path("h3").read_bytes(), "h3")["gate"]
    assert {**gate, "resamples": 200} == h3
    assert "lower end" in revision.rationale and "Monte-Carlo error of ±" in revision.rationale
    assert "not the interval narrower" in revision.rationale
    assert "more seeds or tasks do" in revision.rationale
    assert {c["version"] for c in revision.backtest["cases"]} == {"v1", "v2"}
    assert built_in_untouched(ws)


def test_the_monte_carlo_error_is_the_spread_of_a_bootstrap_quantile():
    """sqrt(q(1-q)/B) / φ(z_q) · σ against the spread of the 2.5% quantile of B normal draws
    of spread σ, over many repetitions."""
    sigma, resamples = 0.02, 1000
    z = 1.959964
    comparison = {"ci_low": -z * sigma, "ci_high": z * sigma, "confidence": 0.95}
    rng = np.random.default_rng(0)
    quantiles = np.quantile(rng.normal(0.0, sigma, (4000, resamples)), 0.025, axis=1)
    assert gate_revisions.monte_carlo_error(comparison, resamples) == pytest.approx(
        quantiles.std(), rel=0.05)


def test_an_interval_end_on_its_threshold_gets_bca_and_more_resamples(strata):
    """Both lower ends sit on 0 exactly (the rule asks for more than 0), where BCa, which
    corrects the percentile interval's bias and skew, reads a gain: the revision proposes
    BCa and the most resamples the schema allows, says that a method picked for its reading
    is a forking path, and its backtest lists what it flips."""
    ws = strata
    train(ws, "v1", strata_skill={"src_a": 0.338, "src_b": 0.338})
    train(ws, "v2", strata_skill={"src_a": 0.358, "src_b": 0.358})
    converge(ws)
    for name in ("v1", "v2"):
        decision = ws.version(name).records["decision"]
        assert decision["verdict"] == "inconclusive" and decision["comparison"]["ci_low"] == 0.0
    result = PlannerResult()
    revision = gate_revisions.propose(View.load(ws), result)
    assert revision is not None and (revision.name, revision.document["parent"]) == ("h3", "h0")
    gate = revision.document["gate"]
    assert (gate["ci_method"], gate["resamples"]) == ("bca", gate_revisions.MAX_RESAMPLES)
    assert "read v1 as a gain" in revision.rationale and "forking path" in revision.rationale
    # BCa's lower ends leave 0 while the bootstrap p stays above alpha: the flips a reviewer
    # must weigh, and the cases (the recorded verdicts) that keep it from adoption till then.
    assert [r["version"] for r in revision.backtest["versions"] if r["flip"]] == ["v1", "v2"]
    assert ("Backtest against h0: flips v1: inconclusive (rule otherwise) → promote (rule "
            "significant_gain)") in revision.rationale
    assert not revision.backtest["passed"]
    assert built_in_untouched(ws)
