"""The engine with what other layers add to a step: an LLM judge (its serve: server started
for the run, every rollout carrying the judge's component, result.json recording the judge's
identity and what it did) and the Dual-Level filter (idle rollouts out before the group test)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from real_checkpoint import save_hf

from evotrainer.engine.grpo import run_job
from evotrainer.store.recipe import BASE_RECIPE


@pytest.mark.slow
def test_a_run_scores_with_a_served_judge_and_records_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    save_hf(tmp_path / "judge-llama")
    recipe = copy.deepcopy(BASE_RECIPE)
    recipe["model"]["warm_start"]["steps"] = 5
    recipe["domain"].update(train_size=8, val_size=4)
    recipe["grpo"].update(steps=2, prompts_per_step=2, group_size=4, eval_every=2, eval_k=2)
    recipe["reward"] = {
        "components": [{"name": "correctness", "weight": 1.0},
                       {"name": "judge:if", "weight": 0.1}],
        "judges": [{"name": "if", "serve": {"path": "judge-llama"},
                    "preset": "instruction_following", "max_tokens": 4,
                    "parse": {"kind": "regex", "pattern": "(?P<score>\\d)", "max": 9},
                    "unparsed": 0.5}],
    }
    result = run_job(recipe, tmp_path / "out", "v1", progress=False)
    (record,) = result["judges"]
    assert record["served"]["path"] == "judge-llama"
    assert record["served"]["digest"].startswith("sha256:")
    assert record["template_digest"].startswith("sha256:") and record["endpoint"] is None
    rows = pq.read_table(tmp_path / "out" / "rollouts" / "train.parquet").to_pylist()
    assert len(rows) == 16
    for row in rows:
        components = dict(row["reward_components"])
        assert 0 <= components["judge:if"] <= 1
        assert row["reward"] == pytest.approx(components["correctness"]
                                              + 0.1 * components["judge:if"])
    # Every training and validation episode was judged: 2 steps × 8, 3 evaluations × 8.
    assert record["verdicts"] == 40 and record["requests"] <= 40
    assert json.loads((tmp_path / "out" / "result.json").read_text())["judges"] == [record]


@pytest.mark.slow
def test_a_dual_level_run_takes_idle_rollouts_out_of_their_groups(tmp_path: Path) -> None:
    """On toolenv with a warm start too short to act, level 1
    excludes the idle and abandoned rollouts (recorded as not kept, their step's
    excluded_ratio logged) before level 2 tests each group on what is left."""
    recipe = copy.deepcopy(BASE_RECIPE)
    recipe["domain"] = {"name": "toolenv", "params": {}, "train_size": 8, "val_size": 4,
                        "data": {}}
    recipe["environment"] = {"max_turns": 4}
    recipe["model"]["warm_start"]["steps"] = 1
    recipe["grpo"].update(steps=2, prompts_per_step=2, group_size=4, eval_every=2, eval_k=2,
                          max_response_tokens=4)
    recipe["group_filter"] = {"name": "dual_level", "params": {}}
    run_job(recipe, tmp_path / "out", "v1", progress=False)
    rows = pq.read_table(tmp_path / "out" / "rollouts" / "train.parquet").to_pylist()
    idle = [r for r in rows if not r["tool_calls"] and r["correct"] == 0]
    assert idle and not any(json.loads(r["extra"])["used_in_loss"] for r in idle)
    steps = pq.read_table(tmp_path / "out" / "steps.parquet").to_pylist()
    excluded = [r["value"] for r in steps if r["metric"] == "excluded_ratio"]
    assert len(excluded) == 2 and max(excluded) > 0
