"""The rules planner over real lineages (stand-in engine, real diagnosis and gate): what it
proposes, with which evidence, and what it refuses to propose again."""

from __future__ import annotations

import pytest
from standin import converge, standin_settings
from standin import propose as train

from evotrainer.agent.planners.base import View
from evotrainer.agent.planners.rules import RulesPlanner
from evotrainer.agent.propose import propose
from evotrainer.commands.init import init_workspace
from evotrainer.control.versions import approve, new_version
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


@pytest.fixture
def toolenv(tmp_path) -> Workspace:
    return Workspace(init_workspace(tmp_path / "toolenv", "toolenv"))


def spec(ws: Workspace, name: str) -> dict:
    return ws.version(name).spec


def test_leaky_version_scores_higher_is_pruned_and_the_planner_closes_the_leak(toolenv):
    train(toolenv, "v1", standin_skill=0.65, standin_leak=True)
    converge(toolenv)
    decision = toolenv.version("v1").records["decision"]
    assert decision["comparison"]["ci_low"] > 0  # it scored higher than v0 ...
    assert decision["verdict"] == "prune" and decision["blocked_by"] == ["leak"]  # ... blocked

    result = propose(toolenv, "rules", 1)
    [proposal] = result.proposals
    assert (proposal.name, proposal.parent, proposal.skills) == ("v2", "v0", ["close-leak"])
    v2 = spec(toolenv, "v2")
    assert v2["approval"]["approved"] is False
    assert v2["intervention"]["hypothesis"]["criterion"] == "leak_ratio <= 0.0"
    assert {"name": "reveal", "enabled": False} in v2["recipe"]["environment"]["tools"]
    assert v2["proposal"]["planner"] == "rules" and v2["proposal"]["tokens"] == 0
    assert v2["proposal"]["trigger"]["alerts"] == ["leak"]
    assert "fired on v1 (prune" in v2["intervention"]["rationale"]
    # Proposed once: a second decision moves on instead of repeating it.
    again = propose(toolenv, "rules", 1)
    assert [p.skills for p in again.proposals] != [["close-leak"]]


def test_on_swe_the_planner_closes_the_leak_with_the_domains_own_mechanism(tmp_path):
    """close-leak's toolenv patch (disable `reveal`) means nothing to swe: there its
    mechanism is clear_git_log, and the toolenv patch must not leak into the recipe."""
    swe = Workspace(init_workspace(tmp_path / "swe", "swe"))
    train(swe, "v1", standin_skill=0.65, standin_leak=True)
    converge(swe)
    assert swe.version("v1").records["decision"]["blocked_by"] == ["leak"]

    [proposal] = propose(swe, "rules", 1).proposals
    assert (proposal.parent, proposal.skills) == ("v0", ["close-leak"])
    recipe = swe.resolved_recipe(proposal.name)
    assert recipe["domain"]["params"]["clear_git_log"] is True
    assert "reveal" not in str(spec(swe, proposal.name)["recipe"])
    # The resolved recipe is one the real engine accepts (the stand-in checks nothing).
    from evotrainer.backends import get_backend

    get_backend("local").check(recipe)


def test_high_dead_group_ratio_gets_a_filter_or_aux_signal_with_backtest_numbers(workspace):
    train(workspace, "v1", standin_skill=0.95)  # nearly every group all-correct: dead
    converge(workspace)
    result = propose(workspace, "rules", 3)
    by_skill = {p.skills[0]: spec(workspace, p.name) for p in result.proposals}
    assert set(by_skill) == {"std-group-filter", "zero-std-filter", "aux-continuous-reward"}
    assert all(s["parent"] == "v1" for s in by_skill.values())
    std = by_skill["std-group-filter"]
    backtest = std["proposal"]["backtest"]
    assert backtest["version"] == "v1" and backtest["filter"] == "std_group_filter"
    assert backtest["dead_group_ratio_before"] > 0.5 == backtest["dead_group_ratio_after"] + 0.5
    assert f"keeps {backtest['keep_ratio']:.0%}" in std["intervention"]["rationale"]
    assert std["proposal"]["trigger"]["values"]["dead_group_ratio"] > 0.5
    assert std["intervention"]["hypothesis"]["criterion"].startswith("delta > 0.0")
    # The filters would keep under 30% of some step's groups (over-filtering), so the
    # auxiliary signal, whose component the stand-in did not record, comes first.
    assert backtest["keep_ratio_min_step"] < 0.3 and "over-filtering" in std[
        "intervention"]["rationale"]
    assert result.proposals[0].skills == ["aux-continuous-reward"]
    assert "error" in by_skill["aux-continuous-reward"]["proposal"]["backtest"]


