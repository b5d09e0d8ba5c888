"""The rules planner's moves beyond one skill at a time, over real lineages (stand-in engines
with planted pathologies, real diagnosis and gate): building on mixed evidence, bundling,
reverting, and evolving the harness when a diagnostic gap fires."""

from __future__ import annotations

import pytest
import yaml
from sealing import controller_commit
from standin import no_std_group_filter
from standin import propose as train
from standin_planted import PlantedBackend, converge

from evotrainer.agent.planners.base import View
from evotrainer.agent.planners.rules import RulesPlanner
from evotrainer.agent.propose import propose
from evotrainer.backends import BACKEND_TYPES
from evotrainer.control.versions import approve, new_version
from evotrainer.store.workspace import Workspace, run_path

pytestmark = pytest.mark.usefixtures("standin", "planted")


@pytest.fixture
def planted(monkeypatch):
    monkeypatch.setitem(BACKEND_TYPES, "local", PlantedBackend)


def decision(ws: Workspace, name: str) -> dict:
    return ws.version(name).records["decision"]


def truncated_frontier(ws: Workspace) -> None:
    """v1: responses need 12 tokens under the default budget of 8, so every one is cut
    (truncation_rate 1.0); promoted over the untrained v0."""
    train(ws, "v1", standin_skill=0.5, planted_need=12)
    converge(ws)
    assert decision(ws, "v1")["verdict"] == "promote"
    assert [a["name"] for a in ws.version("v1").records["diagnosis"]["alerts"]] == ["truncation"]


def test_a_removed_truncation_with_a_gain_inside_the_ci_is_built_upon(workspace):
    """raise-length-budget took truncation to none with a gain inside the CI: mixed
    evidence, built upon, not a refuted skill to go back from."""
    truncated_frontier(workspace)
    [fix] = propose(workspace, "rules", 1).proposals
    assert (fix.parent, fix.skills) == ("v1", ["raise-length-budget"])
    approve(workspace, fix.name, by="tester")
    converge(workspace)
    gated = decision(workspace, fix.name)
    diagnosis = workspace.version(fix.name).records["diagnosis"]
    assert diagnosis["metrics"]["truncation_rate"]["value"] == 0.0 and not diagnosis["alerts"]
    assert gated["comparison"]["ci_low"] <= 0.0 <= gated["comparison"]["ci_high"]
    assert gated["verdict"] == "inconclusive"
    assert gated["outcome"]["kind"] == "mixed_evidence"
    assert gated["outcome"]["pathology"]["removed"] is True

    view = View.load(workspace)
    assert not view.failed(fix.name)
    assert "raise-length-budget" not in view.refuted_skills(fix.name)
    assert view.proposal_base("v1") == fix.name
    result = propose(workspace, "rules", 2)
    assert result.proposals and all(p.parent == fix.name for p in result.proposals)
    built = workspace.version(result.proposals[0].name).spec
    assert built["proposal"]["builds_on"]["version"] == fix.name
    assert built["intervention"]["rationale"].startswith(f"Builds on {fix.name} (mixed evidence")
    assert not [n for n in result.notes if "raise-length-budget" in n and "refuted" in n]


def test_two_supported_single_factor_fixes_are_bundled(workspace):
    truncated_frontier(workspace)
    [fix] = propose(workspace, "rules", 1).proposals
    approve(workspace, fix.name, by="tester")
    # A second fix from v1, on another setting, proposed for a pathology its recipe change
    # removes (the trigger reads the temperature it raises).
    new_version(workspace, "v3", "v1", rationale="hotter sampler", skills=["temperature-raise"],
                proposal={"planner": "test", "trigger": {
                    "skill": "temperature-raise", "expression": "recipe.grpo.temperature < 1.1",
                    "alerts": []}})
    approve(workspace, "v3", by="tester")
    converge(workspace)
    assert {decision(workspace, v)["outcome"]["kind"] for v in (fix.name, "v3")} == {
        "mixed_evidence"}

    result = propose(workspace, "rules", 1)
    [bundle] = result.proposals
    assert bundle.parent == "v1" and bundle.proposal["move"] == "bundle"
    assert sorted(bundle.skills) == ["raise-length-budget", "temperature-raise"]
    assert bundle.proposal["bundles"] == [fix.name, "v3"]
    spec = workspace.version(bundle.name).spec
    assert spec["intervention"]["factors"] == 2
    assert {"max_response_tokens", "temperature"} <= set(spec["recipe"]["grpo"])
    assert "Bundle (controlled multi-factor)" in spec["intervention"]["rationale"]
    # Proposed once: the next decision does not bundle the same pair again.
    assert all(p.proposal.get("move") != "bundle"
               for p in propose(workspace, "rules", 2).proposals)


