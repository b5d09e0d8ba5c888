"""`evotrainer init DIR`: scaffold a workspace from the built-in library."""

from __future__ import annotations

from pathlib import Path

import typer

from evotrainer.control.scaffold import BASELINE, examples, init_workspace
from evotrainer.store.git import branch_name
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe


def register(app: typer.Typer) -> None:
    @app.command("init")
    def init(
        directory: Path = typer.Argument(..., help="New workspace directory."),
        example: str = typer.Option(
            "arith", "--example", help="Starting project: " + ", ".join(examples()) + "."
        ),
        model: Path | None = typer.Option(
            None, "--model", help="Train this local checkpoint (a save_pretrained directory "
            "or a .gguf file) instead of the example's model; its folder becomes a data root.",
        ),
    ) -> None:
        """Create a workspace: a git repo with the project spec, the built-in harness and
        skills, and the baseline version v0 on branch evo/v0."""
        root = init_workspace(directory, example, model)
        console = make_console()
        console.print(
            f"Initialised workspace [bold]{safe(str(root))}[/] ({example}): "
            f"main + {branch_name(BASELINE)}"
        )
        # Paths and names here are the user's: printed, never read as markup.
        console.print(f"Next: cd {safe(str(root))} && evotrainer evolve --rounds 4 --approve "
                      "(evaluates v0, then the planner proposes versions and they train), or by "
                      "hand: evotrainer version new v1 --parent v0 --rationale '...'")
