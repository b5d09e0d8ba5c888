"""Benchmark: `validate` and `lineage` on a workspace with many version branches.

Builds a workspace with N version branches (a chain with side branches, each with a run
record), then times, in the same run:
  - `evotrainer validate` and `evotrainer lineage --json` as a user runs them (subprocess);
  - a naive reader that checks out every branch and reads its files from disk.

    python bench/lineage.py [--versions 500]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import git
import yaml

from evotrainer.commands.init import init_workspace
from evotrainer.control.versions import spec_text
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import Workspace, run_path, version_spec_path


def build(root: Path, count: int) -> Workspace:
    ws = Workspace(init_workspace(root, "arith"))
    for i in range(1, count):
        name, parent = f"v{i}", f"v{max(0, (i - 1) // 2)}"  # a binary tree of versions
        spec = {"apiVersion": "evotrainer/v1", "kind": "PolicyVersion", "name": name,
                "parent": parent, "intervention": {"rationale": "bench", "skills": []},
                "recipe": {"grpo": {"lr": 1e-4 * (1 + i % 3)}}, "approval": {"approved": True}}
        run = {"apiVersion": "evotrainer/v1", "kind": "Run", "version": name, "attempt": 1,
               "job_id": f"evo-{name}", "state": "Succeeded", "recipe_digest": "sha256:x",
               "result": {"avg_at_k": 0.5}}
        ws.git.commit_files(branch_name(name), {
            version_spec_path(name): spec_text(spec).encode(),
            run_path(name, "run.yaml"): yaml.safe_dump(run).encode()},
            f"bench {name}", start=branch_name(parent))
    return ws


def timed_cli(root: Path, *args: str) -> float:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "evotrainer", "-C", str(root), *args],
                            capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"evotrainer {' '.join(args)} failed:\n{result.stderr}")
    return elapsed


def naive_checkout_read(ws: Workspace) -> float:
    """What a script without batch reads does: check out each branch, read its files."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        clone = git.Repo(ws.root).clone(tmp)
        for name in ws.git.version_branches():
            clone.git.checkout("-q", f"origin/{branch_name(name)}")
            yaml.safe_load((Path(tmp) / version_spec_path(name)).read_text())
            record = Path(tmp) / run_path(name, "run.yaml")
            if record.exists():
                yaml.safe_load(record.read_text())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--versions", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ws = build(Path(tmp) / "ws", args.versions)
        print(f"built {args.versions} version branches in {time.perf_counter() - t0:.1f} s")
        validate = timed_cli(ws.root, "validate")
        lineage = timed_cli(ws.root, "lineage", "--json")
        naive = naive_checkout_read(ws)
        print(f"validate (CLI, incl. start-up)   {validate:6.2f} s   goal < 3 s")
        print(f"lineage --json (CLI)             {lineage:6.2f} s   goal < 3 s")
        print(f"naive checkout-per-branch read   {naive:6.2f} s")
        print(f"ratio naive / validate           {naive / validate:6.1f}x")
        print(f"ratio naive / lineage            {naive / lineage:6.1f}x")


if __name__ == "__main__":
    main()
