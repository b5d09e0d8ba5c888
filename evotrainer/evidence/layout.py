"""The one layout of a run's artifact dir. The embedded engine and the verl collect write it;
reconcile, diagnosis, backtests, the report and the trackers find files through it.

```
<artifact_dir>/rollouts/{train,val}.parquet   the canonical rollout table
<artifact_dir>/steps.parquet                  per-step metrics, long format
<artifact_dir>/scores.csv                     the final per-task score table
<artifact_dir>/result.json, train.log          the job's result and log
<artifact_dir>/progress.json                  the engine's progress (steps done, pace)
```
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunArtifacts:
    root: Path

    @property
    def rollouts_dir(self) -> Path:
        return self.root / "rollouts"

    def rollouts(self, split: str) -> Path:
        return self.rollouts_dir / f"{split}.parquet"

    @property
    def steps(self) -> Path:
        return self.root / "steps.parquet"

    @property
    def scores(self) -> Path:
        return self.root / "scores.csv"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def progress(self) -> Path:
        return self.root / "progress.json"
