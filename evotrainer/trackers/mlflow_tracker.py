"""MLflow through its client (no global active run): by default a SQLite store at
`<artifact_root>/mlflow.db` (`mlflow ui --backend-store-uri sqlite:///...` reads it);
`MLFLOW_TRACKING_URI` / `MLFLOW_EXPERIMENT_NAME` (and MLflow's own credential variables)
point it elsewhere. The experiment is the project; a run per version and seed, found again by
its `evotrainer.run_key` tag when the gate adds its summary."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from evotrainer.trackers import TrackerRun

KEY_TAG = "evotrainer.run_key"
STORE_FILE = "mlflow.db"


def tracking_uri(run: TrackerRun) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run.store_root / STORE_FILE}"


class MlflowTracker:
    name = "mlflow"

    def __init__(self) -> None:
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, run: TrackerRun) -> None:
        from mlflow.tracking import MlflowClient

        run.store_root.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=tracking_uri(run))
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run.project
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(experiment_name))
        existing = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{run.key}'")
        if run.replace:
            for old in existing:  # an export replaces the run (a soft delete: restorable)
                self.client.delete_run(old.info.run_id)
            existing = []
        if existing:
            self.run_id = existing[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(
                experiment_id, run_name=run.name, tags={**run.tags, KEY_TAG: run.key}
            ).info.run_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(name, value, now, step) for name, value in metrics.items()]
        )

    def summary(self, step: int, values: Mapping[str, float], tags: Mapping[str, str]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id,
            metrics=[Metric(name, value, now, step) for name, value in values.items()],
            tags=[RunTag(key, value) for key, value in tags.items()],
        )

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None
