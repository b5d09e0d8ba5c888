"""Benchmark: `ingest verl` against a bare `json.loads` pass over the same files (goal: the
ingest at least 0.8 of the parse's speed), for each dump flavour the ingest maps differently:

- `v1`: verl's default trainer; rows keyed by `uid` ({prompt uid}_{session}_{index}), the
  tool calls read from the responses' hermes markup (a V1 train dump keeps no reward extra);
- `legacy`: the legacy trainer's train dump with the dataset row `index` our reward function
  returns, ingested with the group size known (every group's size checked: the ambiguity scan);
- `legacy-val`: a legacy validation dump without keys, grouped by position (each block of n
  rows checked to hold one prompt) with the group size known.

Ingest and parse take turns, RUNS times, and each prints its best: on a shared machine one run
can take twice another, and the ratio of two single runs means little. The bare orjson loop
(the parser the ingest uses, nothing kept) is printed beside them.

    .venv/bin/python bench/ingest.py [--rows 100000] [--response-kb 4] [--runs 5]
                                     [--flavours v1 legacy legacy-val]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
import uuid
from pathlib import Path

import orjson

from evotrainer.evidence.verl import ingest_dump, split_lines

FLAVOURS = ("v1", "legacy", "legacy-val")
GROUP = 8  # verl's n: 250 prompts x 8 samples a step at the default size
STEPS = 50
GOAL = 0.8


def write_dump(
    folder: Path, rows: int, steps: int, response_kb: float = 0.0, flavour: str = "v1"
) -> int:
    """verl-style JSONL dumps of `rows` rows over `steps` files, as `flavour` writes them;
    `response_kb` > 0 pads each response to about that size (verl users' run 1-8 KB).
    Returns the bytes written."""
    per_step = max(GROUP, rows // steps)
    padding = ("Let me check that step again. " * 300)[: int(response_kb * 1024)]
    size = 0
    for step in range(1, steps + 1):
        lines = []
        for g in range(per_step // GROUP):
            prompt_uid = uuid.uuid4().hex
            for s in range(GROUP):
                row = {
                    "input": f"<|user|>Problem {g}: compute {g} * {g + 1} and explain. " * 4,
                    "output": "Let me think step by step. " * 12
                    + padding
                    + f"The answer is {g * s}.",
                    "gts": str(g * s),
                    "score": float(s % 2),
                    "step": step,
                }
                if flavour == "v1":
                    row["uid"] = f"{prompt_uid}_{s}_0"
                elif flavour == "legacy":
                    # What backends/verl_reward returns beside the score.
                    row.update(index=g, acc=float(s % 2), data_source="bench/arith")
                else:  # legacy-val: validation dumps repeat verl's copy of the score
                    row["reward"] = row["score"]
                lines.append(json.dumps(row))
        path = folder / f"{step}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        size += path.stat().st_size
    return size


def bare_json(folder: Path) -> float:
    """Seconds a plain json.loads pass over every line of the dump takes, nothing kept."""
    start = time.perf_counter()
    for path in folder.glob("*.jsonl"):
        with open(path) as handle:
            for line in handle:
                json.loads(line)
    return time.perf_counter() - start


def bare_orjson(folder: Path) -> float:
    """The parser the ingest uses, bare: lines cut as the ingest cuts them (views, no
    copies); nothing kept, no table."""
    start = time.perf_counter()
    for path in folder.glob("*.jsonl"):
        for line in split_lines(path.read_bytes()):
            orjson.loads(line)
    return time.perf_counter() - start


def bench_flavour(rows: int, response_kb: float, flavour: str, runs: int) -> float:
    """Print one flavour's figures; returns the ingest's speed as a share of the parse's."""
    split = "val" if flavour == "legacy-val" else "train"
    group_size = None if flavour == "v1" else GROUP
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        size = write_dump(folder, rows, STEPS, response_kb, flavour)
        t_ingest = t_json = t_orjson = math.inf
        for _ in range(runs):
            start = time.perf_counter()
            result = ingest_dump(folder, version="bench", split=split, group_size=group_size)
            t_ingest = min(t_ingest, time.perf_counter() - start)
            t_json = min(t_json, bare_json(folder))
            t_orjson = min(t_orjson, bare_orjson(folder))
    # The bench's dumps are exact: a flavour that groups wrongly would report ambiguity here.
    assert not result.ambiguous and not result.skipped, (result.ambiguous, result.skipped)
    mb = size / 1e6
    ratio = t_json / t_ingest
    print(
        f"{flavour:<10} {result.rollouts.num_rows:>9,} rows {mb:6.0f} MB  ingest "
        f"{t_ingest:6.2f} s ({mb / t_ingest:4.0f} MB/s)  json.loads {t_json:6.2f} s  "
        f"-> {ratio:4.2f} of the parse's speed ({'ok' if ratio >= GOAL else 'under'} "
        f"goal >= {GOAL})  orjson alone {t_orjson:5.2f} s ({t_orjson / t_ingest:4.2f})"
    )
    return ratio


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000,
                        help=f"dumped rows, over {STEPS} steps (2,000 a step: 250 prompts x 8)")
    parser.add_argument("--response-kb", type=float, default=4.0,
                        help="size of each dumped response (verl's are 1-8 KB)")
    parser.add_argument("--runs", type=int, default=5, help="best of this many runs")
    parser.add_argument("--flavours", nargs="+", choices=FLAVOURS, default=list(FLAVOURS))
    args = parser.parse_args(argv)
    print(
        f"verl ingest vs a bare json.loads pass, {args.response_kb:g} KB responses, "
        f"{STEPS} files, best of {args.runs}"
    )
    return {
        flavour: bench_flavour(args.rows, args.response_kb, flavour, args.runs)
        for flavour in args.flavours
    }


if __name__ == "__main__":
    main()