def test_a_regression_on_the_frontiers_chain_is_reverted(workspace):
    train(workspace, "v1", standin_skill=0.65, planted_need=4)
    converge(workspace)
    # As a gate whose rule promoted it although the score fell would record it.
    record = dict(decision(workspace, "v1"))
    record["outcome"] = {"kind": "regression", "reason": "the score fell significantly"}
    controller_commit(workspace, "v1", {run_path("v1", "decision.yaml"):
                                        yaml.safe_dump(record).encode()})
    converge(workspace)  # main follows the branch's new tip
    view = View.load(workspace)
    assert view.frontier() == "v1"
    revert = next(p for p in RulesPlanner().propose(view, 5).proposals
                  if p.proposal.get("move") == "revert")
    assert revert.parent == "v1" and revert.proposal["reverts"] == "v1"
    # v1 set its stand-in parameters; the revert removes them again (null deletes a key).
    assert "domain.params.planted_need=null" in revert.settings
    assert revert.rationale.startswith("Revert: v1 (promote")


def test_an_outcome_no_train_metric_explains_evolves_the_harness_with_the_metric_that_does(
        workspace):
    """Gap (a): validation correctness moved, the train rollouts did not; the catalogue's
    train/val gap separates v1 from v0."""
    train(workspace, "v1", standin_skill=0.3, planted_val_skill=0.75)
    converge(workspace)
    assert decision(workspace, "v1")["gaps"][0]["kind"] == "unexplained_outcome"
    result = RulesPlanner().propose(View.load(workspace), 1)
    [harness] = result.harness
    assert harness.gap["kind"] == "unexplained_outcome" and harness.gap["version"] == "v1"
    added = [m["name"] for m in harness.document["metrics"]][-1]
    assert added == "train_val_gap"
    assert harness.backtest["passed"]
    assert "unexplained_outcome on v1" in harness.document["description"]


def test_skills_that_no_recorded_number_ranks_evolve_the_harness_with_a_metric_naming_them(
        workspace):
    """Gap (b): nearly every group all-correct fires two filters and an auxiliary reward on
    the same dead-group evidence; the filters' backtests tie and the reward has none."""
    train(workspace, "v1", standin_skill=0.95)
    converge(workspace)
    result = RulesPlanner().propose(View.load(workspace), 3)
    [harness] = result.harness
    assert harness.gap["kind"] == "indistinguishable_hypotheses"
    assert {"std-group-filter", "zero-std-filter"} <= set(harness.gap["details"]["skills"])
    from evotrainer.diagnosis.catalogue import catalogue

    added = harness.document["metrics"][-1]["name"]
    [entry] = [e for e in catalogue() if e.metric["name"] == added]
    assert set(entry.hypotheses) & set(harness.gap["details"]["skills"])
    assert "indistinguishable_hypotheses" in entry.gaps



def test_no_trigger_on_a_stalled_frontier_evolves_the_harness(workspace):
    """Gap (c): v1 fires no trigger and its child failed."""
    train(workspace, "v1", standin_skill=0.65)
    train(workspace, "v2", parent="v1", standin_skill=0.4)
    converge(workspace)
    no_std_group_filter(workspace)
    result = RulesPlanner().propose(View.load(workspace), 2)
    [harness] = result.harness
    assert harness.gap == {"kind": "no_next_step", "version": "v1",
                           "reason": harness.gap["reason"], "details": {"stalled": ["v2"]}}
    assert any(n.startswith("gap no_next_step on v1") for n in result.notes)
    # The default moves are still proposed beside it.
    assert result.proposals and all(p.parent == "v1" for p in result.proposals)


def test_a_fired_skill_already_applied_is_no_next_step(workspace):
    """Gap (c) when a trigger fires but its fix is already in the recipe: it selects no next
    intervention, so the stalled frontier still evolves the harness (a persistent pathology
    whose library fix is applied stalls a lineage as surely as no trigger at all)."""
    text = (workspace.root / "skills" / "kl-cap.yaml").read_text()
    applied = (text.replace("name: kl-cap", "name: already-there")
               .replace(text[text.index("trigger:"):text.index("mechanism:")],
                        "trigger: avg_at_k >= 0.0\n")
               .replace(text[text.index("  recipe_patch:"):text.index("domains:")],
                        "  recipe_patch:\n    grpo:\n      kl_estimator: k3\n"))
    workspace.git.commit_files("main", {"skills/already-there.yaml": applied.encode()},
                               "a skill whose patch every recipe here already has")
    train(workspace, "v1", standin_skill=0.65)
    train(workspace, "v2", parent="v1", standin_skill=0.4)
    converge(workspace)
    no_std_group_filter(workspace)
    result = RulesPlanner().propose(View.load(workspace), 2)
    assert any(n.startswith("skipped already-there: it changes nothing") for n in result.notes)
    [harness] = result.harness
    assert harness.gap["kind"] == "no_next_step" and harness.gap["version"] == "v1"
