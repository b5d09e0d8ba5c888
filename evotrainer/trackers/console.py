"""verl's two library-free loggers: `console` (one line per step) and `file` (verl's
FileLogger JSONL, `{"step": N, "data": {...}}` per line, which `evotrainer ingest verl
--metrics` reads back into the steps table)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from evotrainer.store.files import atomic_write, read_json
from evotrainer.terminal import clean
from evotrainer.trackers import TrackerRun


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ConsoleTracker:
    """`step:N - name:value - ...` as verl's console logger prints it."""

    name = "console"

    def __init__(self, emit: Callable[[str], None] | None = None) -> None:
        self.emit = emit or _stderr
        self.run_name = ""

    def start(self, run: TrackerRun) -> None:
        self.run_name = run.name

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        fields = " - ".join(f"{name}:{value:.4g}" for name, value in sorted(metrics.items()))
        self.emit(f"{self.run_name} step:{step} - {fields}")

    def summary(self, step: int, values: Mapping[str, float], tags: Mapping[str, str]) -> None:
        fields = [f"{k}:{v:.4g}" for k, v in sorted(values.items())]
        fields += [f"{clean(k)}:{clean(v)}" for k, v in sorted(tags.items())]  # untrusted text
        self.emit(f"{self.run_name} summary at step:{step} - " + " - ".join(fields))

    def close(self) -> None:
        pass  # nothing held open


class FileTracker:
    """`<run_dir>/metrics/seed<N>.jsonl` (steps) and `seed<N>.summary.json` (the run's tags
    and summary, merged across calls: a JSONL reader sees only step lines)."""

    name = "file"

    def __init__(self) -> None:
        self.handle: IO[str] | None = None
        self.summary_path: Path | None = None

    def start(self, run: TrackerRun) -> None:
        folder = run.run_dir / "metrics"
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"seed{run.tags.get('seed', '0')}"
        self.summary_path = folder / f"{stem}.summary.json"
        if run.replace:
            self.summary_path.unlink(missing_ok=True)
        # Append, unlike verl's "wb": a reopened run (the gate's summary) keeps its steps.
        self.handle = (folder / f"{stem}.jsonl").open("w" if run.replace else "a",
                                                      encoding="utf-8")
        self._merge_summary(run.tags)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        assert self.handle is not None, "start() first"
        self.handle.write(json.dumps({"step": step, "data": dict(metrics)}) + "\n")
        self.handle.flush()

    def summary(self, step: int, values: Mapping[str, float], tags: Mapping[str, str]) -> None:
        self._merge_summary({**values, **tags, "summary_step": step})

    def _merge_summary(self, entries: Mapping[str, object]) -> None:
        assert self.summary_path is not None, "start() first"
        current = read_json(self.summary_path) or {}
        atomic_write(self.summary_path,
                     json.dumps({**current, **entries}, indent=2, sort_keys=True) + "\n")

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
