"""Benchmark: scoring small programs in the sandbox vs a plain `subprocess.run` loop.

Both sides judge the same N programs x 5 stdin/stdout cases with the same worker count, in
the same run. The sandboxed side is the code domain's full scoring path (`score_code`: code
block extraction, compile check, one sandboxed process per case with every limit and, as
root, pid/mount/network namespaces and a fresh uid). The plain side writes each program to a
temp file once and runs `python -I -S file` per case with no limits at all. Both use the same
interpreter and flags, so the ratio is the sandbox's own overhead.

    python bench/sandbox.py [--programs 1000] [--workers 2] [--rounds 10]

`--humaneval N` measures the humaneval checker instead (one sandbox run per response: the
checker, a child for the code, the test's statements in one pass) on the first N bundled
problems, each answered right (the canonical solution) and wrong (the same solution returning
None on every third call), alternating, one worker: seconds per response for each, and how
many sandbox runs the per-assert re-runs of a failed test used to take.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

from evotrainer.domains import make_domain
from evotrainer.domains.code import outputs_match, score_code
from evotrainer.sandbox.process import LocalSandbox

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


# Wrong on every third call (a counter in the module), right otherwise: fails some asserts.
WRONG_EVERY_THIRD = (
    "_calls = [0]\n{prompt}    _calls[0] += 1\n    if _calls[0] % 3 == 0:\n"
    "        return None\n{solution}"
)


def bench_humaneval(count: int) -> None:
    domain = make_domain({"name": "humaneval"})
    seconds = {"right": 0.0, "wrong": 0.0}
    failed, asserts = 0, 0
    for i in range(count):
        task = domain.task_at(i)
        prompt, solution = task.meta["prompt"], task.meta["solution"]
        answers = {
            "right": prompt + solution,
            "wrong": WRONG_EVERY_THIRD.format(prompt=prompt, solution=solution),
        }
        for label, program in answers.items():
            start = time.perf_counter()
            score, details = domain.judge(task, f"```python\n{program}```")
            seconds[label] += time.perf_counter() - start
            if label == "right" and score.correct != 1.0:
                raise SystemExit(f"{task.task_id}: the canonical solution failed: {details}")
            if label == "wrong" and score.correct == 0.0:
                failed += 1
                asserts += details["total"]
    print(f"humaneval, {count} problems, python {sys.version.split()[0]}, "
          f"{os.cpu_count()} cpus")
    print(f"right answer : {seconds['right'] / count:6.3f} s a response (one sandbox run)")
    print(f"wrong answer : {seconds['wrong'] / count:6.3f} s a response (one sandbox run; "
          f"{failed} of {count} failed their test)")
    if failed:
        print(f"per-assert re-runs, as scored before: {1 + asserts / failed:.1f} sandbox runs "
              "a failed response")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--humaneval", type=int, default=0, metavar="N")
    args = parser.parse_args()
    if args.humaneval:
        bench_humaneval(args.humaneval)
        return
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
