"""The proposal policy enforced in the shared writer, whichever planner
proposed: proposals as an LLM planner might return them, each breaking one rule, are refused
with the reason noted and nothing written; a proposal within the policy is written."""

from __future__ import annotations

import pytest
from standin import converge, standin_settings
from standin import propose as train

from evotrainer.agent.planners.base import (
    PlannerResult,
    Proposal,
    View,
    policy_violation,
    write_proposals,
)
from evotrainer.control.versions import approve, new_version
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


def llm(parent: str, skills: list[str] = (), settings: list[str] = (), **meta) -> Proposal:
    return Proposal(parent, "the model says so", skills=list(skills), settings=list(settings),
                    hypothesis="If it is applied, then Avg@k rises.", criterion="delta >= 0.0",
                    proposal={"planner": "anthropic", "tokens": 10, **meta})


@pytest.fixture
def lineage(workspace) -> Workspace:
    """v1 promoted; v2 (std-group-filter on v1) pruned; clip-higher known to hurt."""
    train(workspace, "v1", standin_skill=0.65)
    new_version(workspace, "v2", "v1", rationale="filter", skills=["std-group-filter"],
                settings=standin_settings(standin_skill=0.2))
    approve(workspace, "v2", by="tester")
    converge(workspace)
    assert workspace.version("v2").records["decision"]["verdict"] == "prune"
    path = workspace.skill_path("clip-higher")
    path.write_text(path.read_text().replace("kind: Skill\n", "kind: Skill\nnegative: true\n"))
    return workspace


def written(ws: Workspace, proposal: Proposal) -> tuple[list[str], list[str]]:
    before = set(ws.versions())
    result = PlannerResult(proposals=[proposal])
    names = write_proposals(ws, result)
    assert set(ws.versions()) - before == set(names)
    return names, result.notes


@pytest.mark.parametrize("proposal, reason", [
    (llm("v2", ["temperature-raise"]), "a failed version is never forked"),
    (llm("v1", ["clip-higher"]), "known to hurt"),
    (llm("v1", ["std-group-filter"]), "std-group-filter was refuted on this lineage by v2"),
    (llm("v1", ["temperature-raise", "zero-std-filter"]), "one factor per version"),
    (llm("v1", ["temperature-raise"], ["grpo.lr=1e-06"]), "one factor per version"),
    (llm("v1", ["temperature-raise", "zero-std-filter"], move="bundle"),
     "has no recorded single-factor version with an improvement or mixed evidence"),
], ids=["failed-parent", "negative", "refuted", "two-skills", "skill-and-settings",
        "unsupported-bundle"])
def test_a_proposal_breaking_the_policy_is_refused_and_nothing_is_written(
        lineage, proposal, reason):
    assert reason in policy_violation(View.load(lineage), proposal)
    names, notes = written(lineage, proposal)
    assert names == []
    assert len(notes) == 1 and reason in notes[0] and notes[0].startswith("refused a proposal")
    assert lineage.git.rev(f"refs/heads/{branch_name('v3')}") is None


def test_a_proposal_within_the_policy_is_written(lineage):
    names, notes = written(lineage, llm("v1", ["temperature-raise"]))
    assert names == ["v3"] and notes == []
    assert lineage.version("v3").spec["intervention"]["skills"] == ["temperature-raise"]
    # Settings alone are one factor, however many keys one move sets.
    names, _ = written(lineage, llm("v1", settings=['model.init="parent"', "grpo.steps=30"]))
    assert names == ["v4"]
