"""Synthetic rollout tables: small hand-written ones (tests, examples) and large random ones
(benchmarks)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from evotrainer.evidence.schema import ROLLOUT_SCHEMA

_DEFAULTS: dict[str, Any] = {
    "version": "v0",
    "seed": 0,
    "step": 1,
    "split": "train",
    "task_id": "t0",
    "data_source": "synthetic",
    "group_id": None,
    "sample_idx": 0,
    "prompt": "",
    "response": "",
    "reward": 0.0,
    "reward_components": [],
    "correct": None,
    "response_tokens": None,
    "truncated": None,
    "finish_reason": None,
    "turns": None,
    "tool_calls": None,
    "mean_logprob": None,
    "extra": None,
}


def rollout_table(rows: list[dict[str, Any]]) -> pa.Table:
    """ROLLOUT_SCHEMA rows from partial dicts; `group_id` defaults to the task id, and
    `tool_calls` may be given as "name args" strings."""
    full = []
    for row in rows:
        record = {**_DEFAULTS, **row}
        if record["group_id"] is None:
            record["group_id"] = record["task_id"]
        if record["tool_calls"] is not None:
            record["tool_calls"] = [
                c
                if isinstance(c, dict)
                else dict(zip(("name", "args"), c.partition(" ")[::2], strict=True))
                for c in record["tool_calls"]
            ]
        full.append(record)
    return pa.Table.from_pylist(full, schema=ROLLOUT_SCHEMA)


def random_rollouts(rows: int, *, group_size: int = 8, steps: int = 200, seed: int = 0) -> pa.Table:
    """`rows` random multi-turn train rollouts in groups of `group_size` over `steps` steps."""
    rng = np.random.default_rng(seed)
    index = np.arange(rows)
    groups = index // group_size
    per_step = max(1, rows // steps)
    step = np.minimum(index // per_step, steps - 1) + 1
    difficulty = rng.random(groups.max() + 1)[groups]
    correct = (rng.random(rows) < difficulty).astype(np.float64)
    turns = rng.integers(1, 80, rows)
    tokens = rng.integers(10, 2000, rows)
    n_calls = np.minimum(turns, 6)
    offsets = np.concatenate([[0], np.cumsum(n_calls)])
    tools = pa.array(["bash", "read", "edit", "git", "reveal"])
    names = tools.take(rng.choice(5, offsets[-1], p=[0.4, 0.3, 0.25, 0.04, 0.01]))
    args = pa.array(["log -1", "x.py"]).take(rng.integers(0, 2, offsets[-1]))
    calls = pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.StructArray.from_arrays([names, args], ["name", "args"])
    )
    group_ids = pc.binary_join_element_wise("g", pc.cast(pa.array(groups), pa.string()), "")
    columns = {
        "version": pa.array(np.full(rows, "bench")),
        "seed": pa.array(np.zeros(rows, np.int64)),
        "step": pa.array(step.astype(np.int64)),
        "split": pa.array(np.full(rows, "train")),
        "task_id": group_ids,
        "data_source": pa.array(np.full(rows, "synthetic")),
        "group_id": group_ids,
        "sample_idx": pa.array((index % group_size).astype(np.int64)),
        "prompt": pa.array(np.full(rows, "Solve the task.")),
        "response": pa.array(np.full(rows, "answer")),
        "reward": pa.array(correct + 0.01 * rng.random(rows) * (rng.random(rows) < 0.5)),
        "reward_components": pa.nulls(rows, ROLLOUT_SCHEMA.field("reward_components").type),
        "correct": pa.array(correct),
        "response_tokens": pa.array(tokens.astype(np.int64)),
        "truncated": pa.array(tokens > 1900),
        "finish_reason": pa.array(np.where(tokens > 1900, "length", "stop")),
        "turns": pa.array(turns.astype(np.int64)),
        "tool_calls": calls,
        "mean_logprob": pa.array(-rng.random(rows)),
        "extra": pa.nulls(rows, pa.string()),
    }
    return pa.table(columns).cast(ROLLOUT_SCHEMA)
