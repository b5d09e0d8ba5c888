"""`evotrainer gc [--dry-run]`: free the disk that dropped versions' trained policies hold."""

from __future__ import annotations

import sys

import typer

from evotrainer.control.retention import apply_gc, plan_gc, retention_policy
from evotrainer.store.lock import workspace_lock
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console, safe


def human_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value, unit = size / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def register(app: typer.Typer) -> None:
    @app.command("gc")
    def gc(
        dry_run: bool = typer.Option(
            False, "--dry-run", help="Show what would go; delete nothing."),
    ) -> None:
        """Delete the trained policies the project's retention policy no longer keeps
        (`retention.checkpoints`; default keep-promoted-and-open: pruned, reverted and
        inconclusive versions lose their weights). Rollouts, scores and records stay as
        evidence; each drop is recorded in the version's run.yaml, one commit on its branch."""
        ws = Workspace.find()
        out = console()
        with workspace_lock(ws.state_dir / "lock", " ".join(["evotrainer", *sys.argv[1:]])):
            policy = retention_policy(ws)
            drops, kept = plan_gc(ws)
            for name, why in kept.items():
                out.print(f"  keep {safe(name)}: {safe(why)}", highlight=False)
            for drop in drops:
                out.print(f"  drop {safe(drop.version)}: {safe(drop.reason)}, "
                          f"{human_bytes(drop.bytes)}", highlight=False)
            total = human_bytes(sum(d.bytes for d in drops))
            if dry_run:
                out.print(f"would free {total} (retention {policy}); nothing deleted")
                return
            apply_gc(ws, drops, policy)
            out.print(f"freed {total} (retention {policy}); rollouts and records kept")
