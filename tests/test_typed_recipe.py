"""The resolved recipe as one typed object: built after the schema, frozen, giving
back exactly its dict; bounds stated once, in the schema; params checked against the schema
fragment their domain, component or filter declares; bad specs refused by `validate` in one
line naming the file, the field and the fix."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, ClassVar

import pytest
import yaml
from referencing import Resource

from evotrainer.contract import filters, typed
from evotrainer.contract.recipe import check_recipe
from evotrainer.contract.typed import Component, Recipe
from evotrainer.errors import EvoError
from evotrainer.store import specs
from evotrainer.store.git import branch_name
from evotrainer.store.recipe import digest, resolve
from evotrainer.store.workspace import version_spec_path


def refusal(recipe: dict) -> EvoError:
    with pytest.raises(EvoError) as err:
        check_recipe(recipe)
    return err.value


# ----------------------------------------------------------------------- the typed object


def test_the_typed_recipe_holds_the_resolved_values_and_gives_back_its_dict():
    resolved = resolve({"grpo": {"clip_high": 0.3}, "reward": {"components": [
        {"name": "format", "weight": 0.1}, {"name": "partial"}]}}, [])
    recipe = Recipe.from_dict(resolved)
    assert (recipe.grpo.clip_low, recipe.grpo.clip_high, recipe.grpo.group_size) == (0.2, 0.3, 8)
    # A component without a weight weighs 1.0: the one statement of that default.
    assert recipe.reward.components == (Component("correctness", 1.0),
                                        Component("format", 0.1), Component("partial", 1.0))
    assert recipe.seeds == (0,) and recipe.domain.name == "arith"
    assert recipe.model.tiny is not None and recipe.model.tiny.hidden_size == 128
    assert recipe.as_dict() == resolved
    assert digest(recipe.as_dict()) == digest(resolved)


def test_the_typed_recipe_is_frozen_and_shares_nothing_with_its_dict():
    resolved = resolve({"domain": {"params": {"ops": ["+"]}}}, [])
    recipe = Recipe.from_dict(resolved)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.grpo.clip_low = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        recipe.domain.params["ops"] = ["*"]  # type: ignore[index]
    assert recipe.domain.params["ops"] == ("+",)
    before = copy.deepcopy(resolved)
    resolved["grpo"]["lr"] = 9.0
    recipe.as_dict()["grpo"]["lr"] = 7.0
    assert recipe.grpo.lr == 1e-4 and recipe.as_dict() == before


def test_absent_optional_sections_keep_their_meaning():
    """What an absent key meant before the typed recipe, it means now: no warm start when
    model.warm_start is gone, the tiny model not used when model.path names a checkpoint,
    evaluation at the training sampler, one thread, every group kept."""
    recipe = Recipe.from_dict(resolve({"model": {"warm_start": None, "path": "ckpt",
                                                 "tiny": {"hidden_size": None}},
                                       "group_filter": None, "threads": None}, []))
    assert recipe.model.warm_start.steps == 0 and recipe.model.tiny is None
    assert (recipe.grpo.eval_temperature, recipe.grpo.eval_top_p) == (None, None)
    assert recipe.threads == 1 and recipe.group_filter.name == "none"
    assert recipe.model.lora is None and recipe.model.init == "base"


def test_a_required_field_an_override_removed_is_named():
    err = refusal(resolve({}, [{"grpo": {"group_size": None}}]))
    assert err.field == "grpo.group_size" and err.message == "missing from the resolved recipe"
    assert "null" in err.hint
    err = refusal(resolve({"model": {"tiny": None}}, []))
    assert err.field == "model.tiny" and "tiny model" in err.message


@pytest.mark.parametrize(("overrides", "field", "message"), [
    ({"grpo": {"clip_low": 0.3, "clip_high": 0.2}}, "grpo.clip_high",
     "must be >= grpo.clip_low (0.3), got 0.2"),
    ({"grpo": {"prompts_per_step": 64}, "domain": {"train_size": 32}},
     "grpo.prompts_per_step", "exceeds domain.train_size (32)"),
    ({"model": {"tiny": {"num_heads": 3}}}, "model.tiny.hidden_size",
     "must be divisible by num_heads"),
    ({"model": {"path": "m", "package": "smollm2"}}, "model.package",
     "model.path and model.package both name a checkpoint"),
])
def test_cross_field_rules_stay_in_code(overrides, field, message):
    err = refusal(resolve(overrides, []))
    assert (err.field, err.message) == (field, message) and err.hint


# ------------------------------------------------------------------- bounds: the schema's


@pytest.mark.parametrize(("overrides", "field", "message"), [
    ({"grpo": {"group_size": 1}}, "grpo.group_size", "must be an integer >= 2, got 1"),
    ({"grpo": {"clip_low": 0}}, "grpo.clip_low", "must be a number in (0, 1), got 0"),
    ({"grpo": {"kl_estimator": "k2"}}, "grpo.kl_estimator", "must be one of: k1, k3, got 'k2'"),
    ({"seeds": [0, -1]}, "seeds[1]", "must be an integer >= 0, got -1"),
    ({"model": {"warm_start": {"lr": 0}}}, "model.warm_start.lr", "must be a number > 0, got 0"),
    ({"model": {"lora": {"dropout": 1}}}, "model.lora.dropout",
     "must be a number in [0, 1), got 1"),
])
def test_a_bound_is_refused_in_the_schemas_words(overrides, field, message):
    err = refusal(resolve(overrides, []))
    assert (err.field, err.message) == (field, message) and err.hint


def test_group_size_two_is_stated_once_in_the_schema(monkeypatch):
    """The checks hold no copy of the bound: with the schema's minimum lowered to 1, the same
    recipe passes the whole recipe check (the domain and its split included)."""
    one = resolve({"grpo": {"group_size": 1}}, [])
    assert refusal(one).field == "grpo.group_size"
    schema = copy.deepcopy(specs.schema_file("recipe.schema.json"))
    schema["properties"]["grpo"]["properties"]["group_size"]["minimum"] = 1
    schema["$id"] += "?lowered"  # its own address in the registry, beside the real one
    registry = specs.registry().with_resource(schema["$id"], Resource.from_contents(schema))
    monkeypatch.setattr(typed, "_recipe_schema", lambda: schema)
    monkeypatch.setattr(specs, "registry", lambda: registry)
    forget = (typed._validator, typed._section_problem, typed._typed_section)
    for cached in forget:
        cached.cache_clear()
    try:
        check_recipe(one)
        assert Recipe.from_dict(one).grpo.group_size == 1
    finally:
        for cached in forget:
            cached.cache_clear()


# ----------------------------------------------------------------------------- params


def test_reward_component_params_are_checked_against_the_domain():
    """No arith component takes params: before, they were accepted and silently ignored."""
    err = refusal(resolve({"reward": {"components": [
        {"name": "correctness", "params": {"scale": 2}}]}}, []))
    assert err.field == "reward.components[0].params.scale"
    assert err.message == "unknown key 'scale'" and err.hint == "it takes none: remove it"


class CappedFilter(filters.GroupFilter):
    name = "capped"
    defaults: ClassVar[dict[str, Any]] = {"cap": 4}
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"cap": {"type": "integer", "minimum": 1}},
        "additionalProperties": False}


def test_a_group_filter_that_declares_a_params_schema_is_held_to_it(monkeypatch):
    monkeypatch.setitem(filters.FILTERS, "capped", CappedFilter)
    check_recipe(resolve({"group_filter": {"name": "capped", "params": {"cap": 2}}}, []))
    err = refusal(resolve({"group_filter": {"name": "capped", "params": {"cap": 0}}}, []))
    assert err.field == "group_filter.params.cap" and "0" in err.message


# ------------------------------------------------------------------- through `validate`


def _commit_recipe(ws, name: str, recipe: dict) -> None:
    """A spec committed by hand (as a branch author can), past `version new`'s checks."""
    path = version_spec_path(name)
    spec = yaml.safe_load(ws.git.read(branch_name(name), path))
    spec["recipe"] = recipe
    ws.git.commit_files(branch_name(name), {path: yaml.safe_dump(spec).encode()}, "edit", {})


@pytest.mark.parametrize(("recipe", "field", "words"), [
    ({"domain": {"params": {"digits": 9}}}, "recipe.domain.params.digits",
     "must be an integer from 1 to 4, got 9"),
    ({"domain": {"params": {"opz": ["+"]}}}, "recipe.domain.params.opz",
     "unknown key 'opz' Hint: known keys: digits, ops"),
    ({"grpo": {"group_size": None}}, "recipe.grpo.group_size",
     "missing from the resolved recipe"),
    ({"reward": {"components": [{"name": "format", "params": {"w": 1}}]}},
     "recipe.reward.components[1].params.w", "unknown key 'w'"),
])
def test_validate_refuses_a_bad_recipe_in_one_line(workspace, cli, recipe, field, words):
    from evotrainer.control.versions import new_version

    new_version(workspace, "v1", "v0", rationale="r")
    _commit_recipe(workspace, "v1", recipe)
    result = cli("-C", str(workspace.root), "validate")
    assert result.code == 1 and "Traceback" not in result.output
    line = next(line for line in result.output.splitlines() if field in line)
    assert "evo/v1:spec/versions/v1.yaml:" in line and words in line and "Hint:" in line
