"""`evotrainer propose`: let a planner propose the next versions (unapproved branches)."""

from __future__ import annotations

import sys
from collections.abc import Collection

import typer
from rich.console import Console
from rich.table import Table

from evotrainer.agent.planners.base import PLANNERS, PlannerResult
from evotrainer.agent.propose import propose
from evotrainer.store.lock import workspace_lock
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe

PLANNER_HELP = f"Planner: {' or '.join(PLANNERS)} (default: the project's planner.name)."


def proposals_table(result: PlannerResult) -> Table:
    table = Table(title="proposals")
    for column in ("version", "parent", "change", "criterion"):
        table.add_column(column, overflow="fold")
    for p in result.proposals:
        change = ", ".join([*(f"skill {s}" for s in p.skills), *p.settings]) or "(train as is)"
        table.add_row(*(safe(c) for c in (p.name or "?", p.parent, change, p.criterion or "—")))
    return table


def print_result(console: Console, result: PlannerResult, adopted: Collection[str] = ()) -> None:
    """The proposals, harness revisions (`adopted`: those the loop already put in force) and
    the planner's notes."""
    if result.proposals:
        console.print(proposals_table(result))
    for p in result.proposals:
        console.print(f"[bold]{safe(p.name)}[/]: {safe(p.rationale)}")
    for harness in result.harness:
        backtest = harness.backtest or {}
        cases = backtest.get("cases") or []
        console.print(
            f"harness revision [bold]{safe(harness.name)}[/] proposed on main: "
            f"{safe(harness.rationale)}; "
            f"backtest against {backtest.get('against')}: "
            f"{sum(c['passed'] for c in cases)}/{len(cases)} cases pass, "
            f"changes {safe(', '.join(backtest.get('changed') or []) or 'no verdict or alert')}. "
            + ("Adopted: this round's versions are diagnosed with it." if harness.name in adopted
               else f"Adopt with `evotrainer harness adopt {safe(harness.name)}`.")
        )
    for note in result.notes:
        console.print(f"[dim]· {safe(note)}[/]")
    if result.tokens:
        console.print(f"LLM tokens this decision: {result.tokens}")


def register(app: typer.Typer) -> None:
    @app.command("propose")
    def propose_command(
        planner: str = typer.Option(None, "--planner", help=PLANNER_HELP),
        max_: int = typer.Option(1, "--max", min=1, help="Propose at most N versions."),
        pr: bool = typer.Option(
            False, "--pr", help="Push each proposed version and open its PR evo/V → main."
        ),
    ) -> None:
        """Propose candidate versions from the frontier's diagnosis, the lineage and the
        skills: each one an unapproved branch evo/vN with its rationale, hypothesis,
        falsifiable criterion and backtest. Review with `git diff evo/PARENT..evo/vN`."""
        ws = Workspace.find()
        # A planner reads diagnoses and decisions: none it cannot verify (no record key).
        ws.refuse_unverified(ws.versions(), "propose")
        with workspace_lock(ws.state_dir / "lock", " ".join(["evotrainer", *sys.argv[1:]])):
            result = propose(ws, planner, max_)
        console = make_console()
        print_result(console, result)
        if pr:
            # Imported here: the GitHub client library is an optional extra.
            from evotrainer.commands.pr import github
            from evotrainer.control.pull_requests import open_pull_request

            repo = github(None)
            for p in result.proposals:
                pull = open_pull_request(ws, repo, p.name)
                console.print(f"PR #{pull.number} {safe(pull.html_url or '')}: "
                              f"evo/{safe(p.name)} → main")
        if result.proposals:
            first = result.proposals[0]
            console.print(f"Review: git diff evo/{safe(first.parent)}..evo/{safe(first.name)}; "
                          f"then evotrainer approve {safe(first.name)}")
        elif not result.harness:
            console.print("nothing to propose")
