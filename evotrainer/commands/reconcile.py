"""`evotrainer reconcile`: apply the plan under the workspace lock, one commit per change."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from evotrainer.commands.plan import plan_table
from evotrainer.control.reconcile import Reconciler, VersionPlan, error_plan
from evotrainer.store.lock import workspace_lock
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe

# Versions awaiting approval shown one a row after a reconcile; the rest are counted.
SHOWN_WAITING = 20


def reconcile_workspace(ws: Workspace, wait: bool, console: Console) -> list[VersionPlan]:
    """Apply the plan; the plans returned carry each version's error, if it had one."""
    with workspace_lock(ws.state_dir / "lock", " ".join(["evotrainer", *sys.argv[1:]])):
        reconciler = Reconciler(ws, log=lambda line: console.print(f"[bold]→[/] {safe(line)}"))
        if not wait:
            return _with_errors(reconciler.run(), reconciler)
        with console.status("waiting for jobs") as status:

            def show(running: list[VersionPlan]) -> None:
                status.update(
                    "waiting for "
                    + ", ".join(f"{safe(p.version)} ({p.health.lower()})" for p in running)
                )

            return _with_errors(reconciler.run(wait=True, on_wait=show), reconciler)


def _with_errors(plans: list[VersionPlan], reconciler: Reconciler) -> list[VersionPlan]:
    """The final plans, plus an error row for a version whose action failed earlier in
    the run (its final plan may look quiet: the failure must still set the exit code)."""
    shown = {p.version for p in plans if p.error}
    return plans + [
        error_plan(version, message)
        for version, message in reconciler.errors.items()
        if version not in shown
    ]


def register(app: typer.Typer) -> None:
    @app.command("reconcile")
    def reconcile(
        wait: bool = typer.Option(
            False,
            "--wait",
            help="Block until running jobs finish and their results are diagnosed and gated.",
        ),
    ) -> None:
        """Launch approved versions, poll and collect jobs, diagnose, gate, promote or
        prune. Safe to rerun at any time: it converges to the same state. A version that
        fails (invalid spec, backend error) is reported and the others go ahead; exit 1
        when any failed."""
        console = make_console()
        plans = reconcile_workspace(Workspace.find(), wait, console)
        waiting = [p for p in plans if p.action is None and not p.error
                   and p.note.startswith("awaiting approval")]
        if len(waiting) > SHOWN_WAITING:  # thousands of proposals: a count, not a row each
            hidden = {p.version for p in waiting[SHOWN_WAITING:]}
            console.print(plan_table([p for p in plans if p.version not in hidden]))
            console.print(f"… and {len(hidden)} more versions awaiting approval "
                          "(`evotrainer plan` lists every version)")
        else:
            console.print(plan_table(plans))
        failed = [p.version for p in plans if p.error]
        if failed:
            console.print(f"[red]errors:[/] {safe(', '.join(failed))}; the others went ahead")
            raise typer.Exit(1)
