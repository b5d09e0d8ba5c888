"""`evotrainer lineage`: the version tree with states, scores and verdicts."""

from __future__ import annotations

import json

import typer
from rich.tree import Tree

from evotrainer.store.lineage import LineageRow, lineage_rows, stopped_text
from evotrainer.store.records import JobState, Verdict
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe

STATUS_STYLE = {
    Verdict.PROMOTE: "green",
    Verdict.PRUNE: "red",
    Verdict.REVERT: "red",
    Verdict.INCONCLUSIVE: "yellow",
    Verdict.BASELINE: "cyan",
    JobState.FAILED: "red",
    JobState.RUNNING: "blue",
    JobState.STOPPED: "red",
    "proposed": "dim",
    "stale": "magenta",
}


def describe(row: LineageRow) -> str:
    style = STATUS_STYLE.get(row.status, "white")
    parts = [f"[bold]{safe(row.name)}[/]", f"[{style}]{safe(row.status)}[/]"]
    if row.score is not None:
        parts.append(f"avg@k {row.score:.3f}")
    if row.delta is not None and row.ci is not None:
        parts.append(f"Δ {row.delta:+.3f} [{row.ci[0]:+.3f}, {row.ci[1]:+.3f}]")
        if row.against != row.parent:
            parts.append(f"vs {safe(row.against or '?')}")
    if row.stopped is not None:
        parts.append(f"[red]{safe(stopped_text(row.stopped))}[/]")
    if row.alerts:
        parts.append("[red]alerts: " + safe(", ".join(row.alerts)) + "[/]")
    if row.pruned:
        parts.append("[dim](pruned, kept as negative evidence)[/]")
    if row.spend:
        parts.append(f"[dim]spent {safe(row.spend.text())}[/]")
    return "  ".join(parts)


def lineage_tree(rows: list[LineageRow]) -> Tree:
    tree = Tree("[bold]lineage[/]")
    nodes = {}
    for row in rows:
        nodes[row.name] = nodes.get(row.parent, tree).add(describe(row))
    return tree


def register(app: typer.Typer) -> None:
    @app.command("lineage")
    def lineage(as_json: bool = typer.Option(False, "--json", help="Machine-readable.")) -> None:
        """Show every version as a tree: state, Avg@k, difference to the parent with its
        CI, alerts, verdict and what it spent (steps, hours, GPU-hours, planner
        tokens)."""
        rows = lineage_rows(Workspace.find())
        if as_json:
            print(json.dumps([r.as_dict() for r in rows], indent=2))
            return
        make_console().print(lineage_tree(rows))
