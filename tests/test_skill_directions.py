"""Skills move a recipe the way they say.

A skill's patch is relative to the recipe it changes: every shipped skill, applied to every
example recipe (resolved as `init` resolves it) and to paper-scale recipes (20,480 response
tokens, 100 turns), moves each value in the direction it declares for that key, within its
floor and ceiling; a skill named raise-* only raises. A skill that would change nothing is not
proposed and says why; the version spec records concrete values, never operations.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from standin import converge
from standin import propose as train

from evotrainer.agent.planners.base import View
from evotrainer.agent.planners.rules import RulesPlanner
from evotrainer.agent.propose import propose
from evotrainer.control.scaffold import EXAMPLES_DIR
from evotrainer.control.versions import new_version
from evotrainer.errors import EvoError
from evotrainer.skills.skill import (
    is_operation,
    load_library,
    load_skill,
    match,
    operations,
    resolve_skill,
    skill_overrides,
)
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.recipe import BASE_RECIPE, deep_merge, resolve
from evotrainer.store.workspace import PROJECT_FILE, Workspace

LIBRARY = load_library()
EXAMPLES = {path.stem: resolve(yaml.safe_load(path.read_text())["recipe"], [])
            for path in sorted(EXAMPLES_DIR.glob("*.yaml"))}
# The scale the paper's SWE runs train at: 20,480 response tokens, 100 turns, lr 1e-6,
# a symmetric clip, no KL, batch-wide whitening (its early versions), thousands of items.
PAPER_SWE = deep_merge(BASE_RECIPE, {
    "backend": "verl",
    "model": {"path": "/models/qwen3-8b", "warm_start": {"steps": 0}},
    "domain": {"name": "swe", "train_size": 8622, "val_size": 500},
    "environment": {"max_turns": 100},
    "grpo": {"max_response_tokens": 20480, "lr": 1.0e-6, "clip_low": 0.2, "clip_high": 0.2,
             "temperature": 1.0, "group_size": 8, "steps": 200, "normalize_std": False},
    "reward": {"components": [{"name": "correctness", "weight": 1.0}]},
})
RECIPES = {**EXAMPLES, "paper-swe": PAPER_SWE,
           # The autonomy gym's too_hard setup: a warm start stopped at 4% accuracy.
           "arith-short-warm-start": deep_merge(EXAMPLES["arith"], {
               "model": {"warm_start": {"stop_at_accuracy": 0.04}}}),
           "paper-math": deep_merge(PAPER_SWE, {"domain": {"name": "math"},
                                                "environment": None}),
           "paper-toolenv": deep_merge(PAPER_SWE, {"domain": {"name": "toolenv"}}),
           # The autonomy gym's idle setup: its reward weights an efficiency term.
           "toolenv-efficiency-reward": deep_merge(EXAMPLES["toolenv"], {"reward": {
               "components": [{"name": "partial", "weight": 0.5},
                              {"name": "efficiency", "weight": 0.5}]}})}


def _has_operation(value: Any) -> bool:
    if is_operation(value):
        return True
    if isinstance(value, dict):
        return any(_has_operation(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_operation(v) for v in value)
    return False


def test_the_examples_and_the_paper_scale_recipes_are_all_here():
    assert {"arith", "toolenv", "swe", "humaneval-smollm2"} <= set(EXAMPLES)
    assert PAPER_SWE["grpo"]["max_response_tokens"] == 20480
    assert PAPER_SWE["environment"]["max_turns"] == 100


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_every_change_goes_in_the_direction_its_skill_declares(name: str, recipe_name: str):
    skill, recipe = LIBRARY[name], RECIPES[recipe_name]
    declared = operations(skill, recipe["domain"]["name"])
    resolution = resolve_skill(skill, recipe)
    for change in resolution.changes:
        op = declared[change.key]
        where = (name, recipe_name, str(change))
        if "set" in op:
            assert change.direction == "set" and change.after == op["set"], where
            continue
        assert change.direction == op["direction"], where
        after = change.after
        assert isinstance(after, (int, float)) and math.isfinite(after), where
        if op["direction"] == "raise":
            assert change.before is None or after > change.before, where
            assert after <= op.get("max", math.inf), where
            assert after >= op.get("min", -math.inf), where
        else:
            assert after < change.before, where
            assert after >= op.get("min", -math.inf), where
        # A whole number stays whole (turns, token budgets, train sizes).
        if isinstance(change.before, int) and after == round(after):
            assert isinstance(after, int), where
    # What a version records: concrete values, only the keys that move.
    assert not _has_operation(resolution.overrides), (name, recipe_name)
    assert bool(resolution.overrides) == bool(resolution.changes)
    if not resolution.changes and skill.recipe_patch:
        assert resolution.reason and resolution.reason != "the patch is empty"
    # Re-applying the result moves nothing the first application already moved past.
    after = deep_merge(recipe, resolution.overrides)
    for change in resolve_skill(skill, after).changes:
        assert declared[change.key].get("direction") in ("raise", "lower"), (name, change)


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_a_skill_named_for_a_direction_declares_only_that_direction(name: str):
    skill = LIBRARY[name]
    expected = {"raise": "raise", "down": "lower", "max-turns-cap": "lower"}
    wanted = [d for word, d in expected.items() if word in name.split("-") or word == name]
    domains = [None, *(skill.data["mechanism"].get("domain_patches") or {})]
    directions = {op.get("direction", "set") for d in domains
                  for op in operations(skill, d).values()}
    if wanted:
        assert directions == set(wanted), (name, directions)


@pytest.mark.parametrize("name", sorted(n for n, s in LIBRARY.items()
                                        if not s.negative and s.recipe_patch))
def test_every_positive_skill_moves_some_recipe(name: str):
    """A floor or ceiling that leaves every recipe alone would make the skill dead. A skill
    that binds a reward component at trigger time is bound to each weighted one in turn."""
    skill = LIBRARY[name]
    if not skill.bind:
        assert any(resolve_skill(skill, r).changes for r in RECIPES.values()), name
        return
    assert set(skill.bind) == {"component"}, skill.bind
    assert any(resolve_skill(skill.bound({"component": c["name"]}), r).changes
               for r in RECIPES.values() for c in r["reward"]["components"]
               if c.get("weight", 1.0) > 0), name


def test_the_length_budget_is_raised_not_cut_1280_times():
    skill = LIBRARY["raise-length-budget"]
    # The issue's case: 20,480 tokens with 18% truncation; the old patch set 16.
    tokens = resolve_skill(skill, PAPER_SWE).overrides["grpo"]["max_response_tokens"]
    assert tokens == 32768
    assert resolve_skill(skill, EXAMPLES["arith"]).overrides == {
        "grpo": {"max_response_tokens": 16}}
    assert resolve_skill(skill, EXAMPLES["swe"]).overrides == {
        "grpo": {"max_response_tokens": 256}}
    at_ceiling = deep_merge(PAPER_SWE, {"grpo": {"max_response_tokens": 32768}})
    resolution = resolve_skill(skill, at_ceiling)
    assert resolution.changes == ()
    assert resolution.reason == \
        "grpo.max_response_tokens is 32768, at or past the skill's ceiling 32768"


def test_swe_turns_are_never_capped_under_its_real_episodes():
    skill = LIBRARY["max-turns-cap"]
    # swe episodes run 36-76 turns: 100 becomes 80, never the old 6.
    assert resolve_skill(skill, PAPER_SWE).overrides == {"environment": {"max_turns": 80}}
    # The swe example's 3 turns are already under the floor: no change, and why.
    resolution = resolve_skill(skill, EXAMPLES["swe"])
    assert resolution.changes == ()
    assert "environment.max_turns is 3" in resolution.reason and "floor 80" in resolution.reason
    # toolenv keeps its own cap: 8 becomes 6 (a binary search's worth), 100 becomes 75.
    assert resolve_skill(skill, EXAMPLES["toolenv"]).overrides == {
        "environment": {"max_turns": 6}}
    assert resolve_skill(skill, RECIPES["paper-toolenv"]).overrides == {
        "environment": {"max_turns": 75}}


def test_a_raise_never_lowers_and_a_lower_never_raises():
    hot = deep_merge(EXAMPLES["arith"], {"grpo": {"temperature": 1.4, "kl_coef": 0.05,
                                                  "lr": 1.0e-5}})
    # temperature-raise: +0.2 within [1.2, 1.5]; from 1.4 the ceiling stops it at 1.5.
    assert resolve_skill(LIBRARY["temperature-raise"], hot).overrides == {
        "grpo": {"temperature": 1.5}}
    # kl-cap installs at least 0.002: a larger coefficient stays; only the estimator moves.
    kl = resolve_skill(LIBRARY["kl-cap"], deep_merge(hot, {"grpo": {"kl_estimator": "k1"}}))
    assert kl.overrides == {"grpo": {"kl_estimator": "k3"}}
    assert "grpo.kl_coef is 0.05, already at least 0.002" in kl.reason
    # lr-down lowers 1e-5 to 1e-6: it never lifts a small learning rate to its ceiling 1e-4.
    assert resolve_skill(LIBRARY["lr-down-on-collapse"], hot).overrides == {
        "grpo": {"lr": 1.0e-6}}
    # An integer weight halved within a floor of 0.5 is 0.5, not rounded to 0.
    whole = deep_merge(EXAMPLES["arith"], {"reward": {"components": [
        {"name": "correctness", "weight": 2}]}})
    shaped = resolve_skill(LIBRARY["shaped-correctness"], whole).overrides
    assert shaped["reward"]["components"][0] == {"name": "correctness", "weight": 1}
    one = deep_merge(EXAMPLES["arith"], {"reward": {"components": [
        {"name": "correctness", "weight": 1}]}})
    shaped = resolve_skill(LIBRARY["shaped-correctness"], one).overrides
    assert shaped["reward"]["components"][0] == {"name": "correctness", "weight": 0.5}


def _skill_file(tmp_path: Path, patch: Any) -> Path:
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "evotrainer/v1", "kind": "Skill", "name": "custom",
        "category": "stability", "trigger": "reward_spread < 0.1",
        "mechanism": {"recipe_patch": patch}}))
    return path


@pytest.mark.parametrize(("patch", "message"), [
    # A bare number is an absolute value written blind: the bug this issue is about.
    ({"grpo": {"max_response_tokens": 16}}, "a number is never written as is"),
    ({"reward": {"components": [{"name": "partial", "weight": 0.1}]}},
     "a number is never written as is"),
    # A raise that scales down, a lower that steps up.
    ({"grpo": {"lr": {"direction": "raise", "multiply": 0.5, "max": 1.0}}},
     "less than or equal to the minimum of 1"),
    ({"grpo": {"lr": {"direction": "lower", "add": 0.1, "min": 0.0}}},
     "greater than or equal to the maximum of 0"),
    # A step needs its bound: a raise its ceiling, a lower its floor.
    ({"grpo": {"max_response_tokens": {"direction": "raise", "multiply": 2}}},
     "missing required field 'max'.*its ceiling"),
    ({"grpo": {"lr": {"direction": "lower", "multiply": 0.5}}},
     "missing required field 'min'.*its floor"),
    # A raise without a step names the value it raises to.
    ({"grpo": {"kl_coef": {"direction": "raise", "max": 0.1}}},
     "missing required field 'min'.*the value it raises to"),
    ({"grpo": {"lr": {"direction": "sideways", "min": 0.1}}},
     "expected one of 'raise', 'lower'"),
    ({"grpo": {"lr": {"direction": "raise", "multiply": 2, "add": 1, "max": 3}}},
     "should not be valid"),
    ({"grpo": {"temperature": {"set": 1.2}}}, "got number 1.2"),  # numbers are never `set`
    ({"grpo": {"lr": {"direction": "raise", "multiply": 2, "max": 1e-3, "rate": 2}}},
     "unknown key 'rate'"),
])
def test_the_schema_rejects_operations_that_cannot_say_their_direction(tmp_path, patch,
                                                                          message):
    with pytest.raises(EvoError, match=message) as err:
        load_skill(_skill_file(tmp_path, patch))
    assert "custom.yaml" in str(err.value)


def test_a_floor_above_the_ceiling_is_refused_by_name(tmp_path):
    patch = {"grpo": {"max_response_tokens": {"direction": "raise", "multiply": 2,
                                              "min": 64, "max": 32}}}
    with pytest.raises(EvoError, match="min 64 is above max 32") as err:
        load_skill(_skill_file(tmp_path, patch))
    assert err.value.field == "mechanism.recipe_patch.grpo.max_response_tokens"


def test_an_operation_on_a_value_that_is_not_a_number_names_the_key(tmp_path):
    skill = load_skill(_skill_file(tmp_path, {"grpo": {"loss_agg": {
        "direction": "raise", "min": 1.0}}}))
    with pytest.raises(EvoError, match="grpo.loss_agg") as err:
        resolve_skill(skill, BASE_RECIPE)
    assert "token-mean" in str(err.value) and "set" in (err.value.hint or "")


def test_a_skill_that_changes_nothing_is_refused_with_the_reason():
    path = builtin_dir("skills") / "raise-length-budget.yaml"
    at_ceiling = deep_merge(PAPER_SWE, {"grpo": {"max_response_tokens": 32768}})
    with pytest.raises(EvoError, match="changes nothing on the parent's recipe: "
                       "grpo.max_response_tokens is 32768") as err:
        skill_overrides([path], at_ceiling)
    assert err.value.field == "--skill"
    # Skills compose in order: each one resolves against the recipe the previous left.
    both = skill_overrides([builtin_dir("skills") / "temperature-raise.yaml"] * 2,
                           EXAMPLES["arith"])
    assert both == {"grpo": {"temperature": 1.4}}


def test_match_marks_a_skill_at_its_bound_as_a_no_op_with_the_reason():
    truncated = {"metrics": {"truncation_rate": {"value": 0.18, "layer": "signal",
                                                 "trend": None}}, "alerts": []}
    at_ceiling = deep_merge(EXAMPLES["arith"], {"grpo": {"max_response_tokens": 32768}})
    [found] = [m for m in match(LIBRARY, truncated, domain="arith", recipe=at_ceiling)
               if m.skill.name == "raise-length-budget"]
    assert found.applied and "ceiling 32768" in found.no_change
    assert found.as_dict()["changes"] == []
    [moves] = [m for m in match(LIBRARY, truncated, domain="arith", recipe=EXAMPLES["arith"])
               if m.skill.name == "raise-length-budget"]
    assert not moves.applied and moves.no_change is None
    assert moves.as_dict()["changes"] == [{"key": "grpo.max_response_tokens", "before": 8,
                                           "after": 16, "direction": "raise"}]


# ------------------------------------------------------------- through versions and planners


@pytest.mark.usefixtures("standin")
def test_a_version_records_the_budget_raised_from_its_parent(tmp_path):
    """`version new --skill raise-length-budget` on a 20,480-token project: the spec says
    32768, concretely (the old absolute patch wrote 16)."""
    ws = Workspace(_project(tmp_path, {"grpo": {"max_response_tokens": 20480}}))
    spec = new_version(ws, "v1", "v0", rationale="truncated", skills=["raise-length-budget"])
    assert spec["recipe"] == {"grpo": {"max_response_tokens": 32768}}
    assert ws.resolved_recipe("v1")["grpo"]["max_response_tokens"] == 32768
    text = ws.git.read("evo/v1", "spec/versions/v1.yaml").decode()
    assert "max_response_tokens: 32768" in text and "multiply" not in text
    # From v1 the budget is at the ceiling: a second raise is refused, saying why.
    with pytest.raises(EvoError, match="at or past the skill's ceiling 32768"):
        new_version(ws, "v2", "v1", rationale="again", skills=["raise-length-budget"])
    assert "v2" not in ws.versions()


@pytest.mark.usefixtures("standin")
def test_the_rules_planner_skips_a_skill_at_its_bound_and_says_why(tmp_path):
    """Dead groups fire the filters and aux-continuous-reward; the project already weighs
    `partial` at 0.5, above aux's floor 0.1, so aux would change nothing and is skipped."""
    ws = Workspace(_project(tmp_path, {"reward": {"components": [
        {"name": "correctness", "weight": 1.0}, {"name": "partial", "weight": 0.5}]}}))
    train(ws, "v1", standin_skill=0.95)
    converge(ws)
    result = RulesPlanner().propose(View.load(ws), 3)
    assert "aux-continuous-reward" not in [s for p in result.proposals for s in p.skills]
    assert ("skipped aux-continuous-reward: it changes nothing on v1's recipe "
            "(reward.components[partial].weight is 0.5, already at least 0.1)") in result.notes
    written = propose(ws, "rules", 1).proposals[0]
    spec = ws.version(written.name).spec
    # The spec records what the skill sets on v1's recipe, and the rationale says it.
    assert not _has_operation(spec["recipe"])
    assert spec["proposal"]["changes"]
    assert "On v1's recipe it sets " in spec["intervention"]["rationale"]


def _project(tmp_path: Path, recipe: dict) -> Path:
    """An arith workspace whose project recipe has `recipe` merged in, v0 approved."""
    from evotrainer.control.scaffold import init_workspace
    from evotrainer.control.versions import approve

    root = init_workspace(tmp_path / "ws", "arith")
    ws = Workspace(root)
    project = yaml.safe_load((root / PROJECT_FILE).read_text())
    project["recipe"] = deep_merge(project["recipe"], recipe)
    ws.git.commit_files("main", {PROJECT_FILE: yaml.safe_dump(project).encode()},
                        "project recipe", {"Action": "init"})
    approve(Workspace(root), "v0", by="tester")
    return root
