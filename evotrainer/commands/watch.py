"""`evotrainer watch [V]`: a live view of running versions — progress, the live diagnosis's
alerts and the early-stop decision — refreshed until their jobs end (or Ctrl-C).

Watching changes nothing in git: it reads the evidence written so far into the git-ignored
live state (control/live.py), the same reads and diagnosis reconcile makes; reconcile is
what stops a job an early-stop rule names."""

from __future__ import annotations

import json
import time

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from evotrainer.control.live import LiveView, observe_running
from evotrainer.control.reconcile import load_context
from evotrainer.errors import EvoError
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console, safe

SEVERITY_STYLE = {"critical": "red", "warning": "yellow"}


def watched(ws: Workspace, version: str | None) -> list[LiveView]:
    """One live look at each running version (or at `version`)."""
    ctx = load_context(ws)
    if version is not None:
        state = ws.version(version, ctx.states)
        run = state.run
        if run is None or not run.active:
            raise EvoError(
                f"{version} has no running job (state: {run.state if run else 'not run'})",
                hint="`evotrainer plan` shows what reconcile does next",
            )
        states = [state]
    else:
        states = [s for s in ctx.states.values() if s.run and s.run.active]
    return [observe_running(ws, s, s.records["run"], ctx.harness) for s in states]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def watch_table(views: list[LiveView]) -> Table | Text:
    if not views:
        return Text("no running job")
    table = Table(title="live runs")
    for column in ("version", "progress", "elapsed", "left", "rollouts", "alerts", "early stop"):
        table.add_column(column)
    for view in views:
        share = f" ({view.step / view.steps:.0%})" if view.steps else ""
        alerts = (view.diagnosis or {}).get("alerts") or []
        shown = ", ".join(
            f"[{SEVERITY_STYLE.get(a['severity'], 'white')}]{safe(a['name'])}[/]" for a in alerts
        )
        if view.diagnosis is None:
            shown = "[dim]no evidence yet[/]"
        stop = (
            f"[bold red]stop: {safe(view.stop['rule'])}[/] at step {view.stop['step']} "
            "(reconcile cancels it)"
            if view.stop
            else "[dim]—[/]"
        )
        table.add_row(
            safe(view.version),
            f"step {view.step} of {view.steps}{share}",
            _duration(view.elapsed_s),
            _duration(view.eta_s),
            f"{view.rows} train, {view.val_rows} val",
            shown or "[green]none[/]",
            stop,
        )
    return table


def register(app: typer.Typer) -> None:
    @app.command("watch")
    def watch_command(
        version: str = typer.Argument(None, help="One version (default: every running one)."),
        once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
        interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between looks."),
        as_json: bool = typer.Option(False, "--json", help="One machine-readable snapshot."),
    ) -> None:
        """Watch running jobs: progress (step of steps, time left), the alerts of the live
        diagnosis and whether an early-stop rule of the harness holds. Reads only; reconcile
        stops a job an early-stop rule names."""
        ws = Workspace.find()
        if as_json:
            print(json.dumps([v.as_dict() for v in watched(ws, version)], indent=2))
            return
        out = console()
        if once:
            out.print(watch_table(watched(ws, version)))
            return
        views = watched(ws, version)
        try:
            with Live(watch_table(views), console=out, auto_refresh=False) as live:
                while views:
                    time.sleep(interval)
                    views = watched(ws, version) if version is None else _still(ws, version)
                    live.update(Group(watch_table(views)), refresh=True)
        except KeyboardInterrupt:
            pass
        if not out.is_terminal:  # a live display piped to a file ends its last frame bare
            out.line()


def _still(ws: Workspace, version: str) -> list[LiveView]:
    """`version`'s live look while its job runs; none once it ended."""
    try:
        return watched(ws, version)
    except EvoError:
        return []
