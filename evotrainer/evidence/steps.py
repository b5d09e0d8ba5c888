"""The per-step metrics table ("steps" view), long format: one row per (version, seed, step,
metric). Written by the engines as `steps.parquet`; verl's file-logger metrics land here too."""

from __future__ import annotations

import pyarrow as pa

STEPS_SCHEMA = pa.schema(
    [
        ("version", pa.string()),
        ("seed", pa.int64()),
        ("step", pa.int64()),
        ("metric", pa.string()),  # e.g. "actor/entropy", "critic/score/mean"
        ("value", pa.float64()),
    ]
)


def empty_steps() -> pa.Table:
    return STEPS_SCHEMA.empty_table()
