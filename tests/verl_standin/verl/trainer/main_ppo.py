"""Stand-in for `python -m verl.trainer.main_ppo` (see ../../README.md): no model, no Ray actors;
the same overrides in, verl 0.9.1's dump, metrics and failure formats out."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import yaml


def parse(argv: list[str]) -> dict:
    config = {}
    for arg in argv:
        key, _, raw = arg.partition("=")
        if raw.startswith("'") and raw.endswith("'"):
            value = raw[1:-1].replace("\\'", "'").replace("\\\\", "\\")
        else:
            value = yaml.safe_load(raw)
        config[key.lstrip("+")] = value
    return config


def load_reward(config: dict):
    path = config["reward.custom_reward_function.path"]
    spec = importlib.util.spec_from_file_location("custom_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, config["reward.custom_reward_function.name"])
    kwargs = {
        k.rsplit(".", 1)[1]: v
        for k, v in config.items()
        if k.startswith("reward.custom_reward_function.reward_kwargs.")
    }
    return lambda row, text: fn(
        data_source=row["data_source"],
        solution_str=text,
        ground_truth=row["reward_model"]["ground_truth"],
        extra_info=row["extra_info"],
        **kwargs,
    )


def answer(row: dict, session: int, step: int) -> str:
    # Deterministic, and right about two times in three, so scores are neither 0 nor 1.
    if (row["extra_info"]["index"] + session + step) % 3:
        return row["reward_model"]["ground_truth"]
    return "wrong"


def dump(directory: str, step: int, rows: list[dict]) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / f"{step}.jsonl", "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def generations(rows, n: int, step: int, reward, with_extras: bool, v1: bool = True) -> list[dict]:
    out = []
    for row in rows:
        prompt_uid = uuid.uuid4().hex
        for session in range(n):
            text = answer(row, session, step)
            scored = reward(row, text)
            line = {
                "input": row["prompt"][0]["content"],
                "output": text,
                "gts": row["reward_model"]["ground_truth"],
                "score": scored["score"],
                "step": step,
            }
            if with_extras:  # V1: only the validation dump carries reward_extra_info
                line.update({"reward": scored["score"], **scored} if v1 else scored)
            if v1:  # the legacy trainer dumps no uid
                line["uid"] = f"{prompt_uid}_{session}_0"
            out.append(line)
    return out


def balanced(lines: list[dict]) -> list[dict]:
    """The order the legacy trainer's `_balance_batch` leaves a batch in on one data-parallel
    rank: sorted by length, then every other row forward and the rest backward (length here
    is characters of prompt and response, standing in for tokens)."""
    length = [len(line["input"] + line["output"]) for line in lines]
    order = sorted(range(len(lines)), key=lambda i: (length[i], i))
    return [lines[i] for i in order[::2] + order[1::2][::-1]]


def main() -> int:
    config = parse(sys.argv[1:])
    # trainer.use_v1=false: the legacy trainer, whose dumps carry every reward extra and no
    # uid, its train batches reordered by trainer.balance_batch (on by default).
    v1 = config.get("trainer.use_v1", True) is not False
    balance = not v1 and config.get("trainer.balance_batch", True) is not False
    mode = os.environ.get("STANDIN_MODE", "ok")
    pause = float(os.environ.get("STANDIN_STEP_SLEEP", "0"))
    reward = load_reward(config)
    train = pq.read_table(config["data.train_files"]).to_pylist()
    val = pq.read_table(config["data.val_files"]).to_pylist()
    steps, test_freq = config["trainer.total_training_steps"], config["trainer.test_freq"]
    batch, n = config["data.train_batch_size"], config["actor_rollout_ref.rollout.n"]
    metrics_path = config["ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH"]
    Path(metrics_path).parent.mkdir(parents=True, exist_ok=True)
    with open(metrics_path, "wb") as metrics:  # verl's FileLogger truncates, as here

        def log(step: int, data: dict) -> None:
            metrics.write(json.dumps({"step": step, "data": data}).encode() + b"\n")
            metrics.flush()

        def validate(step: int) -> None:
            rows = generations(
                val,
                config["actor_rollout_ref.rollout.val_kwargs.n"],
                step,
                reward,
                with_extras=True,
                v1=v1,
            )
            dump(config["trainer.validation_data_dir"], step, rows)
            log(step, {"val-core/all/acc/mean@k": sum(r["acc"] for r in rows) / len(rows)})

        validate(0)
        for step in range(1, steps + 1):
            time.sleep(pause)
            start = ((step - 1) * batch) % len(train)
            rows = generations(train[start : start + batch], n, step, reward, with_extras=not v1,
                               v1=v1)
            if balance:
                rows = balanced(rows)
            dump(config["trainer.rollout_data_dir"], step, rows)
            scores = [r["score"] for r in rows]
            log(
                step,
                {
                    "critic/score/mean": sum(scores) / len(scores),
                    "training/global_step": step,
                    "timing_s/step": 0.01,
                },
            )
            if step % test_freq == 0 or step == steps:
                validate(step)
            if step == 1 and mode == "fail":
                print(
                    "Error executing job with overrides: [...]\nray.exceptions.RayTaskError: "
                    "stand-in failure",
                    file=sys.stderr,
                )
                return 1
            if step == 1 and mode == "stall":
                print("(stand-in) waiting for resources that never come", flush=True)
                while True:
                    time.sleep(1)
    print("Final validation metrics: (stand-in)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
