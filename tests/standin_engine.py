"""A stand-in for `python -m evotrainer.engine` in reconcile tests: same command line, same
outputs (canonical rollouts, steps, scores.csv, result.json), no training — correctness is
drawn from a seeded Bernoulli whose rate the test sets through `domain.params`:

- `standin_skill` (default 0.3): probability that a sample is correct;
- `standin_leak` (default false): train rollouts call the leaking tool `reveal`;
- `standin_fail` (default false): exit 1 without results, as a crashed job does;
- `standin_disk_full` (a path): while that file exists, fail as a full disk does;
- `standin_corrupt` (default false): write a val.parquet that is not Parquet;
- `standin_step_s` (default 0): seconds per training step, each logged to train.log and
  recorded in progress.json as the engine does (the engine's own `ProgressRecord`): a job
  that runs long enough to watch or cancel;
- `standin_flush` (default false): after each step, (atomically) rewrite
  rollouts/train.parquet with the rows of the steps so far, as the engine flushes its
  evidence: what a live look (and an early stop) reads while the job runs.

Like the engine it writes its policy to `checkpoint/` (two small files whose bytes depend on
the recipe) and, continuing from a parent (`model.init_checkpoint`), logs which one.

What is real around it: the detached subprocess, job.json / result.json protocol, and every
reconcile step after it (ingest, h0 diagnosis, paired bootstrap gate, git commits).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from evotrainer.engine.outputs import ProgressRecord
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.store.recipe import digest

TASKS, GROUP = 24, 4


def rows(version: str, split: str, steps: list[int], skill: float, leak: bool, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for step in steps:
        for task in range(TASKS):
            for sample in range(GROUP):
                correct = float(rng.random() < min(1.0, skill + 0.02 * (task % 5)))
                out.append({
                    "version": version, "seed": 0, "step": step, "split": split,
                    "task_id": f"t{task}", "data_source": "standin",
                    "group_id": f"{step}-{task}", "sample_idx": sample, "prompt": f"task {task}",
                    "response": "=1" if correct else "=0", "reward": correct,
                    "reward_components": [("correctness", correct)], "correct": correct,
                    "response_tokens": 2, "truncated": False, "finish_reason": "stop",
                    "turns": 2, "tool_calls": [{"name": "reveal", "args": ""}] if leak else [],
                    "mean_logprob": -1.0, "extra": "{}"})
    return out


def flush(out: Path, train: list[dict]) -> None:
    """The train rollouts so far, replaced whole as the engine does (never half written)."""
    (out / "rollouts").mkdir(parents=True, exist_ok=True)
    partial = out / "rollouts" / ".train.parquet.partial"
    pq.write_table(pa.Table.from_pylist(train, ROLLOUT_SCHEMA), partial)
    os.replace(partial, out / "rollouts" / "train.parquet")


def main(recipe_file: str, out_dir: str, version: str) -> int:
    recipe = json.loads(Path(recipe_file).read_text())
    params = recipe["domain"].get("params") or {}
    out = Path(out_dir)
    if params.get("standin_fail"):
        print("stand-in engine: failing on purpose", file=sys.stderr)
        (out / "result.json").write_text(json.dumps({"status": "failed", "error": "on purpose"}))
        return 1
    disk_full = params.get("standin_disk_full")
    if disk_full and Path(disk_full).exists():
        error = "[Errno 28] No space left on device: 'rollouts/train.parquet'"
        (out / "result.json").write_text(json.dumps({"status": "failed", "error": error}))
        return 1
    skill, leak = params.get("standin_skill", 0.3), params.get("standin_leak", False)
    # The seed ignores where the parent's checkpoint lies (a temporary path), so a test's
    # outcome is the same on every machine and in every run.
    start = (recipe.get("model") or {}).get("init_checkpoint")
    model = {k: v for k, v in (recipe.get("model") or {}).items() if k != "init_checkpoint"}
    seed = int(digest({**recipe, "model": model})[7:15], 16)
    progress = ProgressRecord(RunArtifacts(out).progress)
    progress.begin_seed(0, recipe["grpo"]["steps"] * len(recipe.get("seeds") or [0]))
    with (out / "train.log").open("a") as log:
        log.write(f"stand-in run of {version}\n")
        if start:
            log.write(f"continuing from {start['path']} {start['digest']}\n")
        for step in range(1, recipe["grpo"]["steps"] + 1):
            began = time.monotonic()
            time.sleep(float(params.get("standin_step_s", 0)))
            log.write(f"2025-01-01 00:00:00 seed 0 step {step}: reward 0.500 kept 1.00\n")
            log.flush()
            progress.stepped(step, time.monotonic() - began)
            if params.get("standin_flush"):
                flush(out, rows(version, "train", list(range(1, step + 1)), skill, leak, seed))
    (out / "rollouts").mkdir(parents=True, exist_ok=True)
    # Train rollouts of the first few steps (a run's shape), or of as many as asked for.
    recorded = int(params.get("standin_train_steps", 3))
    train = rows(version, "train", list(range(1, recorded + 1)), skill, leak, seed)
    val = rows(version, "val", [recipe["grpo"]["steps"]], skill, False, seed + 1)
    pq.write_table(pa.Table.from_pylist(train, ROLLOUT_SCHEMA), out / "rollouts/train.parquet")
    pq.write_table(pa.Table.from_pylist(val, ROLLOUT_SCHEMA), out / "rollouts/val.parquet")
    if params.get("standin_corrupt"):
        (out / "rollouts/val.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    lines = ["seed,task_id,data_source,sample_idx,correct"] + [
        f"0,{r['task_id']},standin,{r['sample_idx']},{r['correct']}" for r in val]
    (out / "scores.csv").write_text("\n".join(lines) + "\n")
    policy = out / "checkpoint"
    policy.mkdir(exist_ok=True)
    (policy / "config.json").write_text(json.dumps({"standin": version, "seed": seed}))
    (policy / "model.safetensors").write_bytes(seed.to_bytes(8, "little") * 64)
    accuracy = float(np.mean([r["correct"] for r in val]))
    progress.evaluated(recipe["grpo"]["steps"], accuracy)
    (out / "result.json").write_text(json.dumps({
        "status": "ok", "val_avg": accuracy,
        "steps": recipe["grpo"]["steps"],
        "steps_done": recipe["grpo"]["steps"] * len(recipe.get("seeds") or [0]),
        "eval_k": GROUP, "seeds": [0], "wall_time_s": 0.01}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
