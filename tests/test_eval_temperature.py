"""`grpo.eval_temperature` / `grpo.eval_top_p`: validation samples are drawn at a fixed
protocol while training samples at its own temperature; the schema and the recipe checks refuse
bad values; the gate says when a version and its parent were evaluated differently."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from standin import converge, record, standin_settings
from test_engine import tiny_recipe

from evotrainer.contract.recipe import check_recipe, evaluation_sampling
from evotrainer.contract.typed import Recipe
from evotrainer.control.versions import approve, new_version
from evotrainer.engine import run_job
from evotrainer.errors import EvoError
from evotrainer.store.recipe import resolve
from evotrainer.store.specs import load_text
from evotrainer.store.workspace import Workspace

# One evaluation step (0) and the end (1), four samples a task: test_engine's tiny recipe.
ONE_STEP = {"steps": 1, "eval_k": 4}


# ---------------------------------------------------------------------- resolving the protocol


def test_evaluation_falls_back_to_the_training_sampler():
    base = resolve({}, [])["grpo"]
    assert evaluation_sampling(base) == (base["temperature"], base["top_p"])
    cold = resolve({"grpo": {"temperature": 0.2, "top_p": 0.9}}, [])["grpo"]
    assert evaluation_sampling(cold) == (0.2, 0.9)
    fixed = resolve({"grpo": {"temperature": 0.2, "eval_temperature": 1.0}}, [])["grpo"]
    assert evaluation_sampling(fixed) == (1.0, 1.0)
    # A child's null removes an inherited eval_temperature: it evaluates as it trains again.
    reset = resolve({"grpo": {"temperature": 0.2, "eval_temperature": 1.0}},
                    [{"grpo": {"eval_temperature": None, "eval_top_p": 0.5}}])["grpo"]
    assert evaluation_sampling(reset) == (0.2, 0.5)


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("value", [0, -0.5, "warm", True])
def test_recipe_check_refuses_a_bad_eval_temperature(value):
    with pytest.raises(EvoError) as err:
        check_recipe(resolve({"grpo": {"eval_temperature": value}}, []))
    assert err.value.field == "grpo.eval_temperature"
    # One line from the schema: the allowed values, the value given, the field's description.
    assert err.value.message == f"must be a number > 0, got {value!r}"
    assert "above 0; null: grpo.temperature" in err.value.hint


@pytest.mark.parametrize("value", [0, 1.5, "all"])
def test_recipe_check_refuses_a_bad_eval_top_p(value):
    with pytest.raises(EvoError) as err:
        check_recipe(resolve({"grpo": {"eval_top_p": value}}, []))
    assert err.value.field == "grpo.eval_top_p"
    assert err.value.message == f"must be a number in (0, 1], got {value!r}"


def test_recipe_check_accepts_set_and_unset_evaluation_sampling():
    """What the check accepts is what the typed recipe holds: the set values, and None (the
    training sampler) where a null removed them."""
    fixed = resolve({"grpo": {"eval_temperature": 0.7, "eval_top_p": 0.95}}, [])
    check_recipe(fixed)
    typed = Recipe.from_dict(fixed).grpo
    assert (typed.eval_temperature, typed.eval_top_p) == (0.7, 0.95)
    assert evaluation_sampling(fixed["grpo"]) == (0.7, 0.95)
    unset = resolve({"grpo": {"temperature": 0.4, "eval_temperature": None}}, [])
    check_recipe(unset)
    assert "eval_temperature" not in unset["grpo"]  # null removes the key: no fixed protocol
    typed = Recipe.from_dict(unset).grpo
    assert (typed.temperature, typed.eval_temperature, typed.eval_top_p) == (0.4, None, None)
    assert evaluation_sampling(unset["grpo"]) == (0.4, unset["grpo"]["top_p"])


SPEC = """\
apiVersion: evotrainer/v1
kind: PolicyVersion
name: v1
parent: v0
recipe:
  grpo:
    eval_temperature: {value}
