"""The same `loggers` on the verl backend: verl's own `trainer.logger` list (always with the
`file` logger, whose JSONL we ingest into steps.parquet) and the environment that points
verl's trackers at our local defaults and our run identity (verl/utils/tracking.py reads
TENSORBOARD_DIR, MLFLOW_TRACKING_URI, MLFLOW_RUN_ID and W&B's own WANDB_* variables)."""

from __future__ import annotations

import os

from evotrainer.trackers import TrackerRun, require
from evotrainer.trackers.mlflow_tracker import tracking_uri


def verl_loggers(loggers: list[str]) -> list[str]:
    """`trainer.logger`: the recipe's loggers in order, plus `file` if it is missing."""
    return loggers if "file" in loggers else [*loggers, "file"]


def verl_tracker_env(loggers: list[str], run: TrackerRun) -> dict[str, str]:
    """Environment for one verl job (one seed; `RunIdentity.read(run_dir, version)
    .tracker_run(run_dir, seed)` gives `run`). For MLflow the run is created here, tagged
    with the lineage, and handed over by id, so verl logs into it and the gate finds it."""
    env: dict[str, str] = {}
    if "tensorboard" in loggers:
        env["TENSORBOARD_DIR"] = str(run.run_dir / "tensorboard" / f"seed{run.tags['seed']}")
    if "wandb" in loggers:
        env |= {
            "WANDB_MODE": os.environ.get("WANDB_MODE") or "offline",
            "WANDB_DIR": str(run.run_dir),
            "WANDB_RUN_ID": run.key,
            "WANDB_RESUME": "allow",
            "WANDB_RUN_GROUP": run.version,
        }
    if "mlflow" in loggers:
        require("mlflow")
        from evotrainer.trackers.mlflow_tracker import MlflowTracker

        tracker = MlflowTracker()
        tracker.start(run)  # left RUNNING: verl ends it
        env |= {"MLFLOW_TRACKING_URI": tracking_uri(run), "MLFLOW_RUN_ID": str(tracker.run_id)}
    return env

