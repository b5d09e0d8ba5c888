"""The embedded GRPO engine: loss and advantage math by hand, recipe checks, and real (tiny)
training runs end to end."""

from __future__ import annotations

import copy
import csv
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import typer
import yaml
from typer.testing import CliRunner

from evotrainer.commands.train import register
from evotrainer.contract.recipe import check_recipe, environment_config
from evotrainer.contract.typed import Recipe
from evotrainer.domains import make_domain
from evotrainer.engine import run_job
from evotrainer.engine.grpo import group_advantages, policy_loss
from evotrainer.engine.outputs import read_progress
from evotrainer.errors import EvoError
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.evidence.steps import STEPS_SCHEMA
from evotrainer.store.recipe import resolve

torch.set_num_threads(1)

TINY = {
    "model": {
        "tiny": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 2,
        },
        "warm_start": {"steps": 10, "batch_size": 16},
    },
    "domain": {"train_size": 32, "val_size": 4},
    "grpo": {
        "group_size": 4,
        "prompts_per_step": 4,
        "steps": 3,
        "eval_every": 2,
        "eval_k": 2,
        "lr": 1.0e-3,
    },
}


def tiny_recipe(**overrides) -> dict:
    return resolve(TINY, [overrides])


# ------------------------------------------------------------------------ algorithm math


def test_group_advantages_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards, normalize_std=True)
    # mean 0.5, unbiased std sqrt(1/3); a constant group gets 0.
    a = 0.5 / math.sqrt(1 / 3)
    assert adv[0] == pytest.approx([a, -a, -a, a], abs=1e-5)
    assert adv[1].tolist() == [0.0] * 4
    assert group_advantages(rewards, normalize_std=False)[0].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_clipped_surrogate_and_kl_by_hand():
    g = replace(Recipe.from_dict(tiny_recipe()).grpo, clip_low=0.2, clip_high=0.27,
                kl_coef=0.0, kl_estimator="k3", loss_agg="token-mean")
    old = torch.zeros(2, 3)
    # ratios: row 0 (A=+1) 1.5, 0.5, 1.0(masked); row 1 (A=-1) 0.5, 1.5, 1.0(masked)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]]))
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # A=+1: min(1.5, 1.27)=1.27 (clipped), min(0.5, 0.8)=0.5 → per-token loss -1.27, -0.5
    # A=-1: min(-0.5, -0.8)=-0.8 (clipped), min(-1.5, -1.27)=-1.5 → per-token loss 0.8, 1.5
    loss, stats = policy_loss(logp, old, None, adv, mask, g)
    assert float(loss) == pytest.approx((-1.27 - 0.5 + 0.8 + 1.5) / 4)
    assert stats["clip_frac"] == pytest.approx(0.5)
    # seq-mean with unequal lengths: row 0 keeps one token, row 1 both.
    short = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    loss, _ = policy_loss(logp, old, None, adv, short, replace(g, loss_agg="seq-mean"))
    assert float(loss) == pytest.approx((-1.27 + (0.8 + 1.5) / 2) / 2)
    # KL to a reference twice as likely: k3 = e^x - x - 1 with x = ln 2; k1 = -ln 2.
    ref = torch.full((2, 3), math.log(2.0))
    zero_adv = torch.zeros(2)
    loss, stats = policy_loss(old, old, ref, zero_adv, mask, replace(g, kl_coef=0.5))
    assert stats["kl"] == pytest.approx(1 - math.log(2.0))
    assert float(loss) == pytest.approx(0.5 * (1 - math.log(2.0)))
    _, stats = policy_loss(
        old, old, ref, zero_adv, mask, replace(g, kl_estimator="k1", kl_coef=0.5)
    )
    assert stats["kl"] == pytest.approx(-math.log(2.0))


# ------------------------------------------------------------------------- recipe checks


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"grpo": {"group_size": 1}}, "grpo.group_size"),
        ({"grpo": {"clip_low": 0.3, "clip_high": 0.2}}, "grpo.clip_high"),
        ({"domain": {"name": "chess"}}, "domain.name"),
        ({"model": {"path": "/nonexistent/checkpoint"}}, "model.path"),
        (
            {"reward": {"components": [{"name": "judge", "weight": 0.1}]}},
            "reward.components[1].name",
        ),
        ({"grpo": {"kl_estimator": "k2"}}, "grpo.kl_estimator"),
        ({"environment": {"max_turns": 4}}, "environment"),
        (
            {"domain": {"name": "toolenv"}, "environment": {"tools": [{"name": "search"}]}},
            "environment.tools[0].name",
        ),
        (
            {"group_filter": {"name": "std_group_filter", "params": {"ema": 0.1}}},
            "group_filter.params.ema",
        ),
        ({"seeds": []}, "seeds"),
    ],
)
def test_bad_recipes_fail_before_compute_naming_the_field(overrides, field):
    with pytest.raises(EvoError) as err:
        check_recipe(resolve(overrides, []))
    assert err.value.field == field
    assert err.value.hint


