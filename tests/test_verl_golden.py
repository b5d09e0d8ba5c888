"""Our verl figures against verl's own, on dumps verl's own writer code wrote.

Real: the dumps and `verl_metrics.json` in tests/golden/verl (written by verl 0.9.1's
`RayPPOTrainer._validate`/`_log_rollout_data` and `PPOTrainer._validate`/`_log_rollout_data`;
see generate.py there), our ingest, score table, filter replay and tokenizer-derived lengths.
The seam tests run verl's own reward manager and GRPO advantage when verl is importable.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from evotrainer.backends.verl import final_scores
from evotrainer.backends.verl_render import JobFiles
from evotrainer.contract.filters import make_filter
from evotrainer.errors import EvoError
from evotrainer.evidence.verl import derive_lengths, ingest_dump
from evotrainer.skills.replay import backtest_filter

GOLDEN = Path(__file__).parent / "golden" / "verl"
VERL = json.loads((GOLDEN / "verl_metrics.json").read_text())
N = VERL["train_n"]
assert VERL["val_n"] == N  # one group size for both splits keeps the tests short


def ingest(flavour: str, split: str, directory: Path | None = None, **kwargs) -> tuple:
    folder = directory or GOLDEN / flavour / ("train" if split == "train" else "val")
    result = ingest_dump(folder, version=flavour, split=split, **kwargs)
    return result, result.rollouts


def avg_at_k(val: pa.Table, tmp_path: Path) -> tuple[float, pa.Table]:
    """Our val avg@k: the mean over tasks of each task's mean correctness in the score table."""
    scores = final_scores(val, JobFiles(tmp_path))
    per_task = scores.group_by("task_id").aggregate([("correct", "mean")])
    return float(np.mean(per_task.column("correct_mean").to_numpy())), scores


def raw_lines(flavour: str, split: str) -> list[dict]:
    folder = GOLDEN / flavour / split
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.open()]


def without_task_ids(flavour: str, split: str, tmp_path: Path) -> Path:
    """The dump as a reward function without our `task_id` extra would have left it."""
    out = tmp_path / f"{flavour}-{split}"
    out.mkdir()
    for path in (GOLDEN / flavour / split).glob("*.jsonl"):
        lines = [json.loads(line) for line in path.open()]
        (out / path.name).write_text(
            "".join(
                json.dumps({k: v for k, v in r.items() if k != "task_id"}) + "\n" for r in lines
            )
        )
    return out


@pytest.mark.parametrize("flavour", ["legacy", "v1"])
def test_val_avg_at_k_and_score_table_match_verl(flavour, tmp_path):
    result, val = ingest(flavour, "val", group_size=N)
    assert result.flavours == [flavour]
    ours, scores = avg_at_k(val, tmp_path)
    theirs = VERL[flavour]["val"]["val-core/openai/gsm8k/acc/mean@4"]
    assert ours == pytest.approx(theirs)
    assert pc.mean(val.column("reward")).as_py() == pytest.approx(
        VERL[flavour]["val"]["val-aux/openai/gsm8k/reward/mean@4"]
    )
    # One row per (task, sample): 4 tasks (two share a prompt) × n samples, no duplicates.
    keys = list(
        zip(
            scores.column("task_id").to_pylist(),
            scores.column("sample_idx").to_pylist(),
            strict=True,
        )
    )
    assert len(keys) == len(set(keys)) == 4 * N
    assert set(scores.column("data_source").to_pylist()) == {"openai/gsm8k"}
    # verl's `reward` key is its copy of the score, not a reward component.
    assert all(not dict(c) for c in val.column("reward_components").to_pylist())


def test_v1_multi_output_sessions_count_only_the_final_output(tmp_path):
    lines = raw_lines("v1", "val")
    # The fixture exercises the rule: counting every line gives another figure than verl's.
    every_line = float(np.mean([line["acc"] for line in lines]))
    assert every_line != pytest.approx(VERL["v1"]["val"]["val-core/openai/gsm8k/acc/mean@4"])
    result, val = ingest("v1", "val")
    assert result.earlier_outputs == len(lines) - val.num_rows == 2
    folded = [json.loads(e) for e in val.column("extra").to_pylist() if "earlier" in e]
    assert [f["earlier_outputs"] for f in folded] == [["draft #### 7"]] * 2
    assert all(f["uid"].endswith("_1") for f in folded)  # the raw key of the final output
    assert any("multi-output" in d for d in result.derived)


