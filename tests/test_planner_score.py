"""The score-only planner (the gym's control arm) over a real lineage: stand-in engine, real
gate. It climbs Avg@k with recipe moves and never reads a diagnosis, an alert or a skill."""

from __future__ import annotations

import pytest
from standin import converge, standin_settings
from standin import propose as train

from evotrainer.agent.planners.base import View
from evotrainer.agent.planners.score import ScorePlanner
from evotrainer.agent.propose import propose
from evotrainer.control.versions import approve, new_version

pytestmark = pytest.mark.usefixtures("standin")


def test_score_planner_trains_the_root_then_hill_climbs_with_momentum(workspace):
    [first] = ScorePlanner().propose(View.load(workspace), 3).proposals
    assert (first.parent, first.settings, first.proposal["move"]) == ("v0", [], "train")

    train(workspace, "v1", standin_skill=0.8)  # v0 is the stand-in's 0.3: a clear gain
    converge(workspace)
    assert workspace.version("v1").records["decision"]["verdict"] == "promote"
    result = ScorePlanner().propose(View.load(workspace), 3)
    # From the new frontier, in the fixed order; no skill, no token, no diagnosis read.
    assert [p.parent for p in result.proposals] == ["v1"] * 3
    assert [p.settings for p in result.proposals] == [
        ['model.init="parent"', "grpo.steps=150"], ["grpo.lr=0.0006"], ["grpo.lr=0.00015"]]
    assert all(not p.skills and p.proposal["tokens"] == 0 for p in result.proposals)

    # A promoted lr_up move is repeated first from its own version (momentum).
    new_version(workspace, "v2", "v1", rationale="lr up",
                settings=["grpo.lr=0.0006", *standin_settings(standin_skill=0.99)],
                proposal={"planner": "score", "tokens": 0, "move": "lr_up"})
    approve(workspace, "v2", by="tester")
    converge(workspace)
    assert workspace.version("v2").records["decision"]["verdict"] == "promote"
    [climb] = ScorePlanner().propose(View.load(workspace), 1).proposals
    assert (climb.parent, climb.settings) == ("v2", ["grpo.lr=0.0012"])


def test_score_planner_never_repeats_a_tried_move(workspace):
    train(workspace, "v1", standin_skill=0.8)
    converge(workspace)
    written = propose(workspace, "score", 2)  # steps_up and lr_up, written as branches
    assert [p.name for p in written.proposals] == ["v2", "v3"]
    [next_move] = ScorePlanner().propose(View.load(workspace), 1).proposals
    assert next_move.settings == ["grpo.lr=0.00015"]
