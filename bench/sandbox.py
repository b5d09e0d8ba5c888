"""Benchmark: scoring small programs in the sandbox vs a plain `subprocess.run` loop.

Both sides judge the same N programs x 5 stdin/stdout cases with the same worker count, in
the same run. The sandboxed side is the code domain's full scoring path (`score_code`: code
block extraction, compile check, one sandboxed process per case with every limit and, as
root, pid/mount/network namespaces and a fresh uid). The plain side writes each program to a
temp file once and runs `python -I -S file` per case with no limits at all. Both use the same
interpreter and flags, so the ratio is the sandbox's own overhead.

    python bench/sandbox.py [--programs 1000] [--workers 2] [--rounds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

from evotrainer.domains.code import outputs_match, score_code
from evotrainer.domains.sandbox import LocalSandbox

CASES = 5
PYTHON = LocalSandbox().python  # the same interpreter the sandbox runs


def make_programs(count: int) -> list[tuple[str, list[dict[str, str]]]]:
    """Small varied programs with their tests; every tenth one is wrong on purpose."""
    programs = []
    for k in range(count):
        offset = k % 97
        printed = offset + 1 if k % 10 == 9 else offset
        source = f"a, b = map(int, input().split())\nprint(a * b + {printed})"
        tests = [{"input": f"{i} {k}\n", "output": f"{i * k + offset}\n"} for i in range(CASES)]
        programs.append((source, tests))
    return programs


def score_sandboxed(item: tuple[str, list[dict[str, str]]]) -> int:
    source, tests = item
    _, details = score_code(f"```python\n{source}\n```", tests)
    return details["passed"]


def score_plain(item: tuple[str, list[dict[str, str]]]) -> int:
    source, tests = item
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    try:
        passed = 0
        for case in tests:
            run = subprocess.run(
                [PYTHON, "-I", "-S", f.name], input=case["input"], capture_output=True, text=True
            )
            passed += run.returncode == 0 and outputs_match(case["output"], run.stdout)
        return passed
    finally:
        os.unlink(f.name)


def timed_interleaved(programs: list, workers: int, rounds: int) -> dict[str, list[float]]:
    """Seconds and passed cases per side. The sides alternate over `rounds` slices of the
    programs, so load from other processes drifting during the run hits both alike."""
    sides = {"plain": score_plain, "sandbox": score_sandboxed}
    totals = {name: [0.0, 0] for name in sides}
    context = multiprocessing.get_context("fork")
    with context.Pool(workers) as pool:
        for r in range(rounds):
            chunk = programs[r::rounds]
            for name, fn in sides.items():
                start = time.perf_counter()
                passed = sum(pool.imap_unordered(fn, chunk, chunksize=8))
                totals[name][0] += time.perf_counter() - start
                totals[name][1] += passed
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    programs = make_programs(args.programs)
    cases = args.programs * CASES
    sandbox = LocalSandbox()
    print(
        f"{args.programs} programs x {CASES} cases, {args.workers} workers, "
        f"{os.cpu_count()} cpus, python {sys.version.split()[0]}"
    )
    print(f"sandbox isolation: {', '.join(sandbox.run('pass').isolation)}")
    totals = timed_interleaved(programs, args.workers, max(1, args.rounds))
    (plain_s, plain_passed), (sandbox_s, sandbox_passed) = totals["plain"], totals["sandbox"]
    if plain_passed != sandbox_passed:
        raise SystemExit(f"verdicts differ: plain {plain_passed}, sandbox {sandbox_passed}")
    print(f"plain subprocess.run : {cases / plain_s:8.1f} cases/s ({plain_s:.1f} s)")
    print(f"sandboxed score_code : {cases / sandbox_s:8.1f} cases/s ({sandbox_s:.1f} s)")
    print(
        f"sandbox overhead     : {sandbox_s / plain_s:8.2f}x the plain loop's time "
        f"({sandbox_passed}/{cases} cases passed on both sides)"
    )


if __name__ == "__main__":
    main()
