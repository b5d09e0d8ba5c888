"""`evotrainer approve V`: commit the approval (who, when, what) onto the version's branch."""

from __future__ import annotations

import typer

from evotrainer.control.versions import approve as approve_version
from evotrainer.store.workspace import Workspace, version_spec_path
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe


def register(app: typer.Typer) -> None:
    @app.command("approve")
    def approve(
        name: str = typer.Argument(..., help="Version to approve."),
        by: str = typer.Option(None, "--by", help="Approver (default: git user.name)."),
    ) -> None:
        """Approve a version so reconcile may launch it. Review `git diff main...evo/V`
        first: everything promotion would merge into main, files pushed onto a parent
        included. The approval binds the whole branch (spec, resolved recipe, every other
        file it would merge) and is sealed with this controller's record key (signed too
        where main keeps spec/allowed_signers): any later change needs a new approval."""
        ws = Workspace.find()
        states = ws.versions()
        already = ws.approval_status(ws.version(name, states), states) == "approved"
        approval = approve_version(ws, name, by)["approval"]
        verb = "Already approved:" if already else "Approved"
        out = make_console()
        out.print(
            f"{verb} {safe(name)} (by {safe(approval['by'])} at {safe(approval['at'])}, "
            f"{approval['digest'][:19]})",
            highlight=False,
        )
        # What the approval lets into main besides the spec: said, never left to a diff
        # against the parent that cannot show a parent's own later pushes.
        states = ws.versions()
        others = [path for _, path in ws.merge_changes(states[name], states)
                  if path != version_spec_path(name)]
        if others:
            shown = ", ".join(others[:20]) + (f" and {len(others) - 20} more"
                                              if len(others) > 20 else "")
            out.print(f"It also brings into main {len(others)} file(s) besides its spec: "
                      f"{safe(shown)} (git diff main...evo/{safe(name)})", highlight=False)