@pytest.mark.parametrize("flavour", ["legacy", "v1"])
def test_train_groups_dead_ratio_and_reward_mean_match_verl(flavour):
    _, train = ingest(flavour, "train", group_size=N)
    replay = backtest_filter(train, "none")
    theirs = VERL[flavour]["train"]
    assert replay["groups"] == theirs["groups"]
    assert replay["dead_group_ratio_before"] == pytest.approx(theirs["dead_group_ratio"])
    assert train.num_rows == theirs.get("sessions", theirs["samples"])
    assert pc.mean(train.column("reward")).as_py() == pytest.approx(theirs["reward_mean"])


def test_legacy_train_without_keys_groups_by_prompt_and_reports_merged_duplicates(tmp_path):
    """verl's balance_batch reorders train rows before the dump, so the group size checks
    groups instead of cutting the file into them (tests/test_verl_groups.py shuffles)."""
    dump = without_task_ids("legacy", "train", tmp_path)
    result, train = ingest("legacy", "train", dump, group_size=N)
    assert not any(f"group = {N} consecutive rows" in d for d in result.derived)
    assert any("identical prompt text" in d for d in result.derived)
    # Dataset rows 1 and 2 share their prompt: one group of 2×n rows, reported with its count.
    assert backtest_filter(train, "none")["groups"] == VERL["legacy"]["train"]["groups"] - 1
    assert result.ambiguous == [
        f"1 group(s) of a multiple of n = {N} rows (1 of {2 * N} rows): duplicate prompts in "
        "one step that the dump cannot tell apart, each kept as one group"
    ]
    # Without the group size the same grouping, and ingest says what n would add.
    result, merged = ingest("legacy", "train", dump)
    assert backtest_filter(merged, "none")["groups"] == 3 and not result.ambiguous
    assert any("group size" in m for m in result.missing)


def test_val_without_task_ids_keeps_duplicate_prompts_apart(tmp_path):
    _, val = ingest("legacy", "val", without_task_ids("legacy", "val", tmp_path), group_size=N)
    ours, scores = avg_at_k(val, tmp_path)
    assert ours == pytest.approx(VERL["legacy"]["val"]["val-core/openai/gsm8k/acc/mean@4"])
    assert scores.num_rows == len(
        set(zip(scores["task_id"].to_pylist(), scores["sample_idx"].to_pylist(), strict=True))
    )


def test_a_group_size_that_does_not_divide_the_groups_is_reported(tmp_path):
    dump = without_task_ids("legacy", "val", tmp_path)
    result, _ = ingest("legacy", "val", dump, group_size=3)
    # Blocks of 3 rows mix prompts: not verl's order for n = 3, so prompt text groups them.
    assert any("blocks of 3 consecutive rows mix prompts" in d for d in result.derived)
    assert result.ambiguous == [
        "3 group(s) whose size n = 3 does not divide (2 of 4 rows, 1 of 8 rows): skipped "
        "lines, or n is not this dump's rollout.n / val_kwargs.n"
    ]


def test_lengths_are_null_until_derived_with_the_checkpoint_tokenizer():
    result, train = ingest("legacy", "train", group_size=N)
    assert train.column("response_tokens").null_count == train.num_rows
    assert {"response_tokens", "truncated"} <= set(result.missing)
    derived = derive_lengths(train, GOLDEN / "tokenizer", VERL["response_length"]).to_pylist()
    by_response = {r["response"]: (r["response_tokens"], r["truncated"]) for r in derived}
    # The scripted 9-word answer was cut at the 8-token budget; the others ended early.
    assert by_response["so so so so so so so so"] == (8, True)
    assert by_response["#### 9"] == (2, False)
    assert by_response["the answer #### 4"] == (4, False)


def test_lengths_need_a_local_tokenizer_dir(tmp_path):
    _, train = ingest("legacy", "train", group_size=N)
    with pytest.raises(EvoError, match="no tokenizer here"):
        derive_lengths(train, tmp_path / "absent", 8)


