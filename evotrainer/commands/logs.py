"""`evotrainer logs V [-f]`: the log of a version's job (train.log, or verl's log)."""

from __future__ import annotations

import typer

from evotrainer.control.jobs import follow_logs, version_job
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import clean


def register(app: typer.Typer) -> None:
    @app.command("logs")
    def logs(
        name: str = typer.Argument(..., help="Version whose job log to show."),
        follow: bool = typer.Option(False, "--follow", "-f", help="Follow until the job ends."),
        tail: int = typer.Option(200, "--tail", "-n", min=1, help="Lines to show."),
    ) -> None:
        """Print the last lines of the job's log; with -f, keep printing new lines until
        the job has finished."""
        current = version_job(Workspace.find(), name)
        if follow:
            for line in follow_logs(current):
                typer.echo(clean(line))  # plain text, not Rich: no markup
        else:
            text = current.backend.logs(current.job, tail=tail)
            if text:
                typer.echo(clean(text))
