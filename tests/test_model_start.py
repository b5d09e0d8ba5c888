"""Which weights a job starts from is one precedence (contract/recipe.py `model_start`): the
parent's recorded policy (`model.init_checkpoint`), else the base model — `model.package`,
else `model.path`, else the tiny model from `model.tiny` — and the engine, the verl render
and the recipe checks all follow it."""

from __future__ import annotations

import pytest

from evotrainer.backends.verl_render import JobFiles, render_run
from evotrainer.contract.model_start import ModelStart, base_model, model_start
from evotrainer.contract.recipe import check_recipe
from evotrainer.engine.model import checkpoint_source, model_digest
from evotrainer.errors import EvoError
from evotrainer.store.recipe import BASE_RECIPE, deep_merge

TINY = BASE_RECIPE["model"]["tiny"]
PARENT = {"path": "/art/v1/policy", "digest": "sha256:" + "0" * 64}


@pytest.mark.parametrize(("model", "start"), [
    ({"tiny": TINY}, ModelStart("tiny", TINY)),
    ({"path": "/m", "tiny": TINY}, ModelStart("path", "/m")),
    ({"package": "smollm2", "tiny": TINY}, ModelStart("package", "smollm2")),
    ({"init_checkpoint": PARENT, "path": "/m", "tiny": TINY}, ModelStart("parent", PARENT)),
    ({"init_checkpoint": PARENT, "package": "smollm2"}, ModelStart("parent", PARENT)),
    ({"init_checkpoint": None, "path": None, "package": None, "tiny": TINY},
     ModelStart("tiny", TINY)),
])
def test_the_precedence(model, start):
    assert model_start(model) == start
    # The base ignores the parent's policy: it is what warm start and the digest key on.
    assert base_model(model) == (model_start({**model, "init_checkpoint": None}))


def test_the_engine_builds_the_tiny_model_when_no_checkpoint_is_named():
    continuing = {"init_checkpoint": PARENT, "tiny": TINY}
    assert base_model(continuing).kind == "tiny" and checkpoint_source(continuing) is None
    assert model_digest(continuing) == {"tiny": TINY}


def test_verl_starts_from_the_parents_policy_over_model_path(tmp_path):
    def actor_path(model: dict) -> str:
        recipe = deep_merge(BASE_RECIPE, {"model": model})
        run = render_run(recipe, version="v2", seed=0, files=JobFiles(tmp_path), workdir=tmp_path)
        return {o.key: o.value for o in run.overrides}["actor_rollout_ref.model.path"]

    assert actor_path({"path": "/m"}) == "/m"
    assert actor_path({"path": "/m", "init_checkpoint": PARENT}) == PARENT["path"]
    with pytest.raises(EvoError) as err:  # the tiny model is no HF checkpoint verl can load
        actor_path({"path": None})
    assert err.value.field == "model.path"


def test_the_tiny_model_is_checked_only_when_it_is_the_base(tmp_path):
    bad_tiny = {**TINY, "num_heads": 3}  # hidden_size not divisible by it
    with pytest.raises(EvoError) as err:
        check_recipe(deep_merge(BASE_RECIPE, {"model": {"tiny": bad_tiny}}))
    assert err.value.field == "model.tiny.hidden_size"
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    check_recipe(deep_merge(BASE_RECIPE, {"model": {"path": str(checkpoint), "tiny": bad_tiny}}))
