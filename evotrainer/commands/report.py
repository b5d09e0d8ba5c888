"""`evotrainer report`: write the static HTML report of the workspace (and open it)."""

from __future__ import annotations

import webbrowser
from pathlib import Path

import typer

from evotrainer.report import build_report
from evotrainer.store.workspace import STATE_DIR, Workspace


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        out: Path = typer.Option(
            None, "--out", metavar="DIR",
            help=f"Folder to write (default: {STATE_DIR}/report in the workspace, git-ignored).",
        ),
        open_it: bool = typer.Option(False, "--open", help="Open the index in a web browser."),
    ) -> None:
        """Write a self-contained static site: the lineage graph, a page per version
        (intervention, recipe diff, metrics, alerts with example rollouts, gate decision),
        harness revisions and skills. No script, no network."""
        ws = Workspace.find()
        index = build_report(ws, out if out is not None else ws.state_dir / "report")
        print(index)
        if open_it:
            webbrowser.open(index.as_uri())
