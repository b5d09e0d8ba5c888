"""Step time and peak RSS: the embedded GRPO engine vs TRL's GRPOTrainer, same work.

Same tiny model (BASE_RECIPE's Qwen2, saved once and loaded by both), the same 16 arith prompts
× 8 completions of at most 8 tokens, Clip-Higher 0.20 / 0.27, token-mean (TRL: loss_type
"dapo"), no KL, one thread. Each engine runs in its own subprocess (so peak RSS is its own),
alternated over several rounds so background load hits both alike; the first steps of every
process are warm-up and not timed. TRL is not a dependency: install it into a separate venv
and run this script with that interpreter; without trl it says so and exits 0.

Usage: python bench/engine_vs_trl.py [--rounds 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 2
PROMPTS, GROUP, MAX_TOKENS, LR = 16, 8, 8, 1.0e-4


def recipe(model_dir: Path) -> dict:
    from evotrainer.store.recipe import resolve

    return resolve(
        {
            "model": {"path": str(model_dir), "warm_start": {"steps": 0}},
            "grpo": {
                "group_size": GROUP,
                "prompts_per_step": PROMPTS,
                "max_response_tokens": MAX_TOKENS,
                "lr": LR,
            },
        },
        [],
    )


def prepare(model_dir: Path) -> None:
    from evotrainer.engine.model import build_tiny, char_tokenizer, save_checkpoint
    from evotrainer.store.recipe import BASE_RECIPE

    tokenizer = char_tokenizer()
    save_checkpoint(build_tiny(BASE_RECIPE["model"]["tiny"], tokenizer, 0), tokenizer, model_dir)


def worker_ours(model_dir: Path, steps: int) -> list[float]:
    from evotrainer.domains import make_domain
    from evotrainer.engine.grpo import Trainer
    from evotrainer.engine.outputs import RunLog, RunOutputs

    r = recipe(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        log = RunLog(Path(tmp) / "train.log", progress=False)
        trainer = Trainer(
            r, 0, make_domain(r["domain"]), RunOutputs(Path(tmp), "bench"), log, Path(tmp) / "cache"
        )
        times = []
        for step in range(1, steps + WARMUP + 1):
            start = time.perf_counter()
            trainer.train_step(step)
            times.append(time.perf_counter() - start)
        log.close()
    return times[WARMUP:]


def worker_trl(model_dir: Path, steps: int) -> list[float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from evotrainer.domains import make_domain

    domain = make_domain({"name": "arith"})
    train, _ = domain.split(256, 32)
    by_prompt = {t.prompt: t for t in train}

    def correctness(prompts: list[str], completions: list[str], **_: object) -> list[float]:
        return [
            domain.score(by_prompt[p], c, []).correct
            for p, c in zip(prompts, completions, strict=True)
        ]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GRPOConfig(
        output_dir=str(model_dir.parent / "trl_out"),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        epsilon=0.2,
        epsilon_high=0.27,
        beta=0.0,
        loss_type="dapo",
        learning_rate=LR,
        max_steps=steps + WARMUP,
        logging_steps=1000,
        save_strategy="no",
        disable_tqdm=True,
        temperature=1.0,
        top_k=0,
        seed=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[correctness],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": t.prompt} for t in train]),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    return timer.times[WARMUP:]


def worker(kind: str, model_dir: Path, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    times = (worker_ours if kind == "ours" else worker_trl)(model_dir, steps)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"times": times, "peak_rss_mb": peak_mb}), flush=True)


def run_worker(kind: str, model_dir: Path, steps: int) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            kind,
            "--model",
            str(model_dir),
            "--steps",
            str(steps),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"{kind} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per process")
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.steps)
        return
    if importlib.util.find_spec("trl") is None:
        print(
            "trl is not importable here: this benchmark needs TRL in a separate venv "
            "(e.g. pip install trl there, then run this script with that python). Skipped."
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        prepare(model_dir)
        results: dict[str, list[dict]] = {"ours": [], "trl": []}
        for _ in range(args.rounds):
            for kind in ("ours", "trl"):
                results[kind].append(run_worker(kind, model_dir, args.steps))
    summary = {}
    for kind, runs in results.items():
        times = [t for run in runs for t in run["times"]]
        summary[kind] = (statistics.median(times), max(run["peak_rss_mb"] for run in runs))
        print(
            f"{kind:5s}: median step {summary[kind][0]:.3f}s over {len(times)} steps "
            f"({args.rounds} alternated processes), peak RSS {summary[kind][1]:.0f} MB"
        )
    ratio = summary["trl"][0] / summary["ours"][0]
    print(
        f"speed-up (TRL step time / ours): {ratio:.2f}x "
        f"({'meets' if ratio >= 1.3 else 'misses'} the 1.3x goal)"
    )


if __name__ == "__main__":
    main()
