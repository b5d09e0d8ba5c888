"""Benchmark: `harness diff OLD NEW` (which backtests both revisions over every recorded
version) against the same backtest done the plain way, measured in the same run.

Builds a workspace whose lineage is trained by tests/standin_engine.py (real jobs, real
evidence on disk, no training): v1..vN in a chain, each with `--steps` recorded train steps
(the main job's runs record 160) and reconciled (diagnosed with h0 and gated). h0 and h2
differ in what their early stops read (h2 widens the leak patterns its leak ratio counts),
so `harness diff` replays the early stops of every run at every recorded step. Then, each
`--runs` times:

- the baseline: every version re-diagnosed with both revisions, one after another, nothing
  reused but what reconcile recorded under the same revision digest (in-process);
- `harness diff OLD NEW` as a user runs it (a fresh process, start-up included), first cold
  (no backtest diagnoses or early-stop replays kept from before), then again (each version's
  diagnosis under NEW and each replay read back, the decisions re-gated), wall and CPU time.

    .venv/bin/python bench/harness.py [--versions 5] [--steps 150] [--old h0] [--new h2]
                                      [--runs 3]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def build(root: Path, versions: int, steps: int = 3) -> Path:
    """A workspace with v1..v{versions} trained in a chain by the stand-in (`steps` recorded
    train steps each) and reconciled."""
    sys.path.insert(0, str(TESTS))  # the stand-in engine and its backend
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS),
                                                              os.environ.get("PYTHONPATH")]))
    from standin import StandinBackend, converge, propose

    from evotrainer.backends import BACKEND_TYPES
    from evotrainer.control.scaffold import init_workspace
    from evotrainer.store.workspace import Workspace

    BACKEND_TYPES["local"] = StandinBackend
    ws = Workspace(init_workspace(root, "arith"))
    parent = "v0"
    for i in range(1, versions + 1):
        # Alternating skill: some children promote, some are pruned.
        propose(ws, f"v{i}", parent, standin_skill=0.3 + 0.1 * (i % 3),
                standin_train_steps=steps)
        converge(ws)
        parent = f"v{i}"
    return root


def baseline(root: Path, old: str, new: str) -> float:
    """Seconds the plain backtest takes: one version after another, nothing kept between
    runs (the recorded diagnoses under the same digest are still read, as before)."""
    from evotrainer.gate import harness_backtest as hb
    from evotrainer.store.workspace import Workspace

    shutil.rmtree(root / ".evotrainer" / "cache" / "backtest", ignore_errors=True)
    remember = hb._remember
    hb._remember = lambda path, document: None
    try:
        start = time.perf_counter()
        hb.backtest_harness(Workspace(root), new, old)
        return time.perf_counter() - start
    finally:
        hb._remember = remember


def replays(root: Path, old: str, new: str, *, prefixes: bool) -> float:
    """Seconds the early-stop replays of every run take in-process, nothing kept: from each
    run's prefixes in one pass (`prefixes`, as `harness diff` replays), or each recorded
    step diagnosed in turn, the state carried from one step to the next."""
    from evotrainer.agent import stop_replay
    from evotrainer.diagnosis.harness import resolve_harness
    from evotrainer.store.workspace import Workspace

    shutil.rmtree(root / ".evotrainer" / "cache" / "backtest", ignore_errors=True)
    remember, prefixed = stop_replay._remember, stop_replay.diagnose_prefixes
    stop_replay._remember = lambda path, document: None
    if not prefixes:
        stop_replay.diagnose_prefixes = lambda *args: None
    try:
        start = time.perf_counter()
        stop_replay.stop_changes(Workspace(root), resolve_harness(old, root),
                                 resolve_harness(new, root))
        return time.perf_counter() - start
    finally:
        stop_replay._remember, stop_replay.diagnose_prefixes = remember, prefixed


def timed_diff(root: Path, old: str, new: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one `harness diff` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "evotrainer", "-C", str(root), "harness",
                             "diff", old, new], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"harness diff failed:\n{result.stderr[-2000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150,
                        help="recorded train steps of each version's run")
    parser.add_argument("--old", default="h0")
    parser.add_argument("--new", default="h2")
    parser.add_argument("--runs", type=int, default=3, help="best of this many runs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = build(Path(tmp) / "ws", args.versions, args.steps)
        t_base = t_cold = t_warm = cpu_cold = cpu_warm = math.inf
        # Once: step by step, five versions of 150 steps take about a minute.
        t_steps = replays(root, args.old, args.new, prefixes=False)
        t_prefix = min(replays(root, args.old, args.new, prefixes=True)
                       for _ in range(args.runs))
        for _ in range(args.runs):
            t_base = min(t_base, baseline(root, args.old, args.new))
            shutil.rmtree(root / ".evotrainer" / "cache" / "backtest", ignore_errors=True)
            wall, cpu = timed_diff(root, args.old, args.new)
            t_cold, cpu_cold = min(t_cold, wall), min(cpu_cold, cpu)
            wall, cpu = timed_diff(root, args.old, args.new)
            t_warm, cpu_warm = min(t_warm, wall), min(cpu_warm, cpu)
    print(f"harness diff {args.old} {args.new} over {args.versions} stand-in versions "
          f"(+ v0) of {args.steps} recorded steps, best of {args.runs}:")
    print(f"  plain backtest, in-process, one version after another: {t_base:6.2f} s")
    print(f"  early-stop replays, in-process: step by step {t_steps:6.2f} s, from each run's "
          f"prefixes {t_prefix:6.2f} s ({t_prefix / t_steps:4.2f})")
    print(f"  harness diff, fresh process, cold: {t_cold:6.2f} s ({t_cold / t_base:4.2f} of "
          f"the plain backtest, start-up included; {cpu_cold:.2f} s CPU)")
    print(f"  harness diff, fresh process, again: {t_warm:6.2f} s ({t_warm / t_base:4.2f}; "
          f"{cpu_warm:.2f} s CPU)")
    print(f"  load {os.getloadavg()[0]:.2f}")
    return {"baseline": t_base, "cold": t_cold, "warm": t_warm, "cold_cpu": cpu_cold,
            "warm_cpu": cpu_warm, "replay_steps": t_steps, "replay_prefixes": t_prefix}


if __name__ == "__main__":
    main()
