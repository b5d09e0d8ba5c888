"""Benchmark: how `validate`, `lineage`, `plan` and a reconcile pass with nothing to do grow
with the number of version branches, and what one action of a pass costs.

Builds, for each size and shape, a workspace with N version branches — proposed,
unapproved versions (one spec each, as `version new` writes them) in a binary tree or in
one chain N deep, written in one `git fast-import` — then times each command as a user runs
it (a subprocess, start-up included; `validate` twice: the first run records the specs it
found valid by content digest, which later commands read instead of checking those bytes
again; `lineage` and `plan` cold, as on a fresh clone with no such record, and warm), and,
in the same run, a naive reader that checks out every branch and reads its spec from disk:
the baseline the naive/lineage ratios are against.

The cold commands are also set against the floor of a cold check, timed the same way: one
process that reads every spec in one `git cat-file --batch`, parses it with libyaml and
checks it with jsonschema, and does nothing else. Their CPU over the floor's is what they
spend beyond that (start-up, the harness and project checks, records, the output).

Then one version is approved and its launch is applied in-process from a context read
before (its run record's commit, its worktree, the re-read of that version; the backend
submits nothing): the cost of one action, which must not grow with the branches. The last
line gives it at the largest size over the smallest.

With `--before DIR` the cold commands also run with DIR first on PYTHONPATH (an older
checkout, e.g. `git archive REV evotrainer spec harness_revisions skills | tar -x -C DIR`),
turn about with the current code, on the same workspace: each is printed as its CPU time
now over before, best of `--runs`.

    python bench/lineage.py [--sizes 100 1000 5000] [--shapes tree chain] [--naive-up-to 1000]
                            [--before DIR] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import git
import yaml

from evotrainer.backends.local import LocalBackend
from evotrainer.control.reconcile import Reconciler, load_context, plan
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import approve, spec_text
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import Workspace, version_spec_path

# The first validate of a workspace checks every spec and records the valid ones by
# content digest (.evotrainer/cache/checked); later commands read a spec they have seen
# without parsing and checking it again. A cold command runs as on a fresh clone: the
# workspace's cache is removed first. Each is (arguments, cold).
COMMANDS = ((("validate",), True), (("validate",), False), (("lineage", "--json"), True),
            (("plan", "--json"), True), (("lineage", "--json"), False),
            (("plan", "--json"), False), (("reconcile",), False))
LABELS = ("first validate", "validate", "cold lineage", "cold plan", "lineage --json",
          "plan --json", "reconcile")
COLD = ("first validate", "cold lineage", "cold plan")
GOAL_S = 3.0
# The floor of a cold check (see the docstring); run as `python -c FLOOR ROOT`.
FLOOR = """
import subprocess, sys
import yaml
from jsonschema import Draft202012Validator
from evotrainer.store.specs import registry, schema
root = sys.argv[1]
tips = subprocess.run(["git", "-C", root, "for-each-ref", "refs/heads/evo/",
                       "--format=%(objectname) %(refname:strip=3)"],
                      capture_output=True, text=True, check=True).stdout.split()
request = "".join(f"{sha}:spec/versions/{name}.yaml\\n"
                  for sha, name in zip(tips[::2], tips[1::2]))
out = subprocess.run(["git", "-C", root, "cat-file", "--batch"], input=request.encode(),
                     capture_output=True, check=True).stdout
validator = Draft202012Validator(schema("PolicyVersion"), registry=registry())
at = checked = 0
while at < len(out):
    end = out.index(b"\\n", at)
    size = int(out[at:end].split()[2])
    if not validator.is_valid(yaml.load(out[end + 1:end + 1 + size], Loader=yaml.CSafeLoader)):
        sys.exit("a spec the schema refuses")
    at, checked = end + 2 + size, checked + 1
if checked != len(tips) // 2:
    sys.exit(f"read {checked} of {len(tips) // 2} specs")
