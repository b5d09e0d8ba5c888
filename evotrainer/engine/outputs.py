"""What a run leaves under its artifact dir, written atomically (temp file, then rename) so a
crash never leaves half a file: rollouts/{train,val}.parquet, steps.parquet, scores.csv,
result.json, progress.json; plus the train.log / terminal progress. The progress record is
data (`ProgressRecord` writes it, `read_progress` is its one reader): reconcile and `watch`
read it instead of parsing the log's text."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
# train.log lines start with this timestamp.
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


class Stopped(BaseException):
    """The job was told to stop (SIGTERM: `evotrainer cancel`, a harness early stop). A
    BaseException, as SystemExit is, so that no `except Exception` on the way out (a
    domain's, a library's) swallows it; train.log and result.json name it."""


def write_parquet(path: Path, rows: list[dict[str, Any]], schema: pa.Schema) -> None:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink)
    atomic_write(path, sink.getvalue())


def write_json(path: Path, value: Any) -> None:
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


@dataclass(frozen=True)
class JobProgress:
    """What a reader takes from progress.json: training steps finished over all seeds and
    the steps' own pace in seconds (None before the first step)."""

    steps_done: int
    seconds_per_step: float | None


class ProgressRecord:
    """progress.json, rewritten atomically after each training step and evaluation: the
    current seed and its step, steps done and total over all seeds, the latest step's wall
    time, the last evaluation, and `stepping_s`: wall seconds since each seed's first step
    started, summed over seeds. Loading, GGUF conversion, the warm start and the step-0
    evaluation come before a seed's first step, so they are not in it: the pace
    (`stepping_s / steps_done`) is the steps' own, the evaluations between them included
    (they recur until the end, start-up does not)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.clock = path, clock  # tests give a fake clock, for exact figures
        self.seed: int | None = None
        self.step = 0
        self.steps_total = 0
        self.done_before = 0  # steps of the seeds already finished
        self.spent_before = 0.0  # their stepping seconds
        self.stepping_s = 0.0
        self.step_s: float | None = None
        self.evaluation: dict[str, Any] | None = None
        self.started: float | None = None  # when the current seed's first step began

    def begin_seed(self, seed: int, steps_total: int) -> None:
        """A seed's run starts (before its step-0 evaluation); its clock starts at step 1."""
        self.done_before += self.step
        self.spent_before = self.stepping_s
        self.seed, self.step, self.steps_total, self.started = seed, 0, steps_total, None
        self.write()

    def stepped(self, step: int, step_s: float) -> None:
        now = self.clock()
        if self.started is None:
            self.started = now - step_s
        self.step, self.step_s = step, step_s
        self.stepping_s = self.spent_before + (now - self.started)
        self.write()

    def evaluated(self, step: int, val_avg: float) -> None:
        if self.started is not None:  # an evaluation between steps is part of their pace
            self.stepping_s = self.spent_before + (self.clock() - self.started)
        self.evaluation = {"seed": self.seed, "step": step, "val_avg": val_avg}
        self.write()

    def write(self) -> None:
        write_json(self.path, {
            "seed": self.seed,
            "step": self.step,
            "steps_done": self.done_before + self.step,
            "steps_total": self.steps_total,
            "step_s": self.step_s,
            "stepping_s": round(self.stepping_s, 6),
            "evaluation": self.evaluation,
        })


def read_progress(artifact_dir: Path) -> JobProgress | None:
    """The job's progress record, or None when it is missing, torn or not what the engine
    writes (the job's folder is the job's to write: a reader takes numbers, checked)."""
    try:
        record = json.loads(RunArtifacts(artifact_dir).progress.read_bytes())
        done, total, spent = record["steps_done"], record["steps_total"], record["stepping_s"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (done, total)) or not (
        0 <= done <= total
    ):
        return None
    if isinstance(spent, bool) or not isinstance(spent, (int, float)) or not (
        math.isfinite(spent) and spent >= 0
    ):
        return None
    return JobProgress(done, spent / done if done else None)


class RunOutputs:
    """Accumulates a run's rows (all seeds) and rewrites the files on `flush`."""

    def __init__(self, out_dir: Path, version: str) -> None:
        self.out_dir = out_dir
        self.files = RunArtifacts(out_dir)
        self.version = version
        self.rollouts: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
        self.steps: list[dict[str, Any]] = []
        self.scores: list[dict[str, Any]] = []
        self.progress = ProgressRecord(self.files.progress)

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
