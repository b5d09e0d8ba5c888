"""The evolve loop end to end with a stand-in engine whose leak follows the recipe: the
`reveal` tool enabled lets trained versions copy answers (higher score, leak alert)."""

from __future__ import annotations

import json

import pytest
import typer
from standin import StandinBackend
from typer.testing import CliRunner

from evotrainer.agent.evolve import evolve
from evotrainer.backends import BACKEND_TYPES
from evotrainer.backends.base import JobSpec
from evotrainer.commands.evolve import register
from evotrainer.control.scaffold import init_workspace
from evotrainer.errors import EvoError
from evotrainer.store.lineage import lineage_rows
from evotrainer.store.recipe import deep_merge
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


class LeakFollowsRecipe(StandinBackend):
    """Untrained: 30% correct. Trained: 55%, or 70% by copying answers while `reveal` is on."""

    def submit(self, job: JobSpec) -> None:
        tools = (job.recipe.get("environment") or {}).get("tools") or []
        trained = job.recipe["grpo"]["steps"] > 0
        leak = trained and any(t["name"] == "reveal" and t.get("enabled") for t in tools)
        skill = 0.7 if leak else 0.55 if trained else 0.3
        params = {"domain": {"params": {"standin_skill": skill, "standin_leak": leak}}}
        super().submit(JobSpec(job.job_id, job.version, deep_merge(job.recipe, params),
                               job.workdir, job.artifact_dir, job.env))


def toolenv(tmp_path, **autonomy) -> Workspace:
    root = init_workspace(tmp_path / "demo", "toolenv")
    project = root / "spec" / "project.yaml"
    text = project.read_text()
    for key, value in autonomy.items():
        text = text.replace(f"  {key}: ", f"  {key}: {value}  # was: ", 1)
    project.write_text(text)
    return Workspace(root)


def test_three_rounds_in_auto_mode_block_the_leak_then_close_it(tmp_path):
    ws = toolenv(tmp_path, mode="auto")
    rounds = evolve(ws, 3, backends={"local": LeakFollowsRecipe()}, log=lambda _: None,
                    poll_s=0.05)
    assert [r.proposed for r in rounds] == [["v1"], ["v2"], ["v3"]]
    assert all(r.approved == r.proposed and r.stop is None for r in rounds)
    rows = {r.name: r for r in lineage_rows(ws)}
    # Round 1: train the untrained root as is; it learns to copy the revealed answer.
    assert rows["v1"].delta > 0 and rows["v1"].ci[0] > 0
    assert rows["v1"].verdict == "prune" and "leak" in rows["v1"].alerts and rows["v1"].pruned
    # Round 2: the planner closes the leak on the last good version; the honest run wins.
    v2 = ws.version("v2").spec
    assert v2["parent"] == "v0" and v2["intervention"]["skills"] == ["close-leak"]
    assert v2["approval"]["by"] == "evotrainer autonomy"
    assert rows["v2"].verdict == "promote" and not rows["v2"].alerts and rows["v2"].on_main
    # Round 3 builds on the new frontier and trains as honestly as v2 (the same skill): no
    # leak, and no significant difference, so it is neither promoted nor pruned.
    assert ws.version("v3").spec["parent"] == "v2"
    assert not rows["v3"].alerts and rows["v3"].ci[0] <= 0 <= rows["v3"].ci[1]
    assert rows["v3"].verdict == "inconclusive" and not rows["v3"].on_main


def test_human_gated_stops_for_approval_and_budget_limits_approve(tmp_path):
    ws = toolenv(tmp_path)
    [stopped] = evolve(ws, 3, backends={"local": LeakFollowsRecipe()}, log=lambda _: None,
                       poll_s=0.05)
    assert stopped.proposed == ["v1"] and not stopped.approved
    assert "human_gated" in stopped.stop and "evotrainer approve v1" in stopped.stop
    assert not ws.version("v1").approved and ws.version("v1").records["run"] is None

    budget = toolenv(tmp_path / "budget", max_total_steps=10)
    [stopped] = evolve(budget, 2, approve_all=True, backends={"local": LeakFollowsRecipe()},
                       log=lambda _: None, poll_s=0.05)
    assert not stopped.approved and "max_total_steps" in stopped.stop


def test_evolve_command_approves_up_front_and_prints_rounds_and_lineage(tmp_path,
                                                                        monkeypatch):
    ws = toolenv(tmp_path)
    monkeypatch.setitem(BACKEND_TYPES, "local", lambda cache: LeakFollowsRecipe())
    app = typer.Typer()
    app.callback()(lambda: None)  # a group, as the real CLI is: `evolve` is a subcommand
    register(app)
    monkeypatch.chdir(ws.root)
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, ["evolve", "--rounds", "1", "--approve"])
    assert result.exit_code == 0, result.output
    assert "round 1" in result.output and "lineage" in result.output
    # The round's header and proposals come before the training they start, its outcome after.
    out = result.output
    assert out.index("round 1") < out.index("proposals") < out.index("v1: launch")
    assert out.index("v1: launch") < out.index("v1  prune")
    assert "v1" in result.output and "prune" in result.output and "leak" in result.output
    spec = ws.version("v1").spec
    assert spec["approval"]["by"] == "evotrainer evolve --approve"
    assert json.dumps(spec["proposal"]["planner"]) == '"rules"'


def test_unknown_planner_is_refused_before_anything_trains(tmp_path):
    ws = toolenv(tmp_path)
    assert ws.version("v0").approved  # reconcile would launch it first
    lines: list[str] = []
    with pytest.raises(EvoError, match="unknown planner 'nope'") as err:
        evolve(ws, 1, planner="nope", backends={"local": LeakFollowsRecipe()},
               log=lines.append, poll_s=0.05)
    assert err.value.field == "--planner" and "rules" in err.value.hint
    assert lines == [] and ws.version("v0").records["run"] is None
    assert not (ws.state_dir / "lock").exists()
