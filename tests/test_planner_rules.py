"""The rules planner over real lineages (stand-in engine, real diagnosis and gate): what it
proposes, with which evidence, and what it refuses to propose again."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from standin import converge, no_std_group_filter, standin_settings
from standin import propose as train

from evotrainer.agent.planners.base import View
from evotrainer.agent.planners.rules import RulesPlanner
from evotrainer.agent.propose import propose
from evotrainer.control.scaffold import EXAMPLES_DIR, init_workspace
from evotrainer.control.versions import approve, new_version
from evotrainer.skills.skill import Match, load_library, match
from evotrainer.store.recipe import BASE_RECIPE, deep_merge
from evotrainer.store.workspace import PROJECT_FILE, Workspace

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
    # The rationale cites what the project recorded (agent/retrieval.py): the skill's evidence
    # and v1's own leak, each with where it was read; the search trace is kept beside it.
    assert "Recorded knowledge: close-leak — workspace" in v2["intervention"]["rationale"]
    assert "version v1 @" in v2["intervention"]["rationale"]
    [search] = v2["proposal"]["retrieval"]
    assert search["query"]["alerts"] == ["leak"] and search["retrieved"]
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



def test_escalation_never_subtracts_the_fix_that_closed_a_leak(toolenv):
    """v2 closes v1's leak and is promoted; two failed children follow. The escalation rolls
    back to v2 and subtracts, but never close-leak: re-enabling `reveal` would re-open the
    leak the gate blocks whatever the score."""
    project = toolenv.root / "spec" / "project.yaml"
    project.write_text(project.read_text().replace("escalate_after_failures: 3",
                                                   "escalate_after_failures: 2"))
    toolenv = Workspace(toolenv.root)
    train(toolenv, "v1", standin_skill=0.65, standin_leak=True)
    new_version(toolenv, "v2", "v0", rationale="close the leak", skills=["close-leak"],
                settings=standin_settings(standin_skill=0.65))
    approve(toolenv, "v2", by="tester")
    train(toolenv, "v3", parent="v2", standin_skill=0.4)
    train(toolenv, "v4", parent="v2", standin_skill=0.4)
    converge(toolenv)
    view = View.load(toolenv)
    assert view.frontier() == "v2" and view.failure_streak() == ["v3", "v4"]

    result = RulesPlanner().propose(view, 3)
    assert result.proposals  # the escalation still proposes something
    for proposal in result.proposals:
        assert "subtracts" not in proposal.proposal, proposal.rationale
        assert not any("reveal" in setting for setting in proposal.settings), proposal.settings
    assert "kept close-leak (applied by v2): an audit fix is never subtracted" in result.notes


def test_no_trigger_proposes_the_default_and_a_stalled_frontier_a_harness_metric(workspace):
    train(workspace, "v1", standin_skill=0.65)
    train(workspace, "v2", parent="v1", standin_skill=0.4)
    converge(workspace)
    view = View.load(workspace)
    assert view.verdict("v2") == "prune"
    assert not workspace.version("v2").records["diagnosis"]["alerts"]
    no_std_group_filter(workspace)

    result = propose(workspace, "rules", 2)
    steps = workspace.resolved_recipe("v1")["grpo"]["steps"]
    # More training continues v1's recorded policy rather than retraining twice the steps.
    assert [p.settings for p in result.proposals] == [
        ['model.init="parent"', f"grpo.steps={steps}"], ["seeds=[0, 1]"]]
    assert result.proposals[0].rationale.startswith("No skill trigger fired on v1")
    assert f"continue v1's policy for {steps} more steps" in result.proposals[0].rationale
    [harness] = result.harness
    # h3: h0, h1 and h2 are built in, so the planner names its revision after them.
    assert harness.name == "h3" and harness.document["parent"] == "h0"
    # v1 fires no trigger and its only child failed: gap (c), no next step.
    assert (harness.gap["kind"], harness.gap["version"]) == ("no_next_step", "v1")
    message = subprocess.run(["git", "-C", str(workspace.root), "log", "-1", "--format=%B",
                              "main", "--", "harness_revisions/h3.yaml"],
                             capture_output=True, text=True, check=True).stdout
    assert "Gap: no_next_step on v1" in message
    added = {m["name"] for m in harness.document["metrics"]} - {
        m.name for m in view.harness.metrics}
    assert len(added) == 1
    assert harness.backtest["passed"] and {c["version"] for c in harness.backtest["cases"]} == {
        "v1", "v2"}
    # Committed on main, not in force: the project still names h0.
    assert workspace.git.read("main", "harness_revisions/h3.yaml") is not None
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
    no_std_group_filter(workspace)
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
    no_std_group_filter(workspace)
    view = View.load(workspace)
    view.states["v1"].records["run"]["artifacts"]["checkpoint"]["dropped"] = {
        "at": "2026-01-01T00:00:00Z", "reason": "retention"}
    steps = workspace.resolved_recipe("v1")["grpo"]["steps"]
    [more] = RulesPlanner().propose(view, 1).proposals
    assert more.settings == [f"grpo.steps={2 * steps}"]


# ---- triggers that read the recipe: a cold sampler and a warm start stopped too early ----
# Diagnoses as the autonomy gym's runs recorded them (bench/autonomy.py --quick, seed 0, the
# as-is child v1 of each setup; `healthy` is an arith run at temperature 1.0).

GYM_DIAGNOSES = {
    "cold": {"dead_group_ratio": 0.733, "all_correct_group_ratio": 0.366,
             "all_wrong_group_ratio": 0.367, "mean_logprob": -0.147, "truncation_rate": 0.0},
    "too_hard": {"dead_group_ratio": 0.588, "all_correct_group_ratio": 0.0,
                 "all_wrong_group_ratio": 0.588, "mean_logprob": -1.45, "truncation_rate": 0.0},
    "lr_collapse": {"dead_group_ratio": 0.978, "all_correct_group_ratio": 0.0,
                    "all_wrong_group_ratio": 0.978, "mean_logprob": -3.81,
                    "truncation_rate": 0.0},
    "healthy": {"dead_group_ratio": 0.237, "all_correct_group_ratio": 0.135,
                "all_wrong_group_ratio": 0.102, "mean_logprob": -0.624, "truncation_rate": 0.0},
}


def gym_diagnosis(name: str, **changes: float) -> dict:
    metrics = {**GYM_DIAGNOSES[name], **changes}
    return {"metrics": {k: {"value": v, "layer": "signal", "trend": None}
                        for k, v in metrics.items()},
            "alerts": [{"name": "dead_groups"}] if metrics["dead_group_ratio"] > 0.5 else []}


def arith_recipe(**grpo_or_warm: float) -> dict:
    """The arith example's resolved recipe with `temperature` or `stop_at_accuracy` set."""
    recipe = deep_merge(BASE_RECIPE, yaml.safe_load(
        (EXAMPLES_DIR / "arith.yaml").read_text())["recipe"])
    if "temperature" in grpo_or_warm:
        recipe["grpo"]["temperature"] = grpo_or_warm["temperature"]
    if "stop_at_accuracy" in grpo_or_warm:
        recipe["model"]["warm_start"]["stop_at_accuracy"] = grpo_or_warm["stop_at_accuracy"]
    return recipe


