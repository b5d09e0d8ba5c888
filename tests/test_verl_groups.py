"""Exact GRPO groups from verl's legacy dumps, whose train rows `trainer.balance_batch` has
reordered before `_log_rollout_data` wrote them (on by default): n consecutive rows are not a
group there.

Real: verl's own golden dumps (tests/golden/verl, rows in the order verl's writer received
them) put in the balanced order verl's `_balance_batch` leaves on one data-parallel rank and
in shuffled orders (several ranks), our reward module, our ingest and filter replay, and the
verl backend end to end on the stand-in's legacy trainer (tests/verl_standin).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from test_verl_backend import make_job, wait_for

from evotrainer.backends import verl_reward
from evotrainer.backends.verl import VerlBackend, write_verl_parquet
from evotrainer.backends.verl_render import JobFiles
from evotrainer.domains import Task, make_domain
from evotrainer.evidence.verl import ingest_dump
from evotrainer.skills.replay import backtest_filter
from evotrainer.store.records import JobState

GOLDEN = Path(__file__).parent / "golden" / "verl"
VERL = json.loads((GOLDEN / "verl_metrics.json").read_text())
N = VERL["train_n"]
TRAIN = GOLDEN / "legacy" / "train" / "1.jsonl"


def balanced(lines: list[dict]) -> list[dict]:
    """verl's `_balance_batch` order on one data-parallel rank: rows sorted by (workload,
    position), then every other row forward and the rest backward. The workload grows with
    the sequence length, here words of prompt and response (the golden tokenizer is
    word-level)."""
    length = [len(f"{r['input']} {r['output']}".split()) for r in lines]
    order = sorted(range(len(lines)), key=lambda i: (length[i], i))
    return [lines[i] for i in order[::2] + order[1::2][::-1]]


def shuffled(seed: int):
    def order(lines: list[dict]) -> list[dict]:
        return random.Random(seed).sample(lines, len(lines))

    return order


ORDERS = {"balanced": balanced, "shuffled-1": shuffled(1), "shuffled-2": shuffled(2)}


def golden_rows(keep=lambda key: True, add=lambda row: {}) -> list[dict]:
    rows = [json.loads(line) for line in TRAIN.open()]
    return [{**{k: v for k, v in r.items() if keep(k)}, **add(r)} for r in rows]


def write_dump(folder: Path, lines: list[dict], step: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def prompts_per_group(table) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for group, prompt in zip(table["group_id"].to_pylist(), table["prompt"].to_pylist(),
                             strict=True):
        out.setdefault(group, set()).add(prompt)
    return out


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_balanced_dump_without_keys_is_grouped_by_prompt_never_by_position(tmp_path, order):
    """The attack on `--group-size N` as it was: cut into n consecutive rows, a balanced
    dump gives groups that mix prompts (samples of different questions compared as one
    group); grouped by prompt, no group does, and the merged duplicate prompts are counted."""
    lines = ORDERS[order](golden_rows(keep=lambda k: k != "task_id"))
    blocks = [{r["input"] for r in lines[i:i + N]} for i in range(0, len(lines), N)]
    assert any(len(b) > 1 for b in blocks)  # the fixture: position is not the group here
    result = ingest_dump(write_dump(tmp_path / order, lines), version="v", split="train",
                         group_size=N)
    train = result.rollouts
    assert all(len(p) == 1 for p in prompts_per_group(train).values())
    # verl's 4 groups, of which rows 1 and 2 share a prompt: 3 here, the merged one counted.
    assert backtest_filter(train, "none")["groups"] == VERL["legacy"]["train"]["groups"] - 1
    assert result.ambiguous == [
        f"1 group(s) of a multiple of n = {N} rows (1 of {2 * N} rows): duplicate prompts in "
        "one step that the dump cannot tell apart, each kept as one group"
    ]


@pytest.mark.parametrize("order", list(ORDERS))
def test_the_dataset_index_our_reward_returns_makes_legacy_groups_exact(tmp_path, order):
    """With each row's dataset index in the dump (our reward module returns it), the groups,
    dead-group ratio and reward mean are verl's own in any order, duplicate prompts apart."""
    def index(row: dict) -> dict:
        return {"index": row["task_id"].removeprefix("t")}  # the golden's rows t0..t3

    lines = ORDERS[order](golden_rows(keep=lambda k: k != "task_id", add=index))
    result = ingest_dump(write_dump(tmp_path / order, lines), version="v", split="train",
                         group_size=N)
    train, theirs = result.rollouts, VERL["legacy"]["train"]
    replay = backtest_filter(train, "none")
    assert replay["groups"] == theirs["groups"]
    assert replay["dead_group_ratio_before"] == pytest.approx(theirs["dead_group_ratio"])
    assert pc.mean(train["reward"]).as_py() == pytest.approx(theirs["reward_mean"])
    assert not result.ambiguous
    assert any("the dataset row" in d for d in result.derived)
    sizes = train.group_by("group_id").aggregate([("sample_idx", "count")])
    assert set(sizes["sample_idx_count"].to_pylist()) == {N}


