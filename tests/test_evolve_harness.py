"""The harness side of `evolve`: a revision the planner proposes is adopted inside the loop
when the human approved the run up front (or autonomy is `auto`) and its backtest flips no
recorded verdict; otherwise the loop stops and says what to adopt; `harness_evolution=False`
proposes none. Stand-in engine, real planner, backtest, adoption and gate."""

from __future__ import annotations

import subprocess

import pytest
from standin import StandinBackend, converge, no_std_group_filter
from standin import propose as train

from evotrainer.agent.evolve import evolve
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


def stalled(ws: Workspace) -> Workspace:
    """v1 promoted, its child v2 pruned with no alert: gap (c), no next step, on v1."""
    train(ws, "v1", standin_skill=0.65)
    train(ws, "v2", parent="v1", standin_skill=0.4)
    converge(ws)
    assert ws.version("v2").records["decision"]["verdict"] == "prune"
    no_std_group_filter(ws)  # a stalled frontier no trigger moves; the planner's revision is
    # h3, as h2 is built in
    return ws


def log_of(ws: Workspace, path: str) -> str:
    return subprocess.run(["git", "-C", str(ws.root), "log", "--format=%B", "main", "--", path],
                          capture_output=True, text=True, check=True).stdout


def test_approved_run_adopts_the_backtested_revision_as_its_own_commit(workspace):
    ws = stalled(workspace)
    lines: list[str] = []
    [first] = evolve(ws, 1, approve_all=True, backends={"local": StandinBackend()},
                     log=lines.append, poll_s=0.05)
    assert [h.name for h in first.result.harness] == ["h3"]
    assert first.result.harness[0].gap["kind"] == "no_next_step"
    assert first.adopted == ["h3"] and first.stop is None
    assert Workspace(ws.root).harness_in_force() == "h3"
    message = log_of(ws, "spec/project.yaml")
    assert "Adopt harness h3 (was h0): backtest cases 2/2 pass" in message
    assert "Evotrainer-Action: adopt-harness" in message
    assert any(line.startswith("adopted harness h3") for line in lines)
    # The round's version trained and was diagnosed under the adopted revision.
    [name] = first.approved
    assert ws.version(name).records["diagnosis"]["harness"]["name"] == "h3"


def test_human_gated_run_stops_and_says_which_revision_to_adopt(workspace):
    ws = stalled(workspace)
    [first] = evolve(ws, 3, backends={"local": StandinBackend()}, log=lambda _: None,
                     poll_s=0.05)
    assert not first.adopted and Workspace(ws.root).harness_in_force() == "h0"
    assert "evotrainer harness adopt h3" in first.stop
    assert "evotrainer approve" in first.stop  # the version waits too


def test_a_revision_whose_backtest_flips_a_recorded_verdict_is_not_adopted(workspace,
                                                                           monkeypatch):
    ws = stalled(workspace)
    from evotrainer.agent.planners import revisions

    real = revisions._revision

    def flipped_case(*args, **kwargs):
        proposal = real(*args, **kwargs)
        # A case the recorded history contradicts: the revision would flip v2's prune.
        proposal.document["backtest_cases"] = [{"version": "v2", "expect": "promote"}]
        return proposal

    monkeypatch.setattr(revisions, "_revision", flipped_case)
    lines: list[str] = []
    [first] = evolve(ws, 1, approve_all=True, backends={"local": StandinBackend()},
                     log=lines.append, poll_s=0.05)
    assert first.adopted == [] and Workspace(ws.root).harness_in_force() == "h0"
    assert any("harness h3 not adopted" in line and "v2 expects promote, got prune" in line
               for line in lines)
    assert ws.git.read("main", "harness_revisions/h3.yaml") is not None  # left for review


