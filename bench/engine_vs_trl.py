"""Step time and peak RSS: the embedded GRPO engine vs TRL's GRPOTrainer, same work.

Two setups, each loading one saved checkpoint into both trainers:

  tiny     BASE_RECIPE's Qwen2 with the character tokenizer, 16 arith prompts x 8 completions
           of at most 8 tokens, full fine-tuning.
  smollm2  SmolLM2-135M-Instruct (the `evotrainer[smollm2]` GGUF, converted once into the
           artifact cache), HumanEval prompts as a chat turn (both apply the model's chat
           template), LoRA r=16 alpha=32 on all linear layers, float32 on both sides (TRL's
           bf16 and gradient-checkpointing defaults are turned off), 2 prompts x 4 completions
           of at most 32 tokens (HumanEval answers rarely end that soon, so both sample the
           same token budget).

Both: Clip-Higher 0.20 / 0.27, token-mean (TRL: loss_type "dapo"), no KL, group-std advantage,
one thread. Each engine runs in its own subprocess (so peak RSS is its own), alternated over
several rounds so background load hits both alike; the first steps of every process are
warm-up and not timed. TRL is not a dependency of evotrainer: put it (and `datasets`) on the
path, e.g. `pip install --no-deps --target DIR trl datasets pandas dill multiprocess` and run
with PYTHONPATH=DIR; without trl the script says so and exits 0.

Usage: python bench/engine_vs_trl.py [--setup tiny|smollm2] [--rounds 3] [--steps 10]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LR = 1.0e-4
# Where the smollm2 setup finds (or makes) its converted checkpoint: the cache
# bench/real_model.py uses, so the GGUF is dequantised once for both.
CACHE = Path(
    os.environ.get("EVOTRAINER_CACHE_DIR", Path(tempfile.gettempdir()) / "evotrainer-cache")
)


@dataclass(frozen=True)
class Setup:
    """One comparison: the model, the domain, the batch and what trains."""

    domain: dict[str, Any]
    prompts: int
    group: int
    max_tokens: int
    warmup: int
    lora: dict[str, Any] | None = None
    # Domain split sizes the prompts are drawn from (train, val).
    split: tuple[int, int] = field(default=(256, 32))
    chat: bool = False


SETUPS = {
    "tiny": Setup(domain={"name": "arith"}, prompts=16, group=8, max_tokens=8, warmup=2),
    "smollm2": Setup(
        domain={"name": "humaneval", "train_size": 144, "val_size": 20},
        prompts=2,
        group=4,
        max_tokens=32,
        warmup=1,
        lora={"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        split=(144, 20),
        chat=True,
    ),
}


def recipe(setup: Setup, model_dir: Path) -> dict:
    from evotrainer.store.recipe import resolve

    return resolve(
        {
            "model": {
                "path": str(model_dir),
                "warm_start": {"steps": 0},
                "lora": setup.lora,
                "chat_template": "auto" if setup.chat else "none",
            },
            "domain": setup.domain,
            "grpo": {
                "group_size": setup.group,
                "prompts_per_step": setup.prompts,
                "max_response_tokens": setup.max_tokens,
                "lr": LR,
            },
        },
        [],
    )


def prepare(name: str, workdir: Path) -> Path:
    """The checkpoint directory both trainers load."""
    if name == "smollm2":
        from evotrainer.contract.recipe import package_checkpoint
        from evotrainer.engine.model import converted_gguf

        return converted_gguf(package_checkpoint("smollm2"), CACHE)
    from evotrainer.engine.model import build_tiny, char_tokenizer, save_checkpoint
    from evotrainer.store.recipe import BASE_RECIPE

    model_dir = workdir / "tiny"
    tokenizer = char_tokenizer()
    save_checkpoint(build_tiny(BASE_RECIPE["model"]["tiny"], tokenizer, 0), tokenizer, model_dir)
    return model_dir


def worker_ours(setup: Setup, model_dir: Path, steps: int) -> list[float]:
    from evotrainer.domains import make_domain
    from evotrainer.engine.grpo import Trainer
    from evotrainer.engine.outputs import RunLog, RunOutputs

    r = recipe(setup, model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        log = RunLog(Path(tmp) / "train.log", progress=False)
        trainer = Trainer(
            r, 0, make_domain(r["domain"]), RunOutputs(Path(tmp), "bench"), log, Path(tmp) / "cache"
        )
        times = []
        for step in range(1, steps + setup.warmup + 1):
            start = time.perf_counter()
            trainer.train_step(step)
            times.append(time.perf_counter() - start)
        log.close()
    return times[setup.warmup :]


def worker_trl(setup: Setup, model_dir: Path, steps: int) -> list[float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from evotrainer.domains import make_domain

    domain = make_domain(setup.domain)
    train, _ = domain.split(*setup.split)
    by_prompt = {t.prompt: t for t in train}

    def text(item: Any) -> str:
        # Conversational datasets hand prompts and completions over as message lists.
        return item[-1]["content"] if isinstance(item, list) else item

    def correctness(prompts: list[Any], completions: list[Any], **_: object) -> list[float]:
        return [
            domain.score(by_prompt[text(p)], text(c), []).correct
            for p, c in zip(prompts, completions, strict=True)
        ]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    peft_config = None
    if setup.lora is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=setup.lora["r"],
            lora_alpha=setup.lora["alpha"],
            lora_dropout=setup.lora["dropout"],
            target_modules=setup.lora["target_modules"],
            task_type="CAUSAL_LM",
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=str(Path(tmp) / "trl_out"),
            use_cpu=True,
            report_to="none",
            # float32 and no recomputation, as the embedded engine trains.
            bf16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=setup.prompts * setup.group,
            num_generations=setup.group,
            max_completion_length=setup.max_tokens,
            epsilon=0.2,
            epsilon_high=0.27,
            beta=0.0,
            loss_type="dapo",
            learning_rate=LR,
            max_steps=steps + setup.warmup,
            logging_steps=1000,
            save_strategy="no",
            disable_tqdm=True,
            temperature=1.0,
            top_k=0,
            seed=0,
        )
        prompts = [
            {"prompt": [{"role": "user", "content": t.prompt}] if setup.chat else t.prompt}
            for t in train
        ]
        timer = StepTimer()
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=[correctness],
            args=config,
            train_dataset=Dataset.from_list(prompts),
            processing_class=tokenizer,
            callbacks=[timer],
            peft_config=peft_config,
        )
        trainer.train()
    return timer.times[setup.warmup :]


def worker(kind: str, setup_name: str, model_dir: Path, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    setup = SETUPS[setup_name]
    times = (worker_ours if kind == "ours" else worker_trl)(setup, model_dir, steps)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"times": times, "peak_rss_mb": peak_mb}), flush=True)


def run_worker(kind: str, setup_name: str, model_dir: Path, steps: int) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    command = [sys.executable, __file__, "--worker", kind, "--setup", setup_name]
    command += ["--model", str(model_dir), "--steps", str(steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"{kind} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=sorted(SETUPS), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per process")
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.setup, args.model, args.steps)
        return
    if importlib.util.find_spec("trl") is None:
        print(
            "trl is not importable here: this benchmark needs TRL on the path (e.g. pip "
            "install --no-deps --target DIR trl datasets, then PYTHONPATH=DIR). Skipped."
        )
        return
    setup = SETUPS[args.setup]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = prepare(args.setup, Path(tmp))
        results: dict[str, list[dict]] = {"ours": [], "trl": []}
        for _ in range(args.rounds):
            for kind in ("ours", "trl"):
                results[kind].append(run_worker(kind, args.setup, model_dir, args.steps))
    print(
        f"setup {args.setup}: {setup.prompts} prompts x {setup.group} completions, "
        f"<= {setup.max_tokens} tokens, {'LoRA' if setup.lora else 'full fine-tuning'}"
    )
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
