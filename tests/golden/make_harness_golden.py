"""Write the golden files of tests/test_harness_golden.py.

    .venv/bin/python tests/golden/make_harness_golden.py             # the expectations
    .venv/bin/python tests/golden/make_harness_golden.py --new-dump  # and the dump (not once
                                                                     # checked in: the yardstick)

The dump (harness/rollouts.jsonl, harness/parent_scores.jsonl) is a fixed, hand-shaped run:
groups dead and alive on either side of 1e-3 and of numeric zero, long failing episodes
(60 and 61 turns), short failing loops of one call, leaks h0 sees and leaks only h1 sees,
rollouts with and without a `tampered` component, truncation, over-confident logprobs, and a
validation table to compare with a parent. The expectations (harness/expected.json) hold,
for every built-in harness revision, its file's and its data's digest, the source digest of
each analyzer it uses, its diagnosis of the dump and its gate verdict.

Rewrite the expectations only when a built-in revision is *added*: a built-in revision is
frozen, and a change to one (or to an analyzer it uses) is a new revision.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from evotrainer.diagnosis.analyzers import ANALYZERS
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import HarnessRevision, load_harness
from evotrainer.evidence.schema import SCORE_SCHEMA
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.gate.rules import gate_verdict
from evotrainer.store.builtin import builtin_dir

HERE = Path(__file__).resolve().parent / "harness"
ROLLOUTS = HERE / "rollouts.jsonl"
PARENT_SCORES = HERE / "parent_scores.jsonl"
EXPECTED = HERE / "expected.json"


def _dump_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The hand-shaped run (train steps 1-3, validation at steps 1 and 3) and its parent's
    per-task scores."""
    loop = ["compare 31"] * 3
    # Per group: (reward of each of 4 samples, correct of each, extra fields per sample).
    shapes: list[tuple[list[float], list[float], dict[str, Any]]] = [
        ([1.0] * 4, [1.0] * 4, {}),  # all correct: dead, too easy
        ([0.0] * 4, [0.0] * 4, {"turns": [61, 60, 3, 2]}),  # all wrong; one 61-turn failure
        ([0.5005, 0.4995, 0.5005, 0.4995], [0.0] * 4, {"tool_calls": [loop] * 2 + [None] * 2}),
        ([0.502, 0.498, 0.502, 0.498], [0.0] * 4, {}),  # spread 2e-3: alive, weak
        ([1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0], {"truncated": [False, True] * 2}),
        ([1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], {}),
    ]
    leaks = {  # (step, group, sample): the call made
        (1, 0, 1): "reveal",
        (2, 4, 3): "bash git log -1",
        (3, 5, 2): "bash git checkout HEAD~1 -- solution.py",  # only h1's audit sees it
    }
    tampered = {(2, 5, 0): 1.0, (3, 0, 3): 1.0}  # rollouts whose scorer saw tampering
    rows: list[dict[str, Any]] = []
    for step in (1, 2, 3):
        for g, (rewards, corrects, extra) in enumerate(shapes):
            for i in range(4):
                calls = ["read a.py", "bash pytest", "bash pytest"][: 1 + (i + g + step) % 3]
                if "tool_calls" in extra:
                    calls = extra["tool_calls"][i]
                if (step, g, i) in leaks:
                    calls = [*(calls or []), leaks[(step, g, i)]]
                components = [("correctness", corrects[i])]
                if g % 2 == 0 or (step, g, i) in tampered:  # half the groups run code
                    components.append(("tampered", tampered.get((step, g, i), 0.0)))
                rows.append(
                    dict(
                        step=step,
                        task_id=f"t{g}",
                        group_id=f"s{step}g{g}",
                        sample_idx=i,
                        reward=rewards[i],
                        reward_components=components,
                        correct=corrects[i],
                        turns=(extra.get("turns") or [4 + (i + g) % 5] * 4)[i],
                        truncated=(extra.get("truncated") or [False] * 4)[i],
                        response_tokens=50 + 10 * i + 7 * g + step,
                        tool_calls=calls,
                        mean_logprob=-0.03 if (g == 3 and step == 3) else -0.3 - 0.01 * i,
                    )
                )
    for step, shift in ((1, 0), (3, 1)):
        for task in range(6):
            for i in range(2):
                rows.append(
                    dict(
                        split="val",
                        step=step,
                        task_id=f"t{task}",
                        group_id=f"v{step}t{task}",
                        sample_idx=i,
                        reward=float((task + i + shift) % 3 != 0),
                        correct=float((task + i + shift) % 3 != 0),
                        tool_calls=["reveal"] if (step, task, i) == (3, 2, 1) else ["read a.py"],
                        reward_components=[("tampered", float((step, task, i) == (3, 4, 0)))],
                    )
                )
    parent = [
        dict(version="parent", seed=0, task_id=f"t{task}", data_source="synthetic",
             sample_idx=i, correct=float((task + i) % 2))
        for task in range(6)
        for i in range(2)
    ]
    return rows, parent


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def dump_tables() -> tuple[pa.Table, pa.Table]:
    """The checked-in dump as the canonical rollout table and the parent's score table."""
    rows = read_jsonl(ROLLOUTS)
    for row in rows:  # JSON has no pairs: components are stored as [name, value] lists
        row["reward_components"] = [tuple(c) for c in row["reward_components"]]
    return rollout_table(rows), pa.Table.from_pylist(read_jsonl(PARENT_SCORES), SCORE_SCHEMA)


def builtin_revisions() -> dict[str, HarnessRevision]:
    folder = builtin_dir("harness_revisions")
    return {p.stem: load_harness(p) for p in sorted(folder.glob("*.yaml"))}


def file_digest(name: str) -> str:
    """sha256 of a built-in revision's file as shipped, comments included: the file is frozen."""
    path = builtin_dir("harness_revisions") / f"{name}.yaml"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def analyzer_digests(revision: HarnessRevision) -> dict[str, str]:
    """sha256 of the source of each analyzer the revision uses: an edit to one is a change
    of the revision's meaning, whatever the dump shows."""
    return {
        name: hashlib.sha256(inspect.getsource(ANALYZERS[name].fn).encode()).hexdigest()
        for name in sorted({m.analyzer for m in revision.metrics if m.analyzer})
    }


def golden(revision: HarnessRevision, rollouts: pa.Table, parent: pa.Table) -> dict[str, Any]:
    """What must never change for a built-in revision: digest, analyzers, diagnosis, verdict.
    The evidence digest is left out: it hashes Arrow's serialisation of the dump, not the
    revision's meaning."""
    diagnosis = diagnose(rollouts, None, revision, parent_scores=parent)
    verdict = gate_verdict(revision, diagnosis)
    return {
        "digest": revision.digest,
        "analyzers": analyzer_digests(revision),
        "diagnosis": {k: v for k, v in diagnosis.items() if k != "evidence_digest"},
        "verdict": {"verdict": verdict["verdict"], "rule": verdict["rule"]},
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-dump", action="store_true", help="rewrite the dump as well")
    args = parser.parse_args(argv)
    HERE.mkdir(parents=True, exist_ok=True)
    if args.new_dump or not ROLLOUTS.exists():
        rows, parent = _dump_rows()
        ROLLOUTS.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        PARENT_SCORES.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in parent))
    rollouts, parent = dump_tables()
    expected = {
        name: {"file": file_digest(name), **golden(rev, rollouts, parent)}
        for name, rev in builtin_revisions().items()
    }
    EXPECTED.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {EXPECTED} ({', '.join(expected)})")


if __name__ == "__main__":
    main(sys.argv[1:])
