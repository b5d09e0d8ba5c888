"""`evotrainer validate`: check every spec in the workspace and on every version branch."""

from __future__ import annotations

import json

import typer

from evotrainer.control.validation import validate_workspace
from evotrainer.errors import EvoError
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe


def register(app: typer.Typer) -> None:
    @app.command("validate")
    def validate(
        as_json: bool = typer.Option(False, "--json", help="Machine-readable (for CI)."),
        fmt: str = typer.Option("text", "--format", help="text or json (same as --json)."),
        ref: str = typer.Option(
            None,
            "--ref",
            help="Also validate the files at REF (a pull request's head) instead of the "
            "working tree.",
            metavar="REF",
        ),
    ) -> None:
        """Validate the project, harness revisions, skills, the spec at the tip of every
        evo/* branch and the specs in the working tree (or at --ref), with
        cross-references. Exit 0 valid, 1 invalid."""
        ws = None
        try:
            ws = Workspace.find()
            problems = validate_workspace(ws, ref=ref)
        except EvoError as err:
            problems = [err]
        if as_json or fmt == "json":
            print(
                json.dumps(
                    {"valid": not problems, "problems": [p.as_dict() for p in problems]}, indent=2
                )
            )
        else:
            console = make_console(stderr=bool(problems))
            for problem in problems:
                console.print(f"[red]✗[/] {safe(problem)}", highlight=False, soft_wrap=True)
            if not problems and ws is not None:
                count = len(ws.git.version_branches())
                console.print(f"[green]✓[/] workspace valid ({count} versions)")
        raise typer.Exit(1 if problems else 0)
