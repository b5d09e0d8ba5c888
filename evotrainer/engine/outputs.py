"""What a run leaves under its artifact dir, written atomically (temp file, then rename) so a
crash never leaves half a file: rollouts/{train,val}.parquet, steps.parquet, scores.csv,
result.json; plus the train.log / terminal progress."""

from __future__ import annotations

import csv
import io
import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import Progress

from evotrainer.evidence.layout import RunArtifacts
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.evidence.steps import STEPS_SCHEMA
from evotrainer.store.files import atomic_write

SCORE_COLUMNS = ["seed", "task_id", "data_source", "sample_idx", "correct"]
# train.log lines start with this timestamp; a finished training step's line is STEP_LINE.
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
STEP_LINE = re.compile(r"^(\S+ \S+) seed (\d+) step (\d+): reward ", re.MULTILINE)


class Stopped(BaseException):
    """The job was told to stop (SIGTERM: `evotrainer cancel`, a harness early stop). A
    BaseException, as SystemExit is, so that no `except Exception` on the way out (a
    domain's, a library's) swallows it; train.log and result.json name it."""


def seconds_per_step(log_text: str) -> float | None:
    """The training pace in train.log: the mean gap between consecutive step lines of one
    seed, so loading, GGUF conversion and the warm start before a seed's first step are not
    counted as steps (they made a job whose steps take seconds look a quarter of an hour from
    done). None until some seed has logged two steps."""
    previous: dict[str, datetime] = {}
    gaps: list[float] = []
    for stamp, seed, _ in STEP_LINE.findall(log_text):
        try:
            at = datetime.strptime(stamp, LOG_TIME_FORMAT)
        except ValueError:
            continue
        if seed in previous:
            gaps.append((at - previous[seed]).total_seconds())
        previous[seed] = at
    return sum(gaps) / len(gaps) if gaps else None


def write_parquet(path: Path, rows: list[dict[str, Any]], schema: pa.Schema) -> None:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink)
    atomic_write(path, sink.getvalue())


def write_json(path: Path, value: Any) -> None:
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


class RunOutputs:
    """Accumulates a run's rows (all seeds) and rewrites the files on `flush`."""

    def __init__(self, out_dir: Path, version: str) -> None:
        self.out_dir = out_dir
        self.files = RunArtifacts(out_dir)
        self.version = version
        self.rollouts: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
        self.steps: list[dict[str, Any]] = []
        self.scores: list[dict[str, Any]] = []

    def metric(self, seed: int, step: int, name: str, value: float) -> None:
        self.steps.append(
            {
                "version": self.version,
                "seed": seed,
                "step": step,
                "metric": name,
                "value": float(value),
            }
        )

    def flush(self) -> None:
        for split, rows in self.rollouts.items():
            write_parquet(self.files.rollouts(split), rows, ROLLOUT_SCHEMA)
        write_parquet(self.files.steps, self.steps, STEPS_SCHEMA)
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=SCORE_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.scores)
        atomic_write(self.files.scores, text.getvalue().encode())


class RunLog:
    """Timestamped lines into train.log; on the terminal a rich progress bar when attached to a
    TTY, plain lines on stderr otherwise, nothing when `progress` is off."""

    def __init__(self, path: Path, progress: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")
        self.terminal = progress
        self.bar: Progress | None = None

    def __call__(self, message: str) -> None:
        line = f"{time.strftime(LOG_TIME_FORMAT)} {message}"
        self.file.write(line + "\n")
        self.file.flush()
        if self.bar is not None:
            self.bar.console.print(message, highlight=False)
        elif self.terminal:
            print(line, file=sys.stderr, flush=True)

    @contextmanager
    def steps(self, total: int, description: str) -> Iterator[Any]:
        """Yields `advance()`: one call per finished step."""
        if not (self.terminal and sys.stderr.isatty()):
            yield lambda: None
            return
        with Progress(console=Console(stderr=True), transient=True) as bar:
            self.bar = bar
            task = bar.add_task(description, total=total)
            try:
                yield lambda: bar.advance(task)
            finally:
                self.bar = None

    def close(self) -> None:
        self.file.close()