def test_a_dataset_row_drawn_twice_in_one_step_is_reported_not_hidden(tmp_path):
    lines = golden_rows(add=lambda r: {"index": "0"} if r["task_id"] in ("t0", "t3") else {
        "index": r["task_id"].removeprefix("t")})
    result = ingest_dump(write_dump(tmp_path / "d", balanced(lines)), version="v",
                         split="train", group_size=N)
    assert result.ambiguous and result.ambiguous[0].startswith(
        f"1 group(s) of a multiple of n = {N} rows (1 of {2 * N} rows)")


def test_our_reward_module_carries_the_dataset_row_into_a_legacy_dump(tmp_path):
    """The chain for a run EvoTrainer launches: the verl data rows we write, our reward
    module's returned keys as `_dump_generations` writes them (every extra key of a row),
    rows in balanced order: ingest groups by dataset row, even for two rows with one prompt."""
    domain_config = {"name": "arith", "train_size": 6, "val_size": 2}
    tasks = make_domain(domain_config).split(6, 2)[0]
    twin = Task(task_id=tasks[0].task_id + "-twin", prompt=tasks[0].prompt, answer="99",
                data_source=tasks[0].data_source, meta=tasks[0].meta)
    tasks = [*tasks, twin]  # a dataset with duplicate prompts (and different answers)
    write_verl_parquet(tasks, tmp_path / "train.parquet", split="train")
    config = tmp_path / "reward.json"
    config.write_text(json.dumps(
        {"domain": domain_config, "reward": {"components": [{"name": "correctness"}]}}))
    module = tmp_path / "reward.py"
    shutil.copyfile(verl_reward.__file__, module)  # as prepare() copies it beside the data
    lines = []
    for row in pq.read_table(tmp_path / "train.parquet").to_pylist():
        for sample in range(N):
            text = row["reward_model"]["ground_truth"] if sample % 2 else "wrong"
            extras = verl_reward.compute_score(
                row["data_source"], text, row["reward_model"]["ground_truth"],
                extra_info=dict(row["extra_info"]), config_path=str(config))
            lines.append({"input": row["prompt"][0]["content"], "output": text,
                          "gts": row["reward_model"]["ground_truth"],
                          "score": extras["score"], "step": 1, **extras})
    result = ingest_dump(write_dump(tmp_path / "dump", balanced(lines)), version="v",
                         split="train", group_size=N)
    train = result.rollouts
    assert not result.ambiguous and any("the dataset row" in d for d in result.derived)
    groups = train.group_by("group_id").aggregate([("task_id", "count_distinct"),
                                                   ("task_id", "count")])
    assert groups.num_rows == len(tasks)  # the twin prompts are two groups
    assert set(groups["task_id_count_distinct"].to_pylist()) == {1}
    assert set(groups["task_id_count"].to_pylist()) == {N}


def test_a_legacy_verl_job_is_collected_with_exact_groups(tmp_path, standin_verl):
    """The verl backend end to end with the legacy trainer (`trainer.use_v1=false`, balanced
    train batches): collect groups every step's rows by dataset row."""
    backend = VerlBackend()
    job = make_job(tmp_path, "legacy", overrides={"trainer.use_v1": False})
    backend.submit(job)
    status = wait_for(backend, job, {JobState.SUCCEEDED, JobState.FAILED})
    assert status.state is JobState.SUCCEEDED, backend.logs(job)
    files = JobFiles(job.artifact_dir)
    dumped = [json.loads(line) for line in (files.rollout_dir(0) / "1.jsonl").open()]
    assert "uid" not in dumped[0] and "index" in dumped[0]
    n = job.recipe["grpo"]["group_size"]
    assert any(len({r["input"] for r in dumped[i:i + n]}) > 1 for i in range(0, len(dumped), n))
    collected = backend.collect(job)
    assert collected.result["dump_flavours"] == ["legacy"] and not collected.result["ambiguous"]
    train = pq.read_table(collected.train_rollouts)
    keys = list(zip(train["seed"].to_pylist(), train["step"].to_pylist(),
                    train["group_id"].to_pylist(), strict=True))
    sizes = {k: keys.count(k) for k in set(keys)}
    steps, prompts = job.recipe["grpo"]["steps"], job.recipe["grpo"]["prompts_per_step"]
    assert len(sizes) == len(job.recipe["seeds"]) * steps * prompts
    assert set(sizes.values()) == {n}
    tasks = {}
    for key, task in zip(keys, train["task_id"].to_pylist(), strict=True):
        tasks.setdefault(key, set()).add(task)
    assert all(len(t) == 1 for t in tasks.values())
