"""`evotrainer reconcile`: apply the plan under the workspace lock, one commit per change."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from evotrainer.commands.plan import plan_table
from evotrainer.control.reconcile import Reconciler, VersionPlan
from evotrainer.store.lock import workspace_lock
from evotrainer.store.workspace import Workspace


def reconcile_workspace(ws: Workspace, wait: bool, console: Console) -> list[VersionPlan]:
    with workspace_lock(ws.state_dir / "lock", " ".join(["evotrainer", *sys.argv[1:]])):
        reconciler = Reconciler(ws, log=lambda line: console.print(f"[bold]→[/] {line}"))
        if not wait:
            return reconciler.run()
        with console.status("waiting for jobs") as status:

            def show(running: list[VersionPlan]) -> None:
                status.update(
                    "waiting for " + ", ".join(f"{p.version} ({p.health.lower()})" for p in running)
                )

            return reconciler.run(wait=True, on_wait=show)


def register(app: typer.Typer) -> None:
    @app.command("reconcile")
    def reconcile(
        wait: bool = typer.Option(
            False,
            "--wait",
            help="Block until running jobs finish and their results are diagnosed and gated.",
        ),
    ) -> None:
        """Launch approved versions, poll and collect jobs, diagnose, gate, promote or
        prune. Safe to rerun at any time: it converges to the same state."""
        console = Console()
        plans = reconcile_workspace(Workspace.find(), wait, console)
        console.print(plan_table(plans))