def fired(diagnosis: dict, recipe: dict | None) -> dict[str, Match]:
    return {m.skill.name: m for m in match(load_library(), diagnosis, domain="arith",
                                           recipe=recipe)}


def test_a_sampler_too_cold_fires_temperature_raise_through_its_recipe():
    cold = fired(gym_diagnosis("cold"), arith_recipe(temperature=0.2))["temperature-raise"]
    # Mean log-prob -0.147 is under the over-confidence line: the recipe names the cause.
    assert cold.names_cause
    assert cold.values["recipe.grpo.temperature"] == 0.2 and "recipe" not in cold.values
    # The same dead groups at the usual temperature, or with no recipe known, are not a
    # cold sampler; a healthy run at 0.2 (groups alive) is not one either.
    assert "temperature-raise" not in fired(gym_diagnosis("cold"), arith_recipe())
    assert "temperature-raise" not in fired(gym_diagnosis("cold"), None)
    assert "temperature-raise" not in fired(gym_diagnosis("healthy"),
                                            arith_recipe(temperature=0.2))
    # Over-confidence still fires it without any recipe, and then it names no cause.
    confident = fired(gym_diagnosis("healthy", mean_logprob=-0.05), None)["temperature-raise"]
    assert not confident.names_cause


def test_all_wrong_groups_after_a_warm_start_stopped_early_fire_a_longer_warm_start():
    short = arith_recipe(stop_at_accuracy=0.04)
    found = fired(gym_diagnosis("too_hard"), short)
    warm = found["longer-warm-start"]
    assert warm.names_cause and warm.values["recipe.model.warm_start.stop_at_accuracy"] == 0.04
    # It names the cause, so it ranks before the rewards that answer the dead groups alone.
    assert next(iter(found)) == "longer-warm-start"
    assert {"aux-continuous-reward", "shaped-correctness"} <= set(found)
    assert warm.resolution.overrides == {"model": {"warm_start": {
        "stop_at_accuracy": BASE_RECIPE["model"]["warm_start"]["stop_at_accuracy"]}}}
    # Silent where the warm start already ran to partial accuracy, where there is none or
    # the backend has none, on truncated answers, on a collapse, a cold sampler or health.
    no_warm_start = deep_merge(short, {"model": {"warm_start": {"steps": 0}}})
    on_verl = {**short, "backend": "verl"}
    for diagnosis, recipe in (
        (gym_diagnosis("too_hard"), arith_recipe()),
        (gym_diagnosis("too_hard"), no_warm_start),
        (gym_diagnosis("too_hard"), on_verl),
        (gym_diagnosis("too_hard"), None),
        (gym_diagnosis("too_hard", truncation_rate=0.8), short),
        (gym_diagnosis("lr_collapse"), arith_recipe()),
        (gym_diagnosis("cold"), short),
        (gym_diagnosis("healthy"), short),
    ):
        assert "longer-warm-start" not in fired(diagnosis, recipe)


