"""`evotrainer unlock --force`: break a stale workspace lock."""

from __future__ import annotations

import typer
from rich.console import Console

from evotrainer.errors import EvoError
from evotrainer.store.lock import holder, is_stale
from evotrainer.store.workspace import Workspace


def register(app: typer.Typer) -> None:
    @app.command("unlock")
    def unlock(
        force: bool = typer.Option(False, "--force", help="Required: break the lock."),
    ) -> None:
        """Remove the workspace lock left by a reconcile that died. Refuses while the
        holder still runs."""
        path = Workspace.find().state_dir / "lock"
        info = holder(path)
        if info is None:
            Console().print("no lock held")
            return
        if not force:
            raise EvoError(
                f"lock held by {info.get('command')!r} (pid {info.get('pid')})",
                where=str(path),
                hint="pass --force to break it",
            )
        if not is_stale(info):
            raise EvoError(
                f"the holder (pid {info.get('pid')} on {info.get('host')}) is still running",
                where=str(path),
                hint="wait for it, or stop it first",
            )
        path.unlink()
        Console().print(f"broke stale lock of pid {info.get('pid')}")