"""


def build(root: Path, count: int, shape: str = "tree") -> Workspace:
    """init's workspace (v0) plus versions v1..v{count-1}, all unapproved: a binary tree (vI
    forked from v{(I-1)//2}, depth log2 N) or one chain (vI from v{I-1}, depth N, where
    anything that walks each version's ancestors costs N × depth)."""
    ws = Workspace(init_workspace(root, "arith"))
    # v0 proposed but not approved either, so a reconcile pass has nothing to launch.
    v0 = dict(ws.version("v0").spec, approval={"approved": False})
    text, message = spec_text(v0).encode(), b"Withdraw v0's approval"
    stream = [f"commit refs/heads/{branch_name('v0')}".encode(), b"mark :1000000",
              b"committer bench <bench@localhost> 0 +0000", f"data {len(message)}".encode(),
              message, f"from {ws.git.rev(branch_name('v0'))}".encode(),
              f"M 100644 inline {version_spec_path('v0')}".encode(),
              f"data {len(text)}".encode(), text, b""]
    for i in range(1, count):
        name, parent = f"v{i}", (i - 1) // 2 if shape == "tree" else i - 1
        spec = {"apiVersion": "evotrainer/v1", "kind": "PolicyVersion", "name": name,
                "parent": f"v{parent}",
                "intervention": {"rationale": "bench", "skills": [], "factors": 1},
                "recipe": {"grpo": {"lr": 1e-4 * (1 + i % 3)}}, "approval": {"approved": False}}
        text = spec_text(spec).encode()
        message = f"Propose {name}".encode()
        start = f":{parent or 1000000}"
        stream += [f"commit refs/heads/{branch_name(name)}".encode(), f"mark :{i}".encode(),
                   b"committer bench <bench@localhost> 0 +0000",
                   f"data {len(message)}".encode(), message, f"from {start}".encode(),
                   f"M 100644 inline {version_spec_path(name)}".encode(),
                   f"data {len(text)}".encode(), text, b""]
    subprocess.run(["git", "-C", str(root), "fast-import", "--quiet"],
                   input=b"\n".join(stream) + b"\n", check=True)
    return ws


def cpu_seconds() -> float:
    """User + system CPU time of this process and of the (git) processes it waited for."""
    return sum(usage.ru_utime + usage.ru_stime for usage in (
        resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def timed_cli(root: Path, *args: str, code: Path | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one command: the CPU time (user + system, the
    command's git processes and forked halves included) is what a loaded shared machine
    does not inflate. `code`: a tree to import evotrainer from instead of this one."""
    env = {**os.environ, "PYTHONPATH": str(code)} if code is not None else None
    # Run in the workspace: a checkout's own folder first on sys.path would shadow `code`.
    return timed([sys.executable, "-m", "evotrainer", "-C", str(root), *args],
                 f"evotrainer {' '.join(args)}", cwd=root, env=env)


def timed(argv: list[str], label: str, cwd: Path | None = None,
          env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one process and the processes it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode not in (0, 2):  # plan: 2 = changes pending
        raise SystemExit(f"{label} failed:\n{result.stderr[-2000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return elapsed, cpu


def naive_checkout_read(ws: Workspace) -> float:
    """What a script without batch reads does: check out each branch, read its spec."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        clone = git.Repo(ws.root).clone(tmp)
        for name in ws.git.version_branches():
            clone.git.checkout("-q", f"origin/{branch_name(name)}")
            yaml.safe_load((Path(tmp) / version_spec_path(name)).read_text())
    return time.perf_counter() - start


class NoSubmit(LocalBackend):
    """Submits nothing: what is timed is reconcile's own work around a launch."""

    def submit(self, job) -> None:
        pass


def action_cost(ws: Workspace, name: str) -> tuple[float, float]:
    """(wall, CPU seconds) reconcile spends on launching `name` — the run record's commit,
    the worktree, the re-read of that version — from a context read before (not timed)."""
    approve(ws, name, by="bench")
    reconciler = Reconciler(Workspace(ws.root), log=lambda _: None,
                            backends={"local": NoSubmit()})
    ctx = load_context(reconciler.ws, reconciler.backends)
    [launch] = [p for p in plan(ctx) if p.action is not None]
    wall, cpu = time.perf_counter(), cpu_seconds()
    reconciler.apply(ctx, ctx.states[launch.version], launch.action)
    refreshed = ctx.refreshed(launch.version, launch.action.kind)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    if refreshed is None or launch.action.kind != "launch":
        raise SystemExit(f"expected one launch of {name}, got {launch.action}")
    return wall, cpu


def cold(root: Path, command: tuple[str, ...], code: Path | None = None) -> tuple[float, float]:
    """One command as on a fresh clone: the workspace's cache removed first."""
    shutil.rmtree(root / ".evotrainer" / "cache", ignore_errors=True)
    return timed_cli(root, *command, code=code)


def before_and_now(root: Path, before: Path, runs: int) -> list[str]:
    """Each cold command with the code in `before` and with this tree, in turns, best of
    `runs` each: (label, before, now) lines, CPU now over CPU before."""
    lines = []
    for label, (command, _) in zip(LABELS, COMMANDS, strict=True):
        if label not in COLD:
            continue
        then, now = [], []
        for _ in range(runs):
            then.append(cold(root, command, before))
            now.append(cold(root, command))
        (then_wall, then_cpu), (now_wall, now_cpu) = min(then, key=lambda t: t[1]), min(
            now, key=lambda t: t[1])
        lines.append(f"  {label:>15}: before {then_wall:6.2f} s ({then_cpu:5.2f} s)  now "
                     f"{now_wall:6.2f} s ({now_cpu:5.2f} s)  CPU now/before "
                     f"{now_cpu / then_cpu:4.2f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--shapes", nargs="+", choices=("tree", "chain"),
                        default=["tree", "chain"])
    parser.add_argument("--naive-up-to", type=int, default=1000,
                        help="time the naive reader only up to this many branches")
    parser.add_argument("--before", type=Path,
                        help="an older tree: its cold commands against this tree's")
    parser.add_argument("--runs", type=int, default=3,
                        help="with --before: runs of each cold command per tree (best kept)")
    args = parser.parse_args(argv)
    header = f"{'shape':>5} {'branches':>8}  " + "  ".join(f"{label:>19}" for label in LABELS)
    print(header + f"  {'one launch':>19}  {'naive read':>10}  naive/lineage")
    launches: dict[str, list[float]] = {}
    colds: list[str] = []
    compared: list[str] = []
    for shape in args.shapes:
        for size in args.sizes:
            with tempfile.TemporaryDirectory() as tmp:
                ws = build(Path(tmp) / "ws", size, shape)
                times = []
                for command, is_cold in COMMANDS:
                    times.append(cold(ws.root, command) if is_cold
                                 else timed_cli(ws.root, *command))
                if args.before is not None:
                    compared += [f"before/now, {shape} {size}:",
                                 *before_and_now(ws.root, args.before.resolve(), args.runs)]
                floor = timed([sys.executable, "-c", FLOOR, str(ws.root)], "the floor")
                naive = naive_checkout_read(ws) if size <= args.naive_up_to else None
                # The last version: in a chain the deepest, in the tree a leaf.
                times.append(action_cost(ws, f"v{size - 1}"))
                launches.setdefault(shape, []).append(times[-1][1])
                cells = "  ".join(f"{wall:7.2f} s ({cpu:5.2f} s)"
                                  + ("!" if wall > GOAL_S else " ") for wall, cpu in times)
                lineage = times[LABELS.index("lineage --json")][0]
                tail = (f"  {naive:8.2f} s  {naive / lineage:6.1f}x" if naive is not None
                        else f"  {'—':>10}")
                print(f"{shape:>5} {size:8d}  {cells}{tail}")
                firsts = [(label, *times[LABELS.index(label)]) for label in COLD]
                colds.append(f"cold {shape:>5} {size:8d}  floor {floor[0]:6.2f} s "
                             f"({floor[1]:5.2f} s)" + "".join(
                                 f"  {label} {wall:6.2f} s ({cpu:5.2f} s, {cpu / floor[1]:4.1f}x)"
                                 for label, wall, cpu in firsts))
    print(f"(wall (CPU); ! = wall over the {GOAL_S:.0f} s goal; each command a fresh process, "
          "start-up included; one launch: in-process, from a context read before)")
    print("\nCold, as on a fresh clone: wall (CPU, CPU as a multiple of the floor's); the "
          "floor reads every spec at once, parses it and checks it against the schema")
    print("\n".join(colds))
    if compared:
        print(f"\nCold, before ({args.before}) and now, in turns, best of {args.runs}: wall "
              "(CPU)")
        print("\n".join(compared))
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for shape, costs in launches.items():
        if len(costs) > 1:
            print(f"{shape}: one launch at {args.sizes[-1]} branches costs "
                  f"{costs[-1] / costs[0]:.2f}x its CPU time at {args.sizes[0]}")


if __name__ == "__main__":
    main()
