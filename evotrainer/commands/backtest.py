"""`evotrainer backtest reward|filter`: replay a version's stored rollouts under a change.

`backtest reward --component judge:<name>` asks an LLM judge about every stored response
(the dead-group rescue check before any training): the judge is the version's
`reward.judges` entry of that name, or the one in `--judge FILE`; a `serve:` judge's server
runs for the backtest's duration, and its replies are cached under `.evotrainer/cache`.

A version's branch is its author's to write, so a backtest reads only what a reviewer
approved: the branch as it is when its approval still holds; else the recipe its sealed run
record says it trained with (the job's `recipe.json`, checked against the record's
`recipe_digest`); else main's recipe. A judge, its `serve:` command, endpoint and key
variable added on the branch after (or without) an approval are never run, asked or sent
anything; stderr says which recipe was read when it is not the branch's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from evotrainer.backends.base import job_environment
from evotrainer.commands.judge import read_judge_file
from evotrainer.control.versions import parse_assignment
from evotrainer.domains.judge import COMPONENT_PREFIX, component_name
from evotrainer.engine.judge_servers import served_judges
from evotrainer.errors import EvoError
from evotrainer.skills.library import workspace_library
from evotrainer.skills.replay import (
    backtest_filter,
    backtest_reward,
    skill_filter,
    skill_reward,
    version_rollouts,
)
from evotrainer.skills.skill import get_skill
from evotrainer.store.git import branch_name
from evotrainer.store.recipe import digest, resolve
from evotrainer.store.workspace import VersionState, Workspace, version_spec_path
from evotrainer.terminal import console, safe

TARGET_HELP = "A version name, or a rollout file/folder (a .parquet, a run artifact folder)."
# Metrics shown as before → after rows; the rest of a report prints as single values.
PAIRS = ("dead_groups", "dead_group_ratio", "reward_spread", "reward_mean")


@dataclass(frozen=True)
class Reviewed:
    """The recipe of a version a backtest may act on, and what it is: `source` names it in
    messages; `status` is the branch's approval status; `branch_judges` the judge names the
    branch's own recipe has (to say why one of them is not run)."""

    recipe: dict[str, Any]
    source: str
    status: str
    branch_judges: tuple[str, ...] = ()
    note: str | None = None  # for stderr, where the branch asks for something else

    @property
    def judges(self) -> list[Any] | None:
        return (self.recipe.get("reward") or {}).get("judges")


def _judge_names(recipe: dict[str, Any] | None) -> tuple[str, ...]:
    judges = ((recipe or {}).get("reward") or {}).get("judges")
    return tuple(str(j.get("name")) for j in judges or [] if isinstance(j, Mapping))


def _trained_recipe(ws: Workspace, state: VersionState) -> tuple[dict[str, Any], str] | None:
    """The recipe `state`'s job ran, when its sealed run record vouches for it: the job's
    `recipe.json` (the local backend writes it) whose digest is the record's `recipe_digest`.
    A launch needs an approval that holds, so this is content a reviewer approved."""
    run = state.records.get("run")
    if state.unverified or "seal" in state.record_errors or not isinstance(run, dict):
        return None
    recorded = run.get("recipe_digest")
    if not isinstance(recorded, str) or not recorded:
        return None
    try:
        path = ws.run_dir(state.name, run) / "recipe.json"
        recipe = json.loads(path.read_text(encoding="utf-8"))
    except (EvoError, OSError, ValueError):
        return None
    if not isinstance(recipe, dict) or digest(recipe) != recorded:
        return None
    return recipe, f"the recipe its run trained with ({ws.record_path(path)})"


def reviewed_recipe(ws: Workspace, name: str) -> Reviewed:
    """What a backtest of version `name` reads (see the module doc): never the branch's
    recipe unless its approval holds as the branch is now."""
    states = ws.versions()
    state = ws.version(name, states)
    status = ws.approval_status(state, states)
    try:
        branch = ws.resolved_recipe(name, states)
    except EvoError:
        branch = None  # a lineage that no longer resolves: nothing of it is read
    if status == "approved" and branch is not None:
        return Reviewed(branch, f"{name}'s approved recipe", status, _judge_names(branch))
    trained = _trained_recipe(ws, state)
    if trained is not None:
        recipe, source = trained
    else:
        recipe = resolve(ws.project.get("recipe") or {}, [])
        source = "main's recipe (spec/project.yaml)"
    note = None
    used = ("domain", "reward")  # what a backtest reads of a recipe
    if branch is None or any(branch.get(k) != recipe.get(k) for k in used):
        # Said only where it matters: the branch asks for something else than what is read.
        note = (f"{name} is {status} as its branch is now: the backtest reads {source}, not "
                "the branch's (only what a reviewer approved is run)")
    return Reviewed(recipe, source, status, _judge_names(branch), note)


def _say(reviewed: Reviewed | None) -> None:
    if reviewed is not None and reviewed.note:
        console(stderr=True).print(safe(reviewed.note), soft_wrap=True)


def _resolve(target: str, split: str
             ) -> tuple[Path, Reviewed | None, Workspace | None]:
    """(rollout path, the version's reviewed recipe or None, workspace or None)."""
    if Path(target).exists():
        try:
            ws = Workspace.find()
        except EvoError:
            ws = None
        return Path(target), None, ws
    ws = Workspace.find()
    path = version_rollouts(ws, target, split)
    return path, reviewed_recipe(ws, target), ws


def _unapproved_judge(target: str, reviewed: Reviewed, component: str) -> EvoError:
    """The refusal for a judge the branch names and its reviewed recipe does not."""
    name = component.removeprefix(COMPONENT_PREFIX)
    return EvoError(
        f"judge {name!r} is on {branch_name(target)} but not in {reviewed.source}: {target} is "
        f"{reviewed.status} as its branch is now, and a backtest never runs, asks or sends a "
        "key to a judge a reviewer did not approve",
        where=f"{branch_name(target)}:{version_spec_path(target)}",
        field="reward.judges",
        hint=f"review the branch and approve it (evotrainer approve {target}), or pass a judge "
        "you reviewed with --judge FILE",
    )


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
        path, reviewed, ws = _resolve(target, split)
        version_domain = reviewed.recipe["domain"] if reviewed else None
        judges = reviewed.judges if reviewed else None
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
        if (not wanted and judge_file is None and reviewed is not None
                and component in {component_name(n) for n in reviewed.branch_judges}):
            raise _unapproved_judge(target, reviewed, component)
        _say(reviewed)
        # A server a recipe names gets a job's environment: no secret of the controller's.
        with served_judges(wanted, state / "logs", state / "cache",
                           log=lambda line: console(stderr=True).print(safe(line)),
                           env=job_environment()) as endpoints:
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
        path, _, ws = _resolve(target, split)  # a filter replay reads no recipe
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
