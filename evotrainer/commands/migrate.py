"""`evotrainer migrate`: bring a workspace made by an older evotrainer to this layout."""

from __future__ import annotations

import typer

from evotrainer.store.builtin import HARNESS_FOLDER
from evotrainer.store.workspace import OLD_HARNESS_FOLDER, Workspace
from evotrainer.terminal import console


def register(app: typer.Typer) -> None:
    @app.command("migrate")
    def migrate() -> None:
        """Move harness_versions/ (where an older evotrainer kept the harness revisions) to
        harness_revisions/: one commit on main, each file keeping its content and history.
        Records, digests and version branches stay as they are; a branch made before the
        move merges into main under the new name. A workspace in this layout is left as is."""
        moved = Workspace.find(migrating=True).migrate()
        if not moved:
            console().print(f"nothing to migrate: main holds no {OLD_HARNESS_FOLDER}/")
            return
        console().print(f"moved {moved} file(s) from {OLD_HARNESS_FOLDER}/ to "
                        f"{HARNESS_FOLDER}/ in one commit on main; next: `evotrainer validate`",
                        highlight=False)
