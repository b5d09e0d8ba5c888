"""`evotrainer retry V`: give a failed run another attempt (a commit; reconcile launches it)."""

from __future__ import annotations

import typer

from evotrainer.control.reconcile import request_retry
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe


def register(app: typer.Typer) -> None:
    @app.command("retry")
    def retry(
        name: str = typer.Argument(..., help="Failed version to retry."),
        by: str = typer.Option(None, "--by", help="Who asks (default: git user.name)."),
    ) -> None:
        """Commit the next attempt of a Failed run, e.g. after an infrastructure failure
        (disk full) was fixed, or past `max_attempts`. The next `evotrainer reconcile`
        launches it; the version's approval must still hold."""
        ws = Workspace.find()
        record = request_retry(ws, name, by or ws.git.user())
        make_console().print(
            f"Retry of {safe(name)} recorded: attempt {record['attempt']} "
            f"({safe(record['job_id'])}); `evotrainer reconcile` launches it",
            highlight=False,
        )
