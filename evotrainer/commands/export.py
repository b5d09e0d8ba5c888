"""`evotrainer export [V...] --to TARGET`: recorded versions into an experiment tracker, or
one version's trained policy into a directory.

TARGET is a tracker name (tensorboard, mlflow, wandb), else a directory: `export V --to DIR`
writes V's policy as a plain Hugging Face directory with a model card, and `export main --to
DIR` the promoted frontier's. A directory that happens to be called like a tracker is
written `./tensorboard`."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from evotrainer.agent.planners.base import View
from evotrainer.control.policy_export import export_policy
from evotrainer.errors import EvoError
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console, safe
from evotrainer.trackers.mlflow_tracker import STORE_FILE
from evotrainer.trackers.records import export_version

TRACKER_TARGETS = ("tensorboard", "mlflow", "wandb")


def where_to_look(tracker: str, ws: Workspace) -> str:
    """How the user opens what was written."""
    root = ws.artifact_root
    if tracker == "tensorboard":
        return f"tensorboard --logdir {root}"
    if tracker == "mlflow":
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root.resolve() / STORE_FILE}"
        return f"mlflow ui --backend-store-uri {uri}"
    if os.environ.get("WANDB_MODE", "offline") == "offline":
        return f"wandb sync {root}/*/*/wandb/offline-run-*  (offline runs; upload when you choose)"
    return "the W&B project page"


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export(
        versions: list[str] = typer.Argument(
            None, help="Versions to export (default: every version with a finished run)."),
        to: str = typer.Option(
            ..., "--to", metavar="DIR|TRACKER",
            help="A new directory for one version's trained policy (HF format), or "
            "tensorboard, mlflow or wandb."),
    ) -> None:
        """Export a trained policy to a folder, or recorded runs to an experiment tracker.

        `export V --to DIR` (or `export main --to DIR`, the promoted frontier) writes the
        version's trained weights, config and tokenizer as a plain Hugging Face directory
        with a model card, checked against the recorded digest; DIR must be new or empty.

        `export [V...] --to tensorboard|mlflow|wandb` writes one run per version and seed
        with its lineage tags, every step's metrics from steps.parquet, and the gate's
        verdict, Δ, CI and alerts as the run's summary. Local by default (W&B offline,
        MLflow's SQLite store in the artifact root); exporting again replaces."""
        ws = Workspace.find()
        states = ws.versions()
        if to not in TRACKER_TARGETS:
            if not versions or len(versions) != 1:
                raise EvoError(
                    f"--to {to}: a policy export takes exactly one version (or main)",
                    field="VERSIONS", hint=f"evotrainer export v3 --to {to}",
                )
            name = versions[0]
            if name == "main" and "main" not in states:
                name = View.load(ws).frontier()  # the latest promoted version
            target = export_policy(ws, name, Path(to), states)
            console().print(f"{safe(name)}: trained policy → {safe(str(target))} "
                            "(Hugging Face directory with README.md)")
            return
        names = versions or [
            name for name, state in states.items()
            if state.run and state.run.succeeded
        ]
        if not names:
            raise EvoError("no version has a finished run yet",
                       hint="run `evotrainer reconcile` first")
        out = console()
        for name in names:
            done = export_version(ws, name, [to], states)
            out.print(f"{safe(name)}: {len(done.seeds)} seed(s), {done.steps} step(s) → {to}")
        out.print(f"open it with: {safe(where_to_look(to, ws))}")
