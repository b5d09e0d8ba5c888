"""The stand-in engine (tests/standin_engine.py) plus what the tracker tests replay: a
`steps.parquet` with the embedded engine's metric names for every seed of the recipe, with
values that a test can recompute (`metric_value`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import standin_engine

from evotrainer.evidence.steps import STEPS_SCHEMA

TRAIN_METRICS = ("loss", "kl", "entropy", "clip_frac", "reward_mean", "dead_group_ratio",
                 "kept_group_ratio", "tokens_per_s")


def metric_value(metric: str, seed: int, step: int) -> float:
    return round(TRAIN_METRICS.index(metric) + 0.5 * seed + 1.0 / step, 6) if (
        metric in TRAIN_METRICS) else round(0.1 * seed + 0.01 * step, 6)


def main(recipe_file: str, out_dir: str, version: str) -> int:
    code = standin_engine.main(recipe_file, out_dir, version)
    if code:
        return code
    recipe = json.loads(Path(recipe_file).read_text())
    seeds, steps = recipe["seeds"], recipe["grpo"]["steps"]
    rows = [{"version": version, "seed": seed, "step": step, "metric": metric,
             "value": metric_value(metric, seed, step)}
            for seed in seeds for step in range(1, steps + 1) for metric in TRAIN_METRICS]
    rows += [{"version": version, "seed": seed, "step": step, "metric": "val_avg",
              "value": metric_value("val_avg", seed, step)}
             for seed in seeds for step in (0, steps)]
    out = Path(out_dir)
    pq.write_table(pa.Table.from_pylist(rows, STEPS_SCHEMA), out / "steps.parquet")
    result = json.loads((out / "result.json").read_text())
    (out / "result.json").write_text(json.dumps({**result, "seeds": seeds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
