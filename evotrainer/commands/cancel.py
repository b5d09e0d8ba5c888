"""`evotrainer cancel V`: stop a version's running job, recorded as Cancelled (not Failed)."""

from __future__ import annotations

import typer

from evotrainer.control.jobs import cancel_version
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe


def register(app: typer.Typer) -> None:
    @app.command("cancel")
    def cancel(
        name: str = typer.Argument(..., help="Version whose running job to stop."),
        by: str = typer.Option(None, "--by", help="Who asks (default: git user.name)."),
    ) -> None:
        """Stop the version's job (local: its process group; verl: Ray's stop_job or the
        local process) and record the run as Cancelled in one commit. Reconcile does not
        relaunch it until `evotrainer retry V`."""
        ws = Workspace.find()
        run = cancel_version(ws, name, by or ws.git.user())
        make_console().print(
            f"Cancelled {safe(name)} attempt {run['attempt']} ({safe(run['job_id'])}); "
            f"`evotrainer retry {safe(name)}` relaunches it",
            highlight=False,
        )