def test_refuted_skills_are_skipped_and_escalation_subtracts(workspace):
    project = workspace.root / "spec" / "project.yaml"
    project.write_text(project.read_text().replace("escalate_after_failures: 3",
                                                   "escalate_after_failures: 2"))
    workspace = Workspace(workspace.root)
    new_version(workspace, "v1", "v0", rationale="filter", skills=["zero-std-filter"],
                settings=standin_settings(standin_skill=0.95))
    approve(workspace, "v1", by="tester")
    new_version(workspace, "v2", "v1", rationale="filter", skills=["std-group-filter"],
                settings=standin_settings(standin_skill=0.5))
    approve(workspace, "v2", by="tester")
    train(workspace, "v3", parent="v1", standin_skill=0.5)
    converge(workspace)
    view = View.load(workspace)
    assert view.frontier() == "v1"
    assert view.failure_streak() == ["v2", "v3"]
    assert view.refuted_skills("v1") == {"std-group-filter": "v2"}

    result = RulesPlanner().propose(view, 3)
    first = result.proposals[0]
    assert first.parent == "v1" and first.skills == []
    assert 'group_filter.name="none"' in first.settings  # undo v1's zero-std-filter
    assert first.proposal["escalation"]["failed"] == ["v2", "v3"]
    assert "subtract rather than add" in first.rationale
    assert all("std-group-filter" not in p.skills for p in result.proposals)
    assert any("escalation" in n for n in result.notes)


def test_no_trigger_proposes_the_default_and_an_unexplained_prune_a_harness_metric(workspace):
    train(workspace, "v1", standin_skill=0.65)
    train(workspace, "v2", parent="v1", standin_skill=0.4)
    converge(workspace)
    view = View.load(workspace)
    assert view.verdict("v2") == "prune"
    assert not workspace.version("v2").records["diagnosis"]["alerts"]

    result = propose(workspace, "rules", 2)
    steps = workspace.resolved_recipe("v1")["grpo"]["steps"]
    # More training continues v1's recorded policy rather than retraining twice the steps.
    assert [p.settings for p in result.proposals] == [
        ['model.init="parent"', f"grpo.steps={steps}"], ["seeds=[0, 1]"]]
    assert result.proposals[0].rationale.startswith("No skill trigger fired on v1")
    assert f"continue v1's policy for {steps} more steps" in result.proposals[0].rationale
    [harness] = result.harness
    assert harness.name == "h1" and harness.document["parent"] == "h0"
    added = {m["name"] for m in harness.document["metrics"]} - {
        m.name for m in view.harness.metrics}
    assert len(added) == 1
    assert harness.backtest["passed"] and {c["version"] for c in harness.backtest["cases"]} == {
        "v1", "v2"}
    # Committed on main, not in force: the project still names h0.
    assert workspace.git.read("main", "harness_versions/h1.yaml") is not None
    assert Workspace(workspace.root).harness_in_force() == "h0"
    # The defaults are not proposed twice; neither is the metric.
    again = propose(workspace, "rules", 2)
    assert not again.harness
    assert all(p.settings not in (['model.init="parent"', f"grpo.steps={steps}"],
                                  ["seeds=[0, 1]"])
               for p in again.proposals)


def test_more_training_continues_the_frontiers_policy_and_a_seed_rerun_does_not(workspace):
    """After a promotion with no trigger, "more training" continues the frontier's recorded
    policy for its steps again; the continued child really starts from those weights, and
    from a continuation the second-seed default is trained from the base, not continued."""
    train(workspace, "v1", standin_skill=0.65)
    converge(workspace)
    steps = workspace.resolved_recipe("v1")["grpo"]["steps"]
    [more] = propose(workspace, "rules", 1).proposals
    assert more.settings == ['model.init="parent"', f"grpo.steps={steps}"]
    new_version(workspace, "v3", "v1", rationale="continued",
                settings=[*more.settings, *standin_settings(standin_skill=0.9)])
    approve(workspace, "v3", by="tester")
    converge(workspace)
    v1_policy = workspace.version("v1").records["run"]["artifacts"]["checkpoint"]
    log = workspace.root / workspace.version("v3").records["run"]["artifact_dir"] / "train.log"
    assert (f"continuing from {workspace.root / v1_policy['path']} {v1_policy['digest']}"
            in log.read_text())
    assert View.load(workspace).frontier() == "v3"

    proposals = RulesPlanner().propose(View.load(workspace), 6).proposals
    defaults = [p for p in proposals if p.proposal.get("default")]  # after any fired skill
    assert [p.settings for p in defaults] == [
        ['model.init="parent"', f"grpo.steps={steps}"], ['model.init="base"', "seeds=[0, 1]"]]
    assert "trained from the base" in defaults[1].rationale


def test_more_training_retrains_from_the_base_when_the_frontiers_policy_was_dropped(workspace):
    train(workspace, "v1", standin_skill=0.65)
    converge(workspace)
    view = View.load(workspace)
    view.states["v1"].records["run"]["artifacts"]["checkpoint"]["dropped"] = {
        "at": "2026-01-01T00:00:00Z", "reason": "retention"}
    steps = workspace.resolved_recipe("v1")["grpo"]["steps"]
    [more] = RulesPlanner().propose(view, 1).proposals
    assert more.settings == [f"grpo.steps={2 * steps}"]