def test_ingest_cli_reports_flavour_derived_and_missing(tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from evotrainer.commands import ingest as ingest_cmd

    app = typer.Typer()
    ingest_cmd.register(app)
    monkeypatch.chdir(tmp_path)
    args = ["ingest", "verl", str(GOLDEN / "v1" / "train"), "--version", "v", "--split", "train"]
    summary = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    assert summary["flavour"] == "v1" and summary["earlier_outputs_folded"] == 2
    assert "data_source" in summary["missing"] and "response_tokens" in summary["missing"]
    tokenized = [*args, "--tokenizer", str(GOLDEN / "tokenizer"), "--response-length", "8"]
    summary = json.loads(CliRunner().invoke(app, [*tokenized, "--json"]).output)
    assert "response_tokens" not in summary["missing"]
    assert any("re-tokenized" in d for d in summary["derived"])
    text = CliRunner().invoke(app, [*tokenized, "--group-size", "4"]).output
    assert "v1 dump" in text and "derived:" in text and "missing:" in text


# ---- the seams verl calls ------------------------------------------------------------------


def test_std_group_filter_keeps_exactly_the_groups_verl_gives_an_advantage():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    torch = pytest.importorskip("torch")
    _, train = ingest("v1", "train")
    groups = train.column("group_id").to_pylist()
    order = list(dict.fromkeys(groups))
    rewards = np.array(train.column("reward").to_pylist())
    spec = {"name": "std_group_filter", "params": {"mode": "absolute", "min_std_threshold": 0.1}}
    keep = make_filter(spec).keep([rewards[[g == k for g in groups]] for k in order])
    kept = {k for k, flag in zip(order, keep, strict=True) if flag}
    # verl's GRPO on the filtered batch: every kept group carries a learning signal ...
    rows = [i for i, g in enumerate(groups) if g in kept]
    scores = torch.tensor(rewards[rows], dtype=torch.float32)[:, None]
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        scores, torch.ones_like(scores), np.array([groups[i] for i in rows], dtype=object)
    )
    per_group = {g: 0.0 for g in kept}
    for i, value in zip(rows, advantages[:, 0].abs().tolist(), strict=True):
        per_group[groups[i]] += value
    assert kept and all(v > 0 for v in per_group.values())
    # ... and every dropped group is one verl would have given no advantage at all.
    all_scores = torch.tensor(rewards, dtype=torch.float32)[:, None]
    full, _ = core_algos.compute_grpo_outcome_advantage(
        all_scores, torch.ones_like(all_scores), np.array(groups, dtype=object)
    )
    dropped = [i for i, g in enumerate(groups) if g not in kept]
    assert dropped and float(full[dropped].abs().sum()) == 0.0


def test_our_reward_module_through_verls_reward_manager(tmp_path):
    pytest.importorskip("verl.experimental.reward_loop.reward_manager.naive")
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    from evotrainer.backends import verl_reward
    from evotrainer.domains import make_domain

    domain_config = {"name": "arith", "train_size": 4, "val_size": 2}
    task = make_domain(domain_config).split(4, 2)[1][0]
    config_path = tmp_path / "reward.json"
    config_path.write_text(
        json.dumps({"domain": domain_config, "reward": {"components": [{"name": "correctness"}]}})
    )
    module = tmp_path / "reward_fn.py"
    shutil.copyfile(verl_reward.__file__, module)
    config = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": str(module),
                    "name": "compute_score",
                    "reward_kwargs": {"config_path": str(config_path)},
                },
                "reward_manager": {"source": "register", "name": "naive"},
            }
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(str(GOLDEN / "tokenizer"), local_files_only=True)
    manager = load_reward_manager(config, tokenizer)
    responses = tokenizer(["#### 4"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    import torch

    item = DataProto.from_dict(
        tensors={"responses": responses, "attention_mask": torch.ones_like(responses)},
        non_tensors={
            "data_source": np.array([task.data_source], dtype=object),
            "reward_model": np.array([{"ground_truth": task.answer}], dtype=object),
            "extra_info": np.array(
                [{"task_id": task.task_id, "question": task.prompt, "meta": json.dumps(task.meta),
                  "index": np.int64(3)}],
                dtype=object,
            ),
        },
    )
    out = manager.loop.run_until_complete(manager.run_single(item))  # verl's own loop
    extra = out["reward_extra_info"]
    # Every key verl will dump for legacy train and all validation rows.
    assert extra["task_id"] == task.task_id and extra["data_source"] == task.data_source
    assert extra["index"] == "3"  # the dataset row: a legacy dump's exact group key
    assert out["reward_score"] == extra["score"] and extra["acc"] in (0.0, 1.0)
