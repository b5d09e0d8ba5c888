"""`evotrainer version new|show`: propose a version as a branch; inspect one."""

from __future__ import annotations

import typer
from rich.syntax import Syntax

from evotrainer.control.versions import new_version
from evotrainer.store import specs
from evotrainer.store.git import branch_name
from evotrainer.store.recipe import digest
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console, safe


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Create and inspect policy versions.", no_args_is_help=True)
    app.add_typer(group, name="version")

    @group.command("new")
    def new(
        name: str = typer.Argument(..., help="New version name, e.g. v3."),
        parent: str = typer.Option(..., "--parent", help="Version to fork from."),
        rationale: str = typer.Option(..., "--rationale", help="Why this version."),
        skill: list[str] = typer.Option([], "--skill", help="Apply a skill's recipe patch."),
        set_: list[str] = typer.Option([], "--set", help="Recipe override dotted.path=value."),
        hypothesis: str = typer.Option(None, "--hypothesis", help="If X then Y because Z."),
        criterion: str = typer.Option(
            None, "--criterion", help="Falsifiable CEL criterion over metrics."
        ),
        pr: bool = typer.Option(False, "--pr", help="Push evo/NAME and open its PR → main."),
    ) -> None:
        """Fork evo/NAME from the parent's tip with the spec committed (unapproved)."""
        ws = Workspace.find()
        new_version(
            ws,
            name,
            parent,
            rationale=rationale,
            skills=skill,
            settings=set_,
            hypothesis=hypothesis,
            criterion=criterion,
        )
        out = console()
        out.print(
            f"Created {safe(branch_name(name))} from {safe(branch_name(parent))} (not "
            f"approved: `evotrainer approve {safe(name)}` when the diff looks right: "
            f"git diff {safe(branch_name(parent))}..{safe(branch_name(name))})",
        )
        if pr:
            # Imported here: the GitHub client library is an optional extra.
            from evotrainer.commands.pr import github
            from evotrainer.control.pull_requests import open_pull_request

            pull = open_pull_request(ws, github(None), name)
            out.print(f"PR #{pull.number} {safe(pull.html_url or '')}: "
                      f"{safe(branch_name(name))} → main")

    @group.command("show")
    def show(name: str = typer.Argument(..., help="Version name.")) -> None:
        """The spec, resolved recipe, its digest and the recorded state."""
        ws = Workspace.find()
        states = ws.versions()
        state = ws.version(name, states)
        recipe = ws.resolved_recipe(name, states)
        out = console()
        run, decision = state.run, state.decision
        approval = {
            "approved": "approved",
            "stale": "approval stale (changed since): re-approve",
            "unbound": "approval without digest: not an approval",
        }.get(ws.approval_status(state, states), "not approved")
        out.print(
            f"[bold]{safe(name)}[/]  branch {safe(branch_name(name))} @ {state.sha[:10]}  "
            f"parent {safe(state.parent or '—')}  {approval}"
        )
        out.print(
            f"run: {safe(run.state if run else 'not run')}   "
            f"verdict: {safe(decision.verdict if decision else '—')}"
        )
        out.print(f"recipe digest: {digest(recipe)}")
        out.print(
            Syntax(
                specs.dump({"spec": state.spec, "resolved_recipe": recipe}),
                "yaml",
                theme="ansi_dark",
                background_color="default",
            )
        )
