"""Benchmark: `evotrainer report` against a bare read of the same records, in the same run.

Builds a workspace like the main job with tests/standin_engine.py (bench/harness.py's
`build`: v1..vN trained in a chain, each diagnosed with h0 and gated; real evidence on disk).
Then, each `--runs` times, both as a user runs them (a fresh process, start-up included):

- the baseline: a bare read of the records the report shows (every version branch with its
  run, diagnosis and decision records, `Workspace.versions()`), nothing rendered;
- `evotrainer report --out DIR`: the whole static site written.

Both CPU time (user + system, the figure a loaded machine disturbs least) and wall time are
printed, with the report's CPU as a multiple of the bare read's.

    .venv/bin/python bench/report.py [--versions 5] [--runs 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent

BARE_READ = (
    "import sys\n"
    "from pathlib import Path\n"
    "from evotrainer.store.workspace import Workspace\n"
    "states = Workspace(Path(sys.argv[1])).versions()\n"
    "assert all(s.records.get('decision') for n, s in states.items() if n != 'v0'), states\n"
)


def _build(root: Path, versions: int) -> Path:
    spec = importlib.util.spec_from_file_location("bench_harness", BENCH / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(root, versions)


def _timed(command: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one child process run to completion."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])}… failed:\n{result.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3, help="best of this many runs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = _build(Path(tmp) / "ws", args.versions)
        out = Path(tmp) / "site"
        bare = [sys.executable, "-c", BARE_READ, str(root)]
        report = [sys.executable, "-m", "evotrainer", "-C", str(root), "report", "--out",
                  str(out)]
        best = {k: math.inf for k in ("bare_cpu", "bare_wall", "report_cpu", "report_wall")}
        for _ in range(args.runs):
            cpu, wall = _timed(bare)
            best["bare_cpu"], best["bare_wall"] = (min(best["bare_cpu"], cpu),
                                                   min(best["bare_wall"], wall))
            cpu, wall = _timed(report)
            best["report_cpu"], best["report_wall"] = (min(best["report_cpu"], cpu),
                                                       min(best["report_wall"], wall))
        if not (out / "index.html").is_file():
            raise SystemExit(f"report wrote no {out / 'index.html'}")
        pages = sum(1 for _ in out.rglob("*.html"))
    print(f"evotrainer report over {args.versions} stand-in versions (+ v0), {pages} pages, "
          f"best of {args.runs}, fresh processes (start-up included); load "
          f"{os.getloadavg()[0]:.2f}:")
    print(f"  bare read of the records: {best['bare_cpu']:5.2f} s CPU, "
          f"{best['bare_wall']:5.2f} s wall")
    print(f"  report:                   {best['report_cpu']:5.2f} s CPU, "
          f"{best['report_wall']:5.2f} s wall ({best['report_cpu'] / best['bare_cpu']:4.1f}× "
          "the bare read's CPU)")
    return best


if __name__ == "__main__":
    main()
