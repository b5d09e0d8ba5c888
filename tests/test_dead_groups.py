"""One dead-group definition: the engine's logged `dead_group_ratio` (what TensorBoard and
steps.parquet show), the harness's (h0 over the same rollouts) and the replay backtests'
agree group for group, including groups whose rewards differ by less than 1e-3."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from evotrainer.contract.filters import make_filter
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.engine import run_job
from evotrainer.evidence.groups import DEAD_GROUP_STD, dead_group_ratio, dead_groups
from evotrainer.evidence.io import read_rollouts, read_steps
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.skills.replay import backtest_filter, backtest_reward
from evotrainer.store.recipe import resolve

torch.set_num_threads(1)


def _groups_table(stds_wanted: list[float]) -> tuple[pa.Table, np.ndarray]:
    """Train groups of four rewards around 0.5 whose population std is each of `stds_wanted`."""
    rows, rewards = [], []
    for g, sd in enumerate(stds_wanted):
        values = 0.5 + sd * np.array([1.0, -1.0, 1.0, -1.0])  # population std exactly sd
        rewards.append(values)
        rows += [
            dict(step=1 + g % 2, group_id=f"g{g}", sample_idx=i, reward=float(v), correct=0.0)
            for i, v in enumerate(values)
        ]
    return rollout_table(rows), np.array(rewards)


# Below, between and above the old engine rule (1e-8) and the method's (1e-3).
STDS = [0.0, 1e-9, 1e-6, 5e-4, 2e-3, 0.3, 0.0, 5e-4]


def test_the_harness_and_the_engine_rule_count_the_same_groups():
    table, rewards = _groups_table(STDS)
    want = [sd < 1e-3 for sd in STDS]
    np.testing.assert_array_equal(dead_groups(rewards.std(axis=1)), want)
    d = diagnose(table, None, resolve_harness("h0"))
    assert d["metrics"]["dead_group_ratio"] == pytest.approx(np.mean(want))
    assert d["metrics"]["dead_group_ratio"] == pytest.approx(dead_group_ratio(rewards))
    by_step = {s: dead_group_ratio(rewards[s - 1 :: 2]) for s in (1, 2)}
    assert d["series"]["dead_group_ratio"] == [[s, pytest.approx(v)] for s, v in by_step.items()]
    # The examples of the dead_groups alert are the dead groups' rollouts.
    (alert,) = [a for a in d["alerts"] if a["name"] == "dead_groups"]
    dead_ids = {f"g{g}" for g, sd in enumerate(STDS) if sd < DEAD_GROUP_STD}
    assert {e.split("/")[4] for e in alert["examples"]} <= dead_ids


def test_replay_counts_the_same_dead_groups():
    table, rewards = _groups_table(STDS)
    ratio = dead_group_ratio(rewards)
    assert backtest_filter(table, "none")["dead_group_ratio_before"] == pytest.approx(ratio)
    table = table.set_column(
        table.schema.get_field_index("reward_components"),
        "reward_components",
        pa.array([[("bonus", 0.0)]] * table.num_rows, table.schema.field("reward_components").type),
    )
    report = backtest_reward(table, "bonus", 1.0)
    assert report["dead_group_ratio_before"] == pytest.approx(ratio)
    assert report["dead_group_ratio_after"] == pytest.approx(ratio)


def test_the_zero_std_filter_is_another_rule_named_apart():
    # Numeric zero (advantages exactly 0) is what the zero-std filter drops; a group whose
    # rewards differ by 5e-4 stays in the loss, though it is counted dead.
    _, rewards = _groups_table(STDS)
    kept = make_filter({"name": "zero_std"}).keep(list(rewards))
    np.testing.assert_array_equal(kept, [sd > 1e-8 for sd in STDS])


@pytest.mark.slow
def test_engine_logged_metric_equals_the_diagnosis_on_the_same_run(tmp_path):
    # A reward with a 1e-4 partial-credit term: groups that all fail but miss by different
    # amounts have a spread far below 1e-3 and above numeric zero, where the two old rules
    # (engine std <= 1e-8, h0 std < 1e-3) disagreed.
    recipe = resolve(
        {
            "model": {
                "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                         "num_heads": 2, "num_kv_heads": 2},
                "warm_start": {"steps": 80, "batch_size": 16},
            },
            "domain": {"train_size": 32, "val_size": 4},
            "grpo": {"group_size": 4, "prompts_per_step": 8, "steps": 2, "eval_every": 2,
                     "eval_k": 1, "lr": 1.0e-3},
            "reward": {"components": [{"name": "correctness", "weight": 1.0},
                                      {"name": "partial", "weight": 1.0e-4}]},
        },
        [],
    )
    out = tmp_path / "run"
    run_job(recipe, out, "v0", cache_dir=tmp_path / "cache")
    rollouts = read_rollouts(out / "rollouts" / "train.parquet")
    rewards = np.array(rollouts["reward"].to_pylist()).reshape(-1, 4)
    stds = rewards.std(axis=1)
    assert ((stds > 1e-8) & (stds < DEAD_GROUP_STD)).any(), "no group between the old rules"
    steps = read_steps(out / "steps.parquet").to_pylist()
    logged = {r["step"]: r["value"] for r in steps if r["metric"] == "dead_group_ratio"}
    d = diagnose(rollouts, None, resolve_harness("h0"))
    assert {s: pytest.approx(v) for s, v in d["series"]["dead_group_ratio"]} == logged
