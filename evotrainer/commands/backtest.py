"""`evotrainer backtest reward|filter`: replay a version's stored rollouts under a change.

`backtest reward --component judge:<name>` asks an LLM judge about every stored response
(the dead-group rescue check before any training): the judge is the version's
`reward.judges` entry of that name, or the one in `--judge FILE`; a `serve:` judge's server
runs for the backtest's duration, and its replies are cached under `.evotrainer/cache`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from evotrainer.commands.judge import read_judge_file
from evotrainer.control.versions import parse_assignment
from evotrainer.diagnosis.replay import (
    backtest_filter,
    backtest_reward,
    skill_filter,
    skill_reward,
    version_rollouts,
)
from evotrainer.diagnosis.skill_library import workspace_library
from evotrainer.diagnosis.skills import get_skill
from evotrainer.domains.judge import component_name
from evotrainer.engine.judge_servers import served_judges
from evotrainer.errors import EvoError
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console, safe

TARGET_HELP = "A version name, or a rollout file/folder (a .parquet, a run artifact folder)."
# Metrics shown as before → after rows; the rest of a report prints as single values.
PAIRS = ("dead_groups", "dead_group_ratio", "reward_spread", "reward_mean")


def _resolve(target: str, split: str
             ) -> tuple[Path, dict[str, Any] | None, Workspace | None, list[Any] | None]:
    """(rollout path, the version's domain section or None, workspace or None, the
    version's reward.judges or None)."""
    if Path(target).exists():
        try:
            ws = Workspace.find()
        except EvoError:
            ws = None
        return Path(target), None, ws, None
    ws = Workspace.find()
    recipe = ws.resolved_recipe(target)
    return (version_rollouts(ws, target, split), recipe["domain"], ws,
            (recipe.get("reward") or {}).get("judges"))


def _print(report: dict[str, Any], title: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    # Targets, component names and filter parameters are user text: cells go through safe().
    table = Table(title=safe(title))
    for column in ("", "before", "after"):
        table.add_column(column, justify="right")
    shown = set()
    for name in PAIRS:
        before, after = f"{name}_before", f"{name}_after"
        if before in report:
            table.add_row(name, safe(_fmt(report[before])), safe(_fmt(report[after])))
            shown |= {before, after}
    for key, value in report.items():
        if key not in shown:
            table.add_row(safe(key), safe(_fmt(value)), "")
    console().print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return "—" if value is None else str(value)


def register(app: typer.Typer) -> None:
    backtest_app = typer.Typer(help="Replay stored rollouts with a candidate reward component or "
                               "group filter (no training).", no_args_is_help=True)
    app.add_typer(backtest_app, name="backtest")

    @backtest_app.command("reward")
    def reward(
        target: str = typer.Argument(..., help=TARGET_HELP),
        component: str = typer.Option(None, "--component", help="Reward component to add."),
        weight: float = typer.Option(None, "--weight", help="Its weight."),
        skill: str = typer.Option(None, "--skill", help="Take component and weight from a "
                                  "reward skill."),
        domain: str = typer.Option(None, "--domain", help="Domain that recomputes a component "
                                   "the rollouts did not record (default: the version's)."),
        judge_file: Path = typer.Option(None, "--judge", help="YAML file with the judge of a "
                                        "judge:<name> component (a reward.judges entry, or a "
                                        "list); default: the version's reward.judges."),
        split: str = typer.Option("train", "--split", help="train or val."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """Re-score each rollout as reward + WEIGHT × COMPONENT: dead groups before and after,
        and the share of dead groups that regain variance. COMPONENT may be an LLM judge's,
        judge:<name>: the judge is asked about every stored response."""
        path, version_domain, ws, judges = _resolve(target, split)
        if judge_file is not None:
            judges = read_judge_file(judge_file)
        if skill:
            if component or weight is not None:
                raise EvoError("--skill takes the component and weight from the skill",
                               field="--skill", hint="pass either --skill or --component/--weight")
            component, weight = skill_reward(get_skill(workspace_library(ws), skill))
        if not component or weight is None:
            raise EvoError("say what to add", field="--component",
                           hint="--component partial --weight 0.1, or --skill NAME")
        state = ws.state_dir if ws else Path(".evotrainer")
        # Only the judge being backtested is served: another judge's model need not load.
        wanted = [j for j in judges or [] if isinstance(j, Mapping)
                  and component_name(str(j.get("name"))) == component]
        with served_judges(wanted, state / "logs", state / "cache",
                           log=lambda line: console(stderr=True).print(safe(line))
                           ) as endpoints:
            report = backtest_reward(path, component, weight, domain or version_domain,
                                     split=split, judges=wanted or None,
                                     cache_dir=state / "cache" / "judges",
                                     endpoints=endpoints)
        _print(report, f"reward backtest: {target} + {weight:g} × {component}", as_json)

    @backtest_app.command("filter")
    def filter_(
        target: str = typer.Argument(..., help=TARGET_HELP),
        name: str = typer.Option(None, "--filter", help="Group filter (none, zero_std, "
                                 "std_group_filter)."),
        params: list[str] = typer.Option([], "--param", help="Filter parameter KEY=VALUE "
                                         "(repeatable)."),
        skill: str = typer.Option(None, "--skill", help="Take the filter from a filter skill."),
        split: str = typer.Option("train", "--split", help="train or val."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """Replay a group filter over VERSION's groups in step order: keep ratio, dead-group
        ratio and reward spread of the kept groups against all groups."""
        path, _, ws, _ = _resolve(target, split)
        if skill:
            if name:
                raise EvoError("--skill names the filter itself", field="--skill",
                               hint="pass either --skill or --filter")
            name, values = skill_filter(get_skill(workspace_library(ws), skill))
        else:
            values = {}
        if not name:
            raise EvoError("say which filter to replay", field="--filter",
                           hint="--filter std_group_filter --param keep_ratio=0.9, or --skill")
        for assignment in params:
            if "=" not in assignment:
                raise EvoError(f"--param {assignment!r} is not KEY=VALUE", field="--param",
                               hint="e.g. --param keep_ratio=0.8")
            key, value = parse_assignment(assignment)
            values[key] = value
        report = backtest_filter(path, name, values, split=split)
        _print(report, f"filter backtest: {target} with {name}", as_json)
