"""`evotrainer validate`: check every spec in the workspace and on every version branch."""

from __future__ import annotations

import json

import typer
from rich.console import Console

from evotrainer.errors import EvoError
from evotrainer.store.validation import validate_workspace
from evotrainer.store.workspace import Workspace


def register(app: typer.Typer) -> None:
    @app.command("validate")
    def validate(
        fmt: str = typer.Option("text", "--format", help="text or json (for CI)."),
    ) -> None:
        """Validate the project, harness revisions, skills and the spec at the tip of every
        evo/* branch, with cross-references. Exit 0 valid, 1 invalid."""
        try:
            ws = Workspace.find()
            problems = validate_workspace(ws)
        except EvoError as err:
            problems = [err]
        if fmt == "json":
            print(
                json.dumps(
                    {"valid": not problems, "problems": [p.as_dict() for p in problems]}, indent=2
                )
            )
        else:
            console = Console(stderr=bool(problems))
            for problem in problems:
                console.print(f"[red]✗[/] {problem}", highlight=False, soft_wrap=True)
            if not problems:
                console.print(f"[green]✓[/] workspace valid ({len(ws.versions())} versions)")
        raise typer.Exit(1 if problems else 0)