def test_the_planner_reads_the_recipe_of_the_version_it_diagnoses(workspace, tmp_path):
    """A cold child (temperature 0.2, dead groups) gets the temperature raise, its rationale
    naming the setting; a child at the frontier's own temperature with the same dead groups
    does not."""
    new_version(workspace, "v1", "v0", rationale="cold",
                settings=["grpo.temperature=0.2", *standin_settings(standin_skill=0.95)])
    approve(workspace, "v1", by="tester")
    converge(workspace)
    assert View.load(workspace).frontier() == "v1"
    [raise_] = propose(workspace, "rules", 1).proposals
    assert raise_.skills == ["temperature-raise"] and raise_.parent == "v1"
    assert "recipe.grpo.temperature=0.2" in raise_.rationale
    assert workspace.resolved_recipe(raise_.name)["grpo"]["temperature"] == 1.2

    usual = Workspace(init_workspace(tmp_path / "usual", "arith"))
    train(usual, "v1", standin_skill=0.95)
    converge(usual)
    assert all(p.skills != ["temperature-raise"]
               for p in RulesPlanner().propose(View.load(usual), 6).proposals)


def test_a_warm_start_stopped_early_is_proposed_before_a_finer_reward(workspace):
    """The gym's too_hard setup: the project's warm start stops at 4% accuracy and the trained
    child's groups are almost all wrong."""
    text = (workspace.root / PROJECT_FILE).read_text().replace(
        "recipe:\n", "recipe:\n  model:\n    warm_start: {stop_at_accuracy: 0.04}\n", 1)
    workspace.git.commit_files("main", {PROJECT_FILE: text.encode()}, "short warm start",
                               {"Action": "init"})
    approve(workspace, "v0", by="tester")
    train(workspace, "v1", standin_skill=0.0)
    converge(workspace)
    first = propose(workspace, "rules", 3).proposals[0]
    assert first.skills == ["longer-warm-start"] and first.parent == "v0"
    assert "recipe.model.warm_start.stop_at_accuracy=0.04" in first.rationale
    assert workspace.resolved_recipe(first.name)["model"]["warm_start"][
        "stop_at_accuracy"] == 0.35
