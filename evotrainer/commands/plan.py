"""`evotrainer plan`: what a reconcile would do, per version, and why (read-only)."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from evotrainer.control.decide import VersionPlan
from evotrainer.control.observe import load_context, plan
from evotrainer.store.records import JobState
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe

SYNC_STYLE = {"Synced": "green", "OutOfSync": "yellow", "Drifted": "magenta", "Invalid": "red"}
HEALTH_STYLE = {
    JobState.SUCCEEDED: "green",
    JobState.RUNNING: "blue",
    JobState.PENDING: "cyan",
    JobState.FAILED: "red",
    JobState.STALLED: "red",
    JobState.CANCELLED: "yellow",
    JobState.STOPPED: "red",
}


def plan_table(plans: list[VersionPlan]) -> Table:
    table = Table(title="plan", show_lines=False)
    for column in ("version", "sync", "health", "action", "why"):
        table.add_column(column)
    for p in plans:
        if p.error:
            why = f"[red]{safe(p.error)}[/]"
        else:
            why = safe(p.action.reason) if p.action else f"[dim]{safe(p.note)}[/]"
        table.add_row(
            safe(p.version),
            f"[{SYNC_STYLE.get(p.sync, 'white')}]{p.sync}[/]",
            f"[{HEALTH_STYLE.get(p.health, 'white')}]{safe(p.health)}[/]",
            f"[bold]{p.action.kind}[/]" if p.action else "[dim]—[/]",
            why,
        )
    return table


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command(
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """List the actions reconcile would take. Exit 0: nothing to do; 2: changes pending;
        1: error, such as a version `validate` rejects (terraform's -detailed-exitcode
        convention)."""
        plans = plan(load_context(Workspace.find()))
        pending = any(p.action for p in plans)
        invalid = [p.version for p in plans if p.error]
        if as_json:
            print(
                json.dumps(
                    {
                        "changes": pending,
                        "errors": len(invalid),
                        "versions": [p.as_dict() for p in plans],
                    },
                    indent=2,
                )
            )
        else:
            console = make_console()
            console.print(plan_table(plans))
            if invalid:
                console.print(
                    f"[red]refused:[/] {safe(', '.join(invalid))} (see `evotrainer validate`)"
                )
            console.print(
                "changes pending: run `evotrainer reconcile`" if pending else "nothing to do"
            )
        raise typer.Exit(1 if invalid else 2 if pending else 0)
