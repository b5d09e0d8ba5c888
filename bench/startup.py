"""Benchmark: how long `evotrainer --version`, `--help` and `lineage` (on a fresh workspace)
take to start and finish, as a user runs them (a new interpreter each time). Goal: under 0.5 s
each. Both wall-clock and CPU time (the process and the git it runs) are printed, best and
median of RUNS (5) runs: on a shared machine the wall clock grows with the load, the CPU
time much less; the load average is printed beside them.

With `--before DIR` the same commands also run with DIR first on PYTHONPATH, e.g. an older
checkout exported with `git archive REV evotrainer spec harness_revisions skills | tar -x -C
DIR`, to compare two versions on one machine in one run.

    .venv/bin/python bench/startup.py [--before DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = 5
COMMANDS = (["--version"], ["--help"], ["lineage"])


def measure(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for _ in range(RUNS):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "evotrainer", *args], cwd=cwd, env=env,
                       capture_output=True, check=True)
        walls.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="an older tree to compare with")
    options = parser.parse_args()
    trees = [("before", options.before.resolve())] if options.before else []
    trees.append(("now", Path(__file__).resolve().parents[1]))
    with tempfile.TemporaryDirectory() as tmp:
        workspace = Path(tmp) / "ws"
        subprocess.run([sys.executable, "-m", "evotrainer", "init", str(workspace)],
                       capture_output=True, check=True)
        for label, tree in trees:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            for args in COMMANDS:
                walls, cpus = measure(args, workspace, env)
                print(f"{label:6s} evotrainer {' '.join(args):10s} wall best "
                      f"{min(walls):.2f}s median {statistics.median(walls):.2f}s · CPU best "
                      f"{min(cpus):.2f}s median {statistics.median(cpus):.2f}s")
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
