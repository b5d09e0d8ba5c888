"""The `evotrainer` command line. Each command lives in its own module under
`evotrainer/commands/` and registers itself on the app (as pre-commit's `commands/`)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from pathlib import Path

import typer
from rich.console import Console

from evotrainer import commands
from evotrainer.errors import EvoError

# Order here is the order of `evotrainer --help`; command modules not listed follow, by name.
COMMAND_ORDER = [
    "init",
    "validate",
    "version",
    "lineage",
    "approve",
    "plan",
    "reconcile",
    "unlock",
    "train",
    "ingest",
    "diagnose",
    "compare",
    "skills",
    "backtest",
    "propose",
    "evolve",
    "harness",
    "render",
    "report",
]

app = typer.Typer(
    name="evotrainer",
    help="RL post-training as reviewable git history: versions are branches, "
    "the harness is data, reconcile makes the records match the specs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root(
    directory: Path = typer.Option(
        None, "-C", help="Run as if started in DIR (like git -C).", metavar="DIR"
    ),
) -> None:
    if directory is not None:
        if not directory.is_dir():
            raise EvoError(f"-C {directory}: no such directory")
        os.chdir(directory)


def _command_modules() -> list[str]:
    found = {m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")}
    return [n for n in COMMAND_ORDER if n in found] + sorted(found - set(COMMAND_ORDER))


for _name in _command_modules():
    importlib.import_module(f"evotrainer.commands.{_name}").register(app)


def main() -> None:
    """Run the CLI; an EvoError becomes one paragraph on stderr and exit code 1."""
    try:
        app()
    except EvoError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(1)