def test_base_recipe_and_toolenv_recipe_pass():
    """The shipped defaults and toolenv with its leak closed pass the checks, as the engine
    will run them: the base domain is single-turn; toolenv keeps `compare` with `reveal`
    off (the override merges by name). One broken setting in the same recipe is refused."""
    base = resolve({}, [])
    assert check_recipe(base) is None
    assert environment_config(base, make_domain(base["domain"])) is None
    closed = resolve(
        {
            "domain": {"name": "toolenv"},
            "environment": {"tools": [{"name": "reveal", "enabled": False}]},
        },
        [],
    )
    assert check_recipe(closed) is None
    environment = environment_config(closed, make_domain(closed["domain"]))
    assert {t["name"]: t.get("enabled", True) for t in environment["tools"]} == {
        "compare": True,
        "reveal": False,
    }
    broken = copy.deepcopy(closed)
    broken["environment"]["max_turns"] = 0
    with pytest.raises(EvoError) as err:
        check_recipe(broken)
    assert err.value.field == "environment.max_turns"


# ---------------------------------------------------------------------- end to end runs


def read_rows(path: Path) -> list[dict]:
    table = pq.read_table(path)
    return table.to_pylist()


@pytest.mark.slow
def test_arith_run_writes_every_output_in_its_schema(tmp_path):
    out = tmp_path / "run"
    result = run_job(tiny_recipe(seeds=[0, 1]), out, "v1")
    assert result["status"] == "ok" and result["steps_done"] == 2 * 3  # over both seeds
    assert set(result["val_avg_by_seed"]) == {"0", "1"}
    assert json.loads((out / "result.json").read_text()) == result
    for split in ("train", "val"):
        assert pq.read_schema(out / "rollouts" / f"{split}.parquet").equals(ROLLOUT_SCHEMA)
    assert pq.read_schema(out / "steps.parquet").equals(STEPS_SCHEMA)
    train, val = read_rows(out / "rollouts/train.parquet"), read_rows(out / "rollouts/val.parquet")
    assert len(train) == 2 * 3 * 4 * 4  # seeds × steps × prompts × group
    assert {r["step"] for r in val} == {0, 2, 3}  # step 0, eval_every, and the end
    assert len(val) == 2 * 3 * 4 * 2  # seeds × evaluations × val tasks × eval_k
    row = train[0]
    assert row["version"] == "v1" and row["split"] == "train" and row["turns"] == 1
    assert dict(row["reward_components"]).keys() == {"correctness", "format", "partial"}
    assert row["reward"] == dict(row["reward_components"])["correctness"]
    assert {"advantage", "used_in_loss"} <= json.loads(row["extra"]).keys()
    groups = {(r["seed"], r["step"], r["group_id"]) for r in train}
    assert len(groups) == 2 * 3 * 4
    # Task ids pair across seeds and evaluations.
    val_ids = {
        frozenset(r["task_id"] for r in val if (r["seed"], r["step"]) == key)
        for key in [(0, 0), (0, 3), (1, 0), (1, 3)]
    }
    assert len(val_ids) == 1
    metrics = {r["metric"] for r in read_rows(out / "steps.parquet")}
    assert {
        "loss",
        "kl",
        "entropy",
        "clip_frac",
        "reward_mean",
        "dead_group_ratio",
        "kept_group_ratio",
        "time_per_step",
        "tokens_per_s",
        "val_avg",
    } <= metrics
    with (out / "scores.csv").open() as fh:
        scores = list(csv.DictReader(fh))
    assert list(scores[0]) == ["seed", "task_id", "data_source", "sample_idx", "correct"]
    assert len(scores) == 2 * 4 * 2
    assert (out / "checkpoint" / "model.safetensors").is_file()
    assert (out / "checkpoint-seed1" / "config.json").is_file()
    assert "val avg@2" in (out / "train.log").read_text()
    assert (out / "cache").is_dir() and not (tmp_path / "warm_start").exists()  # inside --out
    # The progress record matches the steps trained; its pace holds the steps' wall times
    # (steps.parquet's time_per_step) and not the warm starts before each seed's first step.
    record = json.loads((out / "progress.json").read_text())
    assert {k: record[k] for k in ("seed", "step", "steps_done", "steps_total")} == {
        "seed": 1, "step": 3, "steps_done": 6, "steps_total": 6}
    assert record["evaluation"] == {"seed": 1, "step": 3, "val_avg": result["val_avg_by_seed"]["1"]}
    step_times = {(r["seed"], r["step"]): r["value"] for r in read_rows(out / "steps.parquet")
                  if r["metric"] == "time_per_step"}
    assert len(step_times) == 6 and record["step_s"] == step_times[(1, 3)]
    assert sum(step_times.values()) <= record["stepping_s"] + 1e-6  # rounded to the µs
    assert record["stepping_s"] < result["wall_time_s"]
    progress = read_progress(out)
    assert progress.steps_done == 6
    assert progress.seconds_per_step == pytest.approx(record["stepping_s"] / 6)


