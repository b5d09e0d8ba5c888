"""The gate over real lineages (stand-in engine, real diagnosis): the outcome and the
diagnostic gap recorded beside the verdict, and the gate procedure's fields honoured —
absent, the decision is the one the gate always made."""

from __future__ import annotations

from pathlib import Path

import pytest
from standin import converge
from standin import propose as train
from standin_planted import PlantedBackend
from standin_planted import converge as converge_planted

from evotrainer.backends import BACKEND_TYPES
from evotrainer.diagnosis.harness import parse_harness, resolve_harness
from evotrainer.gate.decision import decide, recorded_scores, references
from evotrainer.gate.rules import gate_verdict
from evotrainer.stats import GateProcedure
from evotrainer.stats.paired import compare_tables
from evotrainer.store.specs import load_yaml
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


@pytest.fixture
def planted(monkeypatch):
    monkeypatch.setitem(BACKEND_TYPES, "local", PlantedBackend)


def _redecide(ws: Workspace, name: str, procedure: GateProcedure | None = None) -> dict:
    states = ws.versions()
    return decide(ws, states, states[name], resolve_harness("h0", ws.root), procedure)


def test_the_recorded_decision_carries_its_outcome_and_the_default_procedure_changes_nothing(
        workspace):
    train(workspace, "v1", standin_skill=0.65)
    train(workspace, "v2", parent="v1", standin_skill=0.2)
    converge(workspace)
    v1, v2 = (workspace.version(n).records["decision"] for n in ("v1", "v2"))
    assert (v1["verdict"], v1["outcome"]["kind"]) == ("promote", "improvement")
    assert (v2["verdict"], v2["outcome"]["kind"]) == ("prune", "regression")
    # Absent procedure fields = the method's test, exactly: same numbers as a plain
    # compare_tables, no procedure keys added, the same verdict.
    again = _redecide(workspace, "v2", GateProcedure())
    plain = compare_tables(recorded_scores(workspace, "v1"), recorded_scores(workspace, "v2"))
    # (the diagnosis recorded the comparison, rounded; the gate reads it back)
    assert again["comparison"].keys() == plain.keys() == v2["comparison"].keys()
    for key in ("delta", "ci_low", "ci_high", "p_bootstrap", "p_wilcoxon"):
        assert again["comparison"][key] == pytest.approx(plain[key], abs=1e-5)
    assert again.keys() == v2.keys()
    assert (again["verdict"], again["reason"], again["outcome"]) == (
        v2["verdict"], v2["reason"], v2["outcome"])


def test_a_version_that_beats_its_failed_parent_but_not_the_root_is_not_promoted(workspace):
    train(workspace, "v1", standin_skill=0.05)
    train(workspace, "v2", parent="v1", standin_skill=0.3)
    converge(workspace)
    assert workspace.version("v1").records["decision"]["verdict"] == "prune"
    default = workspace.version("v2").records["decision"]
    # Its parent is not on main: the gate decides against main's frontier v0 (the root),
    # which v2 does not beat, and records the comparison with v1 beside it.
    assert default["verdict"] == "inconclusive" and default["against_main"]["version"] == "v0"
    assert default["family"]["members"]["parent"]["verdict"] == "promote"
    states = workspace.versions()
    assert references(workspace, states, states["v2"], ("parent", "root")) == {
        "parent": "v1", "root": "v0"}
    family = _redecide(workspace, "v2", GateProcedure(compare_with=("parent", "root")))
    assert family["verdict"] == "inconclusive"
    assert "not promoted: against the root v0" in family["reason"]
    members = family["family"]["members"]
    assert (members["parent"]["verdict"], members["root"]["verdict"]) == (
        "promote", "inconclusive")
    # Each interval at alpha / 2: wider than the parent comparison the gate made alone.
    parent = members["parent"]["comparison"]
    assert parent["confidence"] == pytest.approx(0.975)
    alone = compare_tables(recorded_scores(workspace, "v1"), recorded_scores(workspace, "v2"))
    assert parent["ci_low"] < alone["ci_low"]
    assert parent["p_unadjusted"] <= parent["p_bootstrap"]


def test_bca_and_unstratified_procedures_recompute_the_comparison(workspace):
    train(workspace, "v1", standin_skill=0.65)
    converge(workspace)
    decision = _redecide(workspace, "v1", GateProcedure(ci_method="bca", resamples=2000,
                                                        strata="none"))
    assert decision["comparison"]["ci_method"] == "bca"
    assert decision["comparison"]["stratified"] is False
    assert decision["comparison"]["resamples"] == 2000


def test_a_score_move_no_train_metric_explains_is_recorded_as_a_gap(workspace, planted):
    # Validation correctness moves, the train rollouts do not: h0 sees the score only.
    train(workspace, "v1", standin_skill=0.3, planted_val_skill=0.75)
    converge_planted(workspace)
    decision = workspace.version("v1").records["decision"]
    assert decision["comparison"]["ci_low"] > 0
    [gap] = decision["gaps"]
    assert gap["kind"] == "unexplained_outcome" and gap["version"] == "v1"
    assert "dead_group_ratio" in gap["details"]["metrics"]
    # The same score move with the train rollouts moving along is explained.
    train(workspace, "v2", standin_skill=0.75)
    converge_planted(workspace)
    explained = workspace.version("v2").records["decision"]
    assert explained["comparison"]["ci_low"] > 0 and "gaps" not in explained


def test_a_rule_reads_each_data_sources_comparison_as_strata():
    """`strata` holds the comparison's per-data_source rows: a rule may hold back a pooled
    gain whose source falls significantly, and reads nothing where there are no rows."""
    h0 = resolve_harness("h0")
    doc = load_yaml(Path(h0.source).read_bytes(), h0.source)
    doc["gate"]["rules"] = [{"name": "source_loss", "verdict": "inconclusive",
                             "when": "strata.exists(s, s.ci_high < 0.0)"},
                            *doc["gate"]["rules"]]
    harness = parse_harness(doc)
    diagnosis = {"metrics": {}, "alerts": []}

    def row(source: str, low: float, high: float) -> dict:
        return {"data_source": source, "n_tasks": 40, "delta": (low + high) / 2,
                "ci_low": low, "ci_high": high, "p_bootstrap": 0.01}

    pooled = {"delta": 0.1, "ci_low": 0.05, "ci_high": 0.15}
    split = gate_verdict(harness, diagnosis, {**pooled, "strata": [
        row("a", 0.3, 0.5), row("b", -0.3, -0.1)]})
    assert (split["verdict"], split["rule"]) == ("inconclusive", "source_loss")
    assert split["variables"]["strata"][1] == {
        "data_source": "b", "n_tasks": 40, "delta": -0.2, "ci_low": -0.3, "ci_high": -0.1,
        "p_value": 0.01}
    agree = gate_verdict(harness, diagnosis, {**pooled, "strata": [row("a", 0.0, 0.2)]})
    assert gate_verdict(harness, diagnosis, pooled)["verdict"] == agree["verdict"] == "promote"
