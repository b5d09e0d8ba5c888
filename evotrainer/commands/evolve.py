"""`evotrainer evolve`: reconcile → propose → approve → reconcile, for N rounds."""

from __future__ import annotations

import typer

from evotrainer.agent.evolve import Round, evolve
from evotrainer.commands.lineage import describe, lineage_tree
from evotrainer.commands.propose import PLANNER_HELP, print_result
from evotrainer.control.reconcile import VersionPlan
from evotrainer.store.lineage import lineage_rows
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe


def register(app: typer.Typer) -> None:
    @app.command("evolve")
    def evolve_command(
        rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds to run."),
        planner: str = typer.Option(None, "--planner", help=PLANNER_HELP),
        approve: bool = typer.Option(
            False, "--approve",
            help="Approve this run's proposals (within autonomy.max_total_steps) when the "
            "project is human_gated: the human says yes up front.",
        ),
        max_: int = typer.Option(1, "--max", min=1, help="Versions proposed per round."),
        report: bool = typer.Option(True, "--report/--no-report",
                                    help="Write the HTML report at the end."),
        harness_evolution: bool = typer.Option(
            True, "--harness-evolution/--no-harness-evolution",
            help="Let the planner propose a harness revision when a diagnostic gap fires "
            "(adopted with --approve or autonomy auto when its backtest flips no recorded "
            "verdict); off, gaps are only noted.",
        ),
    ) -> None:
        """Run the trainer loop: train and gate what is approved, let the planner propose,
        approve as autonomy allows, train and gate again; print each round and the
        lineage with its verdicts."""
        ws = Workspace.find()
        console = make_console()

        def show_proposals(current: Round) -> None:
            console.rule(f"round {current.number}")
            print_result(console, current.result, current.adopted)

        def show_outcomes(current: Round) -> None:
            for row in current.outcomes:
                console.print("  " + describe(row))
            for name in current.skills_proposed:
                console.print(f"skill proposed for review on branch {safe(name)}")
            if current.stop:
                console.print(f"[yellow]stopping:[/] {safe(current.stop)}")

        with console.status("reconciling") as status:

            def waiting(running: list[VersionPlan]) -> None:
                status.update("training " + ", ".join(
                    f"{safe(p.version)} ({p.health.lower()})" for p in running))

            evolve(ws, rounds, planner=planner, approve_all=approve, max_proposals=max_,
                   harness_evolution=harness_evolution,
                   log=lambda line: console.print(f"[bold]→[/] {safe(line)}"),
                   on_proposed=show_proposals, on_round=show_outcomes, on_wait=waiting)
        console.print(lineage_tree(lineage_rows(ws)))
        if report:
            from evotrainer.report import build_report

            index = build_report(ws, ws.state_dir / "report")
            console.print(f"report: {index}")
