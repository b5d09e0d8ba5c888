"""The canonical rollout table: one row per trajectory, the contract between every
producer (embedded engine, verl ingest) and every consumer (harness, backtests, report).
Its columns by name, and what each means, are evidence/columns.py's."""

from __future__ import annotations

import pyarrow as pa

TOOL_CALL = pa.struct([("name", pa.string()), ("args", pa.string())])

ROLLOUT_SCHEMA = pa.schema(
    [
        ("version", pa.string()),
        ("seed", pa.int64()),
        ("step", pa.int64()),
        ("split", pa.string()),  # 'train' | 'val'
        ("task_id", pa.string()),
        ("data_source", pa.string()),
        ("group_id", pa.string()),
        ("sample_idx", pa.int64()),
        ("prompt", pa.string()),
        ("response", pa.string()),
        ("reward", pa.float64()),
        ("reward_components", pa.map_(pa.string(), pa.float64())),
        ("correct", pa.float64()),  # in [0, 1] or null
        ("response_tokens", pa.int64()),
        ("truncated", pa.bool_()),
        ("finish_reason", pa.string()),  # stop | length | tool_limit | error | null
        ("turns", pa.int64()),
        ("tool_calls", pa.list_(TOOL_CALL)),
        ("mean_logprob", pa.float64()),
        ("extra", pa.string()),  # JSON text
    ]
)

# The per-task score table: one row per (seed, task, sample) of the final validation.
SCORE_SCHEMA = pa.schema(
    [
        ("version", pa.string()),
        ("seed", pa.int64()),
        ("task_id", pa.string()),
        ("data_source", pa.string()),
        ("sample_idx", pa.int64()),
        ("correct", pa.float64()),
    ]
)
