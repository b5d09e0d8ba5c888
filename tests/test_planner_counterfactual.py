"""Counterfactual branch families over real lineages (stand-in engine, real diagnosis and
gate): when the obvious fix for an alert was refuted, the rules planner proposes treatments
plus a control without the suspected factor in one decision, and the gate decides each
treatment against that control, the correction counting every treatment."""

from __future__ import annotations

from dataclasses import replace

import pytest
from standin import converge, standin_settings
from test_control_rules import DONE

from evotrainer.agent.planners.base import View
from evotrainer.agent.planners.rules import RulesPlanner
from evotrainer.agent.propose import propose
from evotrainer.control.decide import decide_next
from evotrainer.control.versions import approve, new_version
from evotrainer.gate.counterfactual import adjusted
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


def cold_lineage(ws: Workspace, fix_skill: float = 0.9) -> None:
    """v1 samples at temperature 0.2 and most groups are dead (promoted over the untrained
    v0); v2 applies the obvious fix, temperature-raise, and the dead groups stay."""
    new_version(ws, "v1", "v0", rationale="cold",
                settings=["grpo.temperature=0.2", *standin_settings(standin_skill=0.95)])
    approve(ws, "v1", by="tester")
    new_version(ws, "v2", "v1", rationale="the obvious fix", skills=["temperature-raise"],
                settings=standin_settings(standin_skill=fix_skill))
    approve(ws, "v2", by="tester")
    converge(ws)


def family_of(ws: Workspace, name: str) -> dict:
    return ws.version(name).spec["proposal"]["family"]


def test_a_refuted_obvious_fix_gets_a_family_gated_against_its_control(workspace):
    cold_lineage(workspace)
    view = View.load(workspace)
    assert view.refuted_skills("v1") == {"temperature-raise": "v2"}
    assert "dead_groups" in {a["name"] for a in
                             workspace.version("v2").records["diagnosis"]["alerts"]}

    # One decision, one proposal slot: two treatments and the control, all from v1.
    result = propose(workspace, "rules", 1)
    assert [(p.name, p.parent) for p in result.proposals] == [
        ("v3", "v1"), ("v4", "v1"), ("v5", "v1")]
    treatments, control = result.proposals[:2], result.proposals[2]
    assert all(len(p.skills) == 1 and not p.settings for p in treatments)
    assert "temperature-raise" not in {p.skills[0] for p in treatments}
    # The control is v1 without the suspected factor: the temperature v1 set, restored to
    # v0's value (not the refuted fix's 1.2).
    assert control.skills == [] and control.settings == ["grpo.temperature=1.0"]
    assert workspace.resolved_recipe("v5")["grpo"]["temperature"] == 1.0
    assert workspace.resolved_recipe("v3")["grpo"]["temperature"] == 0.2
    family = family_of(workspace, "v3")
    assert family["members"] == [{"name": "v3", "role": "treatment"},
                                 {"name": "v4", "role": "treatment"},
                                 {"name": "v5", "role": "control"}]
    assert (family["role"], family["control"]) == ("treatment", "v5")
    assert family_of(workspace, "v5")["role"] == "control"
    assert family["suspected"] == {
        "alert": "dead_groups", "fix": "temperature-raise", "settings": ["grpo.temperature"],
        "negative": "was refuted by v2 (inconclusive; dead_groups still fires there)"}
    spec = workspace.version("v5").spec
    assert "Does dead_groups come from grpo.temperature?" in spec["intervention"]["rationale"]
    assert "restores v0's values" in spec["intervention"]["rationale"]
    assert spec["intervention"]["hypothesis"]["criterion"] == '!("dead_groups" in alerts)'

    for name in ("v3", "v4", "v5"):
        approve(workspace, name, by="tester")
    converge(workspace)
    for name in ("v3", "v4"):
        decision = workspace.version(name).records["decision"]
        gated = decision["family"]
        assert gated["members"]["control"]["version"] == "v5"
        assert gated["members"]["parent"]["version"] == "v1"
        # Parent, control and the sibling's comparison with the control: three.
        assert gated["comparisons"] == 3
        assert gated["counterfactual"] == {"name": "cf-v3", "control": "v5",
                                           "treatments": ["v3", "v4"]}
        assert gated["members"]["control"]["comparison"]["confidence"] == pytest.approx(
            1 - 0.05 / 3)
        members = [gated["members"][r]["comparison"] for r in ("parent", "control")]
        assert [c["p_bootstrap"] for c in members] == pytest.approx(adjusted(
            [c["p_unadjusted"] for c in members], "holm", 3))
        assert "corrected (holm) for 3 comparisons" in decision["reason"]
    # The control is decided against its parent alone.
    assert "family" not in workspace.version("v5").records["decision"]

    # Designed once: the next decision does not propose the family again.
    again = RulesPlanner().propose(View.load(workspace), 1)
    assert not any("family" in p.proposal for p in again.proposals)


def test_a_treatment_waits_for_its_control_to_be_scored():
    diagnosed = replace(DONE, decision=None, on_main=False, control="v5")
    assert decide_next(diagnosed).action.kind == "gate"
    waiting = decide_next(replace(diagnosed, control_diagnosed=False))
    assert waiting.action is None
    assert waiting.note == "waiting for its family's control v5 to be evaluated"


def test_a_fix_the_chain_never_set_gets_a_control_on_a_new_seed(workspace):
    """aux-continuous-reward's reward components come with the project: there is nothing to
    take out of v1, so its control is v1 as it is on a new seed."""
    new_version(workspace, "v1", "v0", rationale="dead",
                settings=standin_settings(standin_skill=0.95))
    approve(workspace, "v1", by="tester")
    new_version(workspace, "v2", "v1", rationale="the obvious fix",
                skills=["aux-continuous-reward"], settings=standin_settings(standin_skill=0.9))
    approve(workspace, "v2", by="tester")
    converge(workspace)

    result = RulesPlanner().propose(View.load(workspace), 1)
    *treatments, control = result.proposals
    assert treatments and all(p.proposal["family"]["role"] == "treatment" for p in treatments)
    assert control.settings == ["seeds=[1]"]
    assert control.proposal["family"]["suspected"]["fix"] == "aux-continuous-reward"
    assert "it comes with the project" in control.rationale
    assert control.criterion == '"dead_groups" in alerts'


def test_no_family_without_a_refuted_fix_or_without_room_for_every_member(workspace):
    new_version(workspace, "v1", "v0", rationale="cold",
                settings=["grpo.temperature=0.2", *standin_settings(standin_skill=0.95)])
    approve(workspace, "v1", by="tester")
    converge(workspace)
    # The obvious fix not yet tried: it is proposed, alone.
    [fix] = RulesPlanner().propose(View.load(workspace), 1).proposals
    assert fix.skills == ["temperature-raise"] and "family" not in fix.proposal

    new_version(workspace, "v2", "v1", rationale="the obvious fix",
                skills=["temperature-raise"], settings=standin_settings(standin_skill=0.9))
    approve(workspace, "v2", by="tester")
    converge(workspace)
    view = View.load(workspace)
    spent = sum(s.run.steps_spent for s in view.states.values() if s.run is not None)
    view.ws.project.setdefault("autonomy", {})["max_total_steps"] = spent + 100
    result = RulesPlanner().propose(view, 1)
    assert not any("family" in p.proposal for p in result.proposals)
    assert len(result.proposals) == 1
    [note] = [n for n in result.notes if "counterfactual" in n]
    assert note.startswith("no counterfactual family for dead_groups: its 3 members")
    assert f"would pass autonomy.max_total_steps ({spent} of {spent + 100} spent)" in note

