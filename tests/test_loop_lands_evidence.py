"""Evidence before moving on (agent/planners/evidence.py): a version the gate left inconclusive
with a positive point estimate inside the noise is trained again on one more seed before the
rules planner tries a new factor; the rationale says which evidence and why."""

from __future__ import annotations

import pytest
from standin import converge
from standin import propose as train

from evotrainer.agent.planners import evidence
from evotrainer.agent.planners.base import View, policy_violation, write_proposals
from evotrainer.agent.planners.rules import RulesPlanner
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


def recorded(view: View, name: str, *, delta: float, low: float, high: float,
             outcome: str = "mixed_evidence", verdict: str = "inconclusive") -> None:
    """Give `name`'s decision the numbers of the issue's setup 1 (v2 = v0 + the fix)."""
    decision = view.states[name].records["decision"]
    decision["verdict"] = verdict
    decision["comparison"] = {**decision["comparison"], "delta": delta, "ci_low": low,
                              "ci_high": high}
    decision["outcome"] = {"kind": outcome, "reason": "hand-made"}


@pytest.fixture
def lineage(workspace: Workspace) -> Workspace:
    train(workspace, "v1", standin_skill=0.3)
    converge(workspace)
    return workspace


def test_an_inconclusive_gain_is_rerun_on_a_second_seed_first(lineage):
    view = View.load(lineage)
    recorded(view, "v1", delta=0.114, low=-0.008, high=0.241)
    result = RulesPlanner().propose(view, 1)
    [first] = result.proposals
    assert first.parent == "v1" and first.settings == ["seeds=[0, 1]"]
    assert first.proposal["move"] == "evidence" and first.proposal["evidence_for"] == "v1"
    assert first.proposal["evidence"] == "second_seed"
    assert "Evidence before moving on" in first.rationale
    assert "A second seed rather than a longer evaluation" in first.rationale
    assert "+0.1140" in first.rationale and "mixed evidence" in first.rationale
    # The policy lets it fork the inconclusive v1 (it adds no factor), and it is written.
    assert policy_violation(view, first) is None
    assert write_proposals(lineage, result, view) == [first.name]
    assert lineage.resolved_recipe(first.name)["seeds"] == [0, 1]


def test_insufficient_evidence_with_a_positive_estimate_is_rerun_too(lineage):
    view = View.load(lineage)
    recorded(view, "v1", delta=0.05, low=-0.02, high=0.12, outcome="insufficient_evidence")
    [first] = RulesPlanner().propose(view, 1).proposals
    assert first.proposal.get("evidence_for") == "v1"


@pytest.mark.parametrize("numbers", [
    {"delta": -0.02, "low": -0.06, "high": 0.02},  # leans towards no gain
    {"delta": 0.016, "low": -0.017, "high": 0.052},  # too small for a second seed to turn
    {"delta": 0.12, "low": 0.04, "high": 0.2, "outcome": "improvement",
     "verdict": "promote"},  # decided already
    {"delta": -0.2, "low": -0.3, "high": -0.1, "outcome": "regression",
     "verdict": "prune"},
])
def test_no_rerun_where_the_evidence_already_decides(lineage, numbers):
    view = View.load(lineage)
    recorded(view, "v1", **numbers)
    assert evidence.proposals(view, "v0", "v0", []) == []


def test_one_round_of_evidence_per_version_and_within_the_budget(lineage):
    view = View.load(lineage)
    recorded(view, "v1", delta=0.114, low=-0.008, high=0.241)
    # A rerun is itself not rerun again: the planner moves on, whatever it showed.
    view.states["v1"].spec["proposal"] = {"move": "evidence", "evidence_for": "v0"}
    notes: list[str] = []
    assert evidence.proposals(view, "v0", "v0", notes) == []
    assert "itself a rerun for evidence" in notes[0]
    # No room left in autonomy.max_total_steps: declined with the numbers.
    view = View.load(lineage)
    recorded(view, "v1", delta=0.114, low=-0.008, high=0.241)
    lineage.project.setdefault("autonomy", {})["max_total_steps"] = evidence.steps_spent(view)
    notes = []
    assert evidence.proposals(view, "v0", "v0", notes) == []
    assert "would pass autonomy.max_total_steps" in notes[0]


def test_the_decision_against_main_is_the_one_read(lineage):
    """A version decided against main's frontier is judged on that comparison."""
    view = View.load(lineage)
    recorded(view, "v1", delta=-0.01, low=-0.05, high=0.03)
    view.states["v1"].records["decision"]["against_main"] = {
        "version": "v0", "comparison": {"delta": 0.09, "ci_low": -0.003, "ci_high": 0.189}}
    why = evidence.ambiguous(view, "v1")
    assert why is not None and "against v0" in why and "+0.0900" in why


def test_a_promoted_rerun_for_evidence_is_not_offered_as_a_skill(lineage):
    """The rerun changes only `seeds`: `evolve` has no intervention of its own to turn into
    a skill, says so, and proposes none."""
    from standin import standin_settings

    from evotrainer.agent.evolve import _propose_skills
    from evotrainer.control.versions import approve, new_version

    new_version(lineage, "v2", "v1", rationale="rerun",
                settings=["seeds=[0, 1]", *standin_settings(standin_skill=0.7)],
                proposal={"planner": "rules", "move": "evidence", "evidence_for": "v1"})
    approve(lineage, "v2", by="tester")
    converge(lineage)
    assert lineage.version("v2").records["decision"]["verdict"] == "promote"
    lines: list[str] = []
    assert _propose_skills(lineage, {"v1"}, lines.append) == []
    assert lines == ["no skill proposed from v2: it reruns v1 on more seeds for evidence, an "
                     "intervention of none"]