"""


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", "less than or equal to the minimum of 0"),
        ("-1.0", "less than or equal to the minimum of 0"),
        ("warm", "got string 'warm'"),
    ],
)
def test_schema_refuses_a_bad_eval_temperature_at_its_position(value, expected):
    with pytest.raises(EvoError) as err:
        load_text(SPEC.format(value=value), "v1.yaml", "PolicyVersion")
    assert err.value.field == "recipe.grpo.eval_temperature"
    assert err.value.where == "v1.yaml:7:23"
    assert expected in err.value.message
    # The field's description says what is allowed: the bound's hint, the type error's text.
    assert "above 0; null: grpo.temperature" in (err.value.hint or err.value.message)


@pytest.mark.parametrize(("value", "loaded"), [("1.0", 1.0), ("0.05", 0.05), ("null", None)])
def test_schema_accepts_a_positive_or_null_eval_temperature(value, loaded):
    doc = load_text(SPEC.format(value=value), "v1.yaml", "PolicyVersion")
    assert doc.data["recipe"] == {"grpo": {"eval_temperature": loaded}}
    assert doc.where(("recipe", "grpo", "eval_temperature")) == "v1.yaml:7:23"


# --------------------------------------------------------------------------- the engine


def groups(rows: list[dict]) -> dict[tuple, list[str]]:
    out: dict[tuple, list[str]] = {}
    for row in rows:
        out.setdefault((row["seed"], row["step"], row["group_id"]), []).append(row["response"])
    return out


@pytest.mark.slow
def test_engine_evaluates_at_eval_temperature_and_trains_at_temperature(tmp_path: Path):
    """Hot training (temperature 5) with near-greedy evaluation (0.01): every val group is
    one answer repeated, while train groups spread. Without eval_temperature the same hot
    sampler spreads the val groups too, so the first run's collapse is the setting's doing."""
    hot = {**ONE_STEP, "temperature": 5.0}
    run_job(tiny_recipe(grpo={**hot, "eval_temperature": 0.01}), tmp_path / "fixed",
            "fixed", cache_dir=tmp_path / "cache")
    train = pq.read_table(tmp_path / "fixed/rollouts/train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "fixed/rollouts/val.parquet").to_pylist()
    assert {r["step"] for r in val} == {0, 1}
    assert all(len(set(responses)) == 1 for responses in groups(val).values())
    assert any(len(set(responses)) > 1 for responses in groups(train).values())
    # Log-probs are under the sampling distribution: near 0 when sampling is near greedy.
    assert all(r["mean_logprob"] > -1e-3 for r in val)
    assert max(r["mean_logprob"] for r in train) < -0.1

    run_job(tiny_recipe(grpo={**hot, "steps": 0}), tmp_path / "default", "default",
            cache_dir=tmp_path / "cache")
    val = pq.read_table(tmp_path / "default/rollouts/val.parquet").to_pylist()
    assert any(len(set(responses)) > 1 for responses in groups(val).values())


# ------------------------------------------------------------------------------ the gate


def test_gate_says_when_a_version_was_evaluated_unlike_its_parent(workspace: Workspace, standin):
    """v1 trains colder and, without eval_temperature, is scored colder too: its decision
    names both protocols. v2 trains as cold but keeps the parent's evaluation: no note."""
    new_version(workspace, "v1", "v0", rationale="colder",
                settings=[*standin_settings(skill=0.65), "grpo.temperature=0.5"])
    new_version(workspace, "v2", "v0", rationale="colder, same evaluation",
                settings=[*standin_settings(skill=0.65), "grpo.temperature=0.5",
                          "grpo.eval_temperature=1.0"])
    for name in ("v1", "v2"):
        approve(workspace, name, by="tester")
    converge(workspace)
    moved = record(workspace, "v1", "decision")
    assert moved["evaluation_protocol"] == {
        "version": {"temperature": 0.5, "top_p": 1.0},
        "parent": {"temperature": 1.0, "top_p": 1.0},
    }
    assert ("evaluated unlike its parent (temperature 0.5, top-p 1.0 against temperature 1.0, "
            "top-p 1.0)") in moved["reason"]
    assert "grpo.eval_temperature" in moved["reason"]
    kept = record(workspace, "v2", "decision")
    assert "evaluation_protocol" not in kept and "unlike its parent" not in kept["reason"]
