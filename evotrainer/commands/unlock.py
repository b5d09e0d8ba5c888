"""`evotrainer unlock --force`: break a stale workspace lock."""

from __future__ import annotations

import typer

from evotrainer.errors import EvoError
from evotrainer.store.lock import break_lock, breakable, read_lock
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe


def register(app: typer.Typer) -> None:
    @app.command("unlock")
    def unlock(
        force: bool = typer.Option(False, "--force", help="Required: break the lock."),
        other_host: bool = typer.Option(
            False,
            "--other-host",
            help="Also break a lock held from another host (its process cannot be checked "
            "from here: make sure it is gone).",
        ),
    ) -> None:
        """Remove the workspace lock left by a reconcile that died, or an unreadable lock
        file. Refuses while the holder still runs (on this host)."""
        path = Workspace.find().state_dir / "lock"
        state = read_lock(path)
        if state is None:
            make_console().print("no lock held")
            return
        who = safe(state.describe())
        if not force:
            raise EvoError(f"lock held by {who}", where=str(path), hint="pass --force to break it")
        if state.foreign and not breakable(state):
            if not other_host:
                raise EvoError(
                    f"the lock is held from another host: {who}",
                    where=str(path),
                    hint="whether it still runs cannot be checked from here; if it is gone, "
                    "pass --other-host too",
                )
        elif not breakable(state):
            raise EvoError(
                f"the holder {who} is still running",
                where=str(path),
                hint="wait for it, or stop it first",
            )
        break_lock(path)
        make_console().print(f"broke the lock: {who}", highlight=False)