@pytest.mark.slow
def test_same_seed_same_run_and_warm_start_cache_is_reused(tmp_path):
    recipe = tiny_recipe(grpo={"steps": 2}, group_filter={"name": "zero_std"})
    first = run_job(recipe, tmp_path / "a", "a", cache_dir=tmp_path / "cache")
    second = run_job(copy.deepcopy(recipe), tmp_path / "b", "b", cache_dir=tmp_path / "cache")
    assert first["warm_start"]["0"]["cached"] is False
    assert second["warm_start"]["0"]["cached"] is True

    def responses(run: str) -> list:
        rows = read_rows(tmp_path / run / "rollouts/train.parquet")
        return [(r["task_id"], r["response"], r["reward"]) for r in rows]

    assert responses("a") == responses("b")
    assert first["val_avg"] == second["val_avg"]


def test_steps_done_counts_every_seed_trained(tmp_path):
    """The budget's unit: a two-seed run trains its recipe's steps twice, and says so (an
    early stop's live record counts over seeds too)."""
    result = run_job(tiny_recipe(grpo={"steps": 2}, seeds=[0, 1]), tmp_path / "v1", "v1")
    assert result["status"] == "ok" and result["steps_done"] == 4


@pytest.mark.slow
def test_steps_zero_only_evaluates(tmp_path):
    result = run_job(tiny_recipe(grpo={"steps": 0}), tmp_path / "v0", "v0")
    assert result["status"] == "ok" and result["steps_done"] == 0
    assert read_rows(tmp_path / "v0/rollouts/train.parquet") == []
    assert {r["step"] for r in read_rows(tmp_path / "v0/rollouts/val.parquet")} == {0}
    assert (tmp_path / "v0/scores.csv").read_text().count("\n") == 1 + 4 * 2


@pytest.mark.slow
def test_toolenv_multi_turn_run_records_turns_tools_and_masks_env_tokens(tmp_path):
    recipe = tiny_recipe(
        domain={"name": "toolenv"},
        model={"warm_start": {"steps": 30, "lr": 3.0e-3}},
        environment={"max_turns": 3, "tools": [{"name": "reveal", "enabled": True}]},
        grpo={"max_response_tokens": 4},
    )
    result = run_job(recipe, tmp_path / "t", "t")
    assert result["status"] == "ok"
    rows = read_rows(tmp_path / "t/rollouts/train.parquet")
    assert all(1 <= r["turns"] <= 3 for r in rows)
    assert {r["finish_reason"] for r in rows} <= {"stop", "length", "tool_limit"}
    assert all(r["truncated"] == (r["finish_reason"] != "stop") for r in rows)
    multi = [r for r in rows if r["turns"] > 1]
    assert multi, "the warm-started policy should take several turns"
    for r in multi:
        extra = json.loads(r["extra"])
        # Observations (e.g. `<;`) are in the transcript but not counted as policy tokens.
        assert extra["env_tokens"] > 0
        # One char per token; sampled special tokens (pad, bos) decode to nothing.
        assert r["response_tokens"] + extra["env_tokens"] >= len(r["response"])
    calls = [c for r in rows for c in r["tool_calls"]]
    assert calls and {c["name"] for c in calls} <= {"compare", "reveal"}


def test_train_command_runs_a_recipe_file_and_reports_bad_ones(tmp_path):
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `train` a subcommand
    good = tmp_path / "recipe.yaml"
    good.write_text(yaml.safe_dump({**TINY, "grpo": {**TINY["grpo"], "steps": 1}}))
    result = CliRunner().invoke(
        app, ["train", str(good), "--out", str(tmp_path / "o"), "--version", "cli"]
    )
    assert result.exit_code == 0, result.output
    assert "cli: ok" in result.output
    assert json.loads((tmp_path / "o/result.json").read_text())["version"] == "cli"
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: {group_size: 1}\n")
    result = CliRunner().invoke(app, ["train", str(bad), "--out", str(tmp_path / "b")])
    assert isinstance(result.exception, EvoError)
    assert result.exception.field == "grpo.group_size"
    assert result.exception.where.startswith(str(bad))  # with the line and column
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_module_entry_point_as_the_local_backend_launches_it(tmp_path):
    recipe_file = tmp_path / "recipe.json"
    recipe_file.write_text(
        json.dumps(tiny_recipe(grpo={"steps": 1}, model={"warm_start": {"steps": 0}}))
    )
    env = {**os.environ, "EVOTRAINER_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "evotrainer.engine", str(recipe_file), str(tmp_path / "job"), "v3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "job/result.json").read_text())["status"] == "ok"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(resolve({"grpo": {"clip_high": 0.1}}, [])))
    done = subprocess.run(
        [sys.executable, "-m", "evotrainer.engine", str(bad), str(tmp_path / "badjob"), "v4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "grpo.clip_high" in done.stderr
    result = json.loads((tmp_path / "badjob/result.json").read_text())
    assert result["status"] == "failed" and "grpo.clip_high" in result["error"]
