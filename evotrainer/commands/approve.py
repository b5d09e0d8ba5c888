"""`evotrainer approve V`: commit the approval (who, when) onto the version's branch."""

from __future__ import annotations

import typer
from rich.console import Console

from evotrainer.control.versions import approve as approve_version
from evotrainer.store.workspace import Workspace


def register(app: typer.Typer) -> None:
    @app.command("approve")
    def approve(
        name: str = typer.Argument(..., help="Version to approve."),
        by: str = typer.Option(None, "--by", help="Approver (default: git user.name)."),
    ) -> None:
        """Approve a version so reconcile may launch it. Review `git diff evo/PARENT..evo/V`
        first. Approving again after editing the spec re-approves it for retraining."""
        spec = approve_version(Workspace.find(), name, by)
        approval = spec["approval"]
        Console().print(f"Approved {name} (by {approval['by']} at {approval['at']})")
