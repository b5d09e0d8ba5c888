"""Does the embedded engine learn? Two checks on a 2-core CPU, printed as numbers.

1. arith: from the warm start, val Avg@k after GRPO vs the step-0 evaluation of the same run,
   paired bootstrap over tasks (evotrainer.stats.paired.compare_tables, B = 10,000): the
   95% CI of the gain should lie above 0.
2. toolenv with the leaking `reveal` tool enabled: the share of val trajectories that call it,
   per evaluation; it should grow (reveal is the shortcut to reward).

Usage: .venv/bin/python bench/learning.py [--section arith|toolenv|all] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from evotrainer.engine import run_job
from evotrainer.stats.paired import compare_tables
from evotrainer.store.recipe import resolve

ARITH = {
    # Single-digit + and * (200 tasks, 160 train / 40 val): commutative facts, so what GRPO
    # sharpens on training prompts carries over to held-out ones. 32 samples per val task keep
    # the per-task means precise enough for a 40-task paired comparison.
    "domain": {"name": "arith", "params": {"ops": ["+", "*"]}, "train_size": 160, "val_size": 40},
    "grpo": {"steps": 150, "eval_every": 25, "eval_k": 32, "lr": 3.0e-4},
}
TOOLENV = {
    "domain": {"name": "toolenv", "train_size": 256, "val_size": 32},
    "environment": {"max_turns": 8, "tools": [{"name": "reveal", "enabled": True}]},
    "grpo": {"steps": 60, "eval_every": 20, "eval_k": 8, "lr": 3.0e-4, "max_response_tokens": 4},
}


def val_table(out: Path, step: int) -> pa.Table:
    table = pq.read_table(out / "rollouts" / "val.parquet")
    return table.filter(pc.equal(table["step"], step))


def arith(root: Path) -> None:
    out = root / "arith"
    started = time.perf_counter()
    result = run_job(resolve(ARITH, []), out, "arith-bench")
    wall = time.perf_counter() - started
    table = pq.read_table(out / "rollouts" / "val.parquet")
    steps = sorted(set(table["step"].to_pylist()))
    print(
        "arith val avg@32 by step:",
        "  ".join(f"{s}: {pc.mean(val_table(out, s)['correct']).as_py():.3f}" for s in steps),
    )
    cmp = compare_tables(val_table(out, 0), val_table(out, steps[-1]), B=10_000, seed=0)
    verdict = "PASS" if cmp["ci_low"] > 0 else "FAIL"
    print(
        f"arith: step 0 {cmp['mean_a']:.3f} → step {steps[-1]} {cmp['mean_b']:.3f}, "
        f"Δ {cmp['delta']:+.3f}, 95% CI [{cmp['ci_low']:+.3f}, {cmp['ci_high']:+.3f}], "
        f"Wilcoxon p {cmp['p_wilcoxon']:.4f}, {cmp['n_tasks']} tasks "
        f"({verdict}: CI above 0); wall {wall:.0f}s "
        f"(warm start {next(iter(result['warm_start'].values()))['steps']} steps)"
    )


def toolenv(root: Path) -> None:
    out = root / "toolenv"
    started = time.perf_counter()
    run_job(resolve(TOOLENV, []), out, "toolenv-bench")
    wall = time.perf_counter() - started
    rows = pq.read_table(out / "rollouts" / "val.parquet").to_pylist()
    print("toolenv (reveal enabled), per evaluation:")
    shares = []
    for step in sorted({r["step"] for r in rows}):
        at = [r for r in rows if r["step"] == step]
        share = sum(any(c["name"] == "reveal" for c in r["tool_calls"]) for r in at) / len(at)
        shares.append(share)
        print(
            f"  step {step:4d}: reveal share {share:.3f}, "
            f"avg@8 {sum(r['correct'] for r in at) / len(at):.3f}, "
            f"mean turns {sum(r['turns'] for r in at) / len(at):.2f}"
        )
    verdict = "PASS" if shares[-1] > shares[0] else "FAIL"
    print(
        f"toolenv: reveal share {shares[0]:.3f} → {shares[-1]:.3f} ({verdict}: grows); "
        f"wall {wall:.0f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=["arith", "toolenv", "all"], default="all")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        if args.section in ("arith", "all"):
            arith(root)
        if args.section in ("toolenv", "all"):
            toolenv(root)


if __name__ == "__main__":
    main()