def test_harness_evolution_off_proposes_no_revision_but_notes_the_gap(workspace):
    ws = stalled(workspace)
    [first] = evolve(ws, 1, approve_all=True, backends={"local": StandinBackend()},
                     log=lambda _: None, poll_s=0.05, harness_evolution=False)
    assert first.result.harness == [] and first.adopted == []
    assert any(n.startswith("gap no_next_step on v1") for n in first.result.notes)
    assert "harness evolution is off: no revision proposed for the gap(s)" in first.result.notes
    assert ws.git.read("main", "harness_revisions/h3.yaml") is None
    assert first.approved  # the policy side went on


def test_a_promotion_that_applied_no_library_skill_is_proposed_as_a_skill(workspace):
    ws = workspace
    train(ws, "v1", standin_skill=0.05)  # all-wrong groups: v1 fires dead_groups
    converge(ws)
    assert [a["name"] for a in ws.version("v1").records["diagnosis"]["alerts"]] == [
        "dead_groups"]
    # A hand-made fix, approved before the loop: the loop's first reconcile trains it.
    train(ws, "v2", parent="v1", standin_skill=0.65)
    lines: list[str] = []
    [first] = evolve(ws, 1, approve_all=True, backends={"local": StandinBackend()},
                     log=lines.append, poll_s=0.05)
    assert ws.version("v2").records["decision"]["verdict"] == "promote"
    branch = "skill/v2-domain-params-standin_skill"
    assert first.skills_proposed[0] == branch
    skill = ws.git.read(branch, "skills/v2-domain-params-standin_skill.yaml").decode()
    assert 'trigger: \'"dead_groups" in alerts\'' in skill
    assert ws.git.read("main", "skills/v2-domain-params-standin_skill.yaml") is None
    # The round's own version, promoted or not, never fails the loop: a refusal is a log line.
    assert all(line.startswith("no skill proposed from ") for line in lines
               if "skill" in line and "proposed from" in line)


def test_a_promotion_that_cannot_be_a_skill_is_logged_and_the_loop_goes_on(workspace):
    ws = workspace
    train(ws, "v1", standin_skill=0.65)  # no alert on v0's chain motivated it
    lines: list[str] = []
    rounds = evolve(ws, 2, approve_all=True, backends={"local": StandinBackend()},
                    log=lines.append, poll_s=0.05)
    assert ws.version("v1").records["decision"]["verdict"] == "promote"
    assert len(rounds) == 2 and not rounds[0].skills_proposed
    assert any(line.startswith("no skill proposed from v1: ") for line in lines)


def test_an_adopted_revision_with_nothing_proposed_reads_the_evidence_again_and_plans(
        workspace, monkeypatch):
    """The planner drafted h3 but no version: once h3 is adopted the frontier and its
    decided children are diagnosed under it and the planner runs again, instead of the loop
    stopping with nothing proposed."""
    from evotrainer.agent.planners import rules

    ws = stalled(workspace)
    calls = []
    propose = rules.RulesPlanner.propose

    def revision_only_first(self, view, max_proposals):
        result = propose(self, view, max_proposals)
        calls.append([p.name for p in result.proposals])
        if len(calls) == 1:
            result.proposals = []
        return result

    monkeypatch.setattr(rules.RulesPlanner, "propose", revision_only_first)
    lines: list[str] = []
    [first] = evolve(ws, 1, approve_all=True, backends={"local": StandinBackend()},
                     log=lines.append, poll_s=0.05)
    assert first.adopted == ["h3"] and len(calls) == 2
    assert first.proposed and first.stop is None and first.approved == first.proposed
    assert [h.name for h in first.result.harness] == ["h3"]  # the round keeps its revision
    ws = Workspace(ws.root)
    for name in ("v1", "v2"):  # main's frontier and its pruned child, read again under h3
        assert ws.version(name).records["diagnosis"]["harness"]["name"] == "h3"
    assert any("v2: rediagnose" in line for line in lines)
    assert any("planning again on the evidence diagnosed under it" in line for line in lines)
