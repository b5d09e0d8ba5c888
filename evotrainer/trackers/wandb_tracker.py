"""Weights & Biases, offline by default: the run's files under `<run_dir>/wandb/` (`wandb
sync` uploads them later, if the user wants). `WANDB_MODE`, `WANDB_PROJECT`, `WANDB_ENTITY`
and `WANDB_API_KEY` from the environment are W&B's own switches; we never log in. A run per
version and seed (grouped by version), reopened by its id when the gate adds its summary."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

from evotrainer.trackers import TrackerRun

MAX_TAG = 64  # W&B rejects longer tags


class WandbTracker:
    name = "wandb"

    def __init__(self) -> None:
        self.run: Any = None

    def start(self, run: TrackerRun) -> None:
        import wandb

        if run.replace:  # an export replaces this run's offline files, nobody else's
            for old in (run.run_dir / "wandb").glob(f"offline-run-*-{run.key}"):
                shutil.rmtree(old)
        labels = [f"{key}:{run.tags[key]}" for key in ("version", "parent", "harness")
                  if run.tags.get(key)]
        labels += [f"skill:{s}" for s in run.tags.get("skills", "").split(",") if s]
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or run.project,
            name=run.name,
            id=run.key,
            resume="allow",
            group=run.version,
            job_type="train",
            tags=[label[:MAX_TAG] for label in labels],
            config=dict(run.tags),
            dir=str(run.run_dir),
            mode=os.environ.get("WANDB_MODE") or "offline",
            settings=wandb.Settings(
                silent=True, console="off", disable_git=True, save_code=False,
                x_disable_stats=True, x_disable_meta=True,
            ),
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def summary(self, step: int, values: Mapping[str, float], tags: Mapping[str, str]) -> None:
        self.run.summary.update({**values, **tags})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
