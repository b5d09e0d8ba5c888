"""TensorBoard: event files under `<run_dir>/tensorboard/seed<N>`, so `tensorboard --logdir
<artifact_root>` shows every version and seed as `<version>/<job>/tensorboard/seed<N>`.
Metrics are scalars under their recorded names; the lineage tags and the summary's text are
text summaries (`tags/<key>`, `summary/<key>`); summary values are scalars at the last
step."""

from __future__ import annotations

import shutil
from collections.abc import Mapping

from evotrainer.trackers import TrackerRun


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self) -> None:
        self.writer = None

    def start(self, run: TrackerRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = run.run_dir / "tensorboard" / f"seed{run.tags.get('seed', '0')}"
        if run.replace and log_dir.is_dir():
            shutil.rmtree(log_dir)  # only this run's own event files
        self.writer = SummaryWriter(log_dir=str(log_dir))
        for key, value in sorted(run.tags.items()):
            self.writer.add_text(f"tags/{key}", value, global_step=0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        assert self.writer is not None, "start() first"
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def summary(self, step: int, values: Mapping[str, float], tags: Mapping[str, str]) -> None:
        assert self.writer is not None, "start() first"
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        for key, text in tags.items():
            self.writer.add_text(key, text, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
