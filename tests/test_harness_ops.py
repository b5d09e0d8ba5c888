"""Harness revisions on recorded history: backtest (re-diagnose, re-gate), adopt (only when
the cases pass), diff; through the `harness` command."""

from __future__ import annotations

import json

import git
import pytest
import typer
import yaml
from standin import converge, no_std_group_filter
from standin import propose as train
from typer.testing import CliRunner

from evotrainer.agent.propose import propose
from evotrainer.commands.harness import register
from evotrainer.control.reconcile import load_context, plan
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.gate.decision import decide, recorded_scores
from evotrainer.stats.paired import compare_tables
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


@pytest.fixture
def harness_cli(monkeypatch):
    app = typer.Typer()
    register(app)
    runner = CliRunner()

    def run(ws: Workspace, *args: str):
        monkeypatch.chdir(ws.root)
        monkeypatch.setenv("COLUMNS", "200")
        return runner.invoke(app, ["harness", *args])

    return run


@pytest.fixture
def recorded(workspace) -> Workspace:
    """v1 promoted, v2 pruned without any alert: a verdict h0 cannot explain."""
    train(workspace, "v1", standin_skill=0.65)
    train(workspace, "v2", parent="v1", standin_skill=0.4)
    converge(workspace)
    return workspace


def write_revision(ws: Workspace, name: str, **changes) -> None:
    doc = yaml.safe_load((ws.root / "harness_revisions" / "h0.yaml").read_text())
    doc.update(name=name, parent="h0", **changes)
    (ws.root / "harness_revisions" / f"{name}.yaml").write_text(yaml.safe_dump(doc))


def commit(ws: Workspace, path: str) -> None:
    repo = git.Repo(ws.root)
    repo.git.add(path)
    repo.git.commit("-m", f"add {path}", env={
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})


def test_a_proposed_metric_is_backtested_then_adopted_and_plan_rediagnoses(recorded,
                                                                          harness_cli):
    no_std_group_filter(recorded)
    [revision] = propose(recorded, "rules", 1).harness
    name = revision.name
    metric = next(m["name"] for m in revision.document["metrics"][::-1])

    shown = harness_cli(recorded, "backtest", name, "--against", "h0")
    assert shown.exit_code == 0, shown.output
    assert metric in shown.output and "pass" in shown.output and "FAIL" not in shown.output
    report = json.loads(harness_cli(recorded, "backtest", name, "--json").output)
    assert [r["version"] for r in report["versions"]] == ["v0", "v1", "v2"]
    assert all(r["metrics_added"] == [metric] for r in report["versions"])
    assert all(r["verdict_before"] == r["verdict_after"] == r["recorded"]
               for r in report["versions"])
    assert [(c["version"], c["passed"]) for c in report["cases"]] == [("v1", True),
                                                                       ("v2", True)]

    diff = harness_cli(recorded, "diff", "h0", name)
    assert diff.exit_code == 0 and metric in diff.output
    assert "verdicts that change: none (over 3 recorded version(s))" in diff.output

    adopted = harness_cli(recorded, "adopt", name)
    assert adopted.exit_code == 0, adopted.output
    repo = git.Repo(recorded.root)
    assert "Evotrainer-Action: adopt-harness" in repo.commit("main").message
    assert f"harness: {name}" in (recorded.root / "spec" / "project.yaml").read_text()
    kinds = {p.version: p.action.kind for p in plan(load_context(Workspace(recorded.root)))
             if p.action}
    assert kinds == {"v0": "rediagnose", "v1": "rediagnose", "v2": "rediagnose"}


def test_failing_cases_and_uncommitted_revisions_are_refused(recorded, harness_cli):
    # A stricter gate: every gain needs p < 0.0001, so v1 would no longer be promoted.
    doc = yaml.safe_load((recorded.root / "harness_revisions" / "h0.yaml").read_text())
    rules = [{"name": "significant_gain", "when": "ci_low > 0.5", "verdict": "promote"},
             *[r for r in doc["gate"]["rules"] if r["name"] != "significant_gain"]]
    write_revision(recorded, "h9", gate={**doc["gate"], "rules": rules},
                   backtest_cases=[{"version": "v1", "expect": "promote"}])
    refused = harness_cli(recorded, "adopt", "h9")
    assert refused.exit_code == 1 and "not committed on main" in str(refused.exception)

    backtest = harness_cli(recorded, "backtest", "h9")
    assert backtest.exit_code == 1 and "FAIL" in backtest.output
    diff = json.loads(harness_cli(recorded, "diff", "h0", "h9", "--json").output)
    assert diff["gate_rules"]["changed"] == {"significant_gain": ["when"]}
    assert diff["rule_order"] is not None
    assert [(c["version"], c["verdict_before"], c["verdict_after"])
            for c in diff["changed_verdicts"]] == [("v1", "promote", "inconclusive")]
    assert diff["changed_verdicts"][0]["why"].endswith("the same numbers, another rule")

    commit(recorded, "harness_revisions/h9.yaml")
    refused = harness_cli(recorded, "adopt", "h9")
    assert refused.exit_code == 1
    assert "v1 expects promote, got inconclusive" in str(refused.exception)
    assert "harness: h0" in (recorded.root / "spec" / "project.yaml").read_text()


def test_a_procedure_revision_flips_a_recorded_decision_and_diff_names_it(recorded,
                                                                          harness_cli):
    """Only the gate's min_delta moves (no metric, no rule text): v1's recorded
    promotion no longer clears it, and the diff lists v1 with the numbers that flip it."""
    comparison = recorded.version("v1").records["decision"]["comparison"]
    raised = round(comparison["ci_low"] + 0.01, 4)
    doc = yaml.safe_load((recorded.root / "harness_revisions" / "h0.yaml").read_text())
    write_revision(recorded, "h8", gate={**doc["gate"], "min_delta": raised})

    result = json.loads(harness_cli(recorded, "diff", "h0", "h8", "--json").output)
    assert result["gate"] == {"min_delta": {"from": 0.0, "to": raised}}
    assert result["gate_rules"]["changed"] == {} and result["metrics"]["added"] == []
    [flipped] = result["changed_verdicts"]
    assert (flipped["version"], flipped["recorded"], flipped["verdict_before"],
            flipped["verdict_after"]) == ("v1", "promote", "promote", "inconclusive")
    assert flipped["before"]["rule"] == "significant_gain"
    assert flipped["after"]["rule"] == "otherwise"
    assert flipped["after"]["ci_low"] == pytest.approx(comparison["ci_low"])
    assert flipped["after"]["ci_low"] < flipped["after"]["min_delta"] == raised
    assert f"min_delta +0.0000 → {raised:+.4f}" in flipped["why"]
    assert "promote (rule significant_gain) → inconclusive (rule otherwise)" in flipped["why"]
    assert result["early_stops"] == []  # no stop rule, nor what one reads, changed

    shown = harness_cli(recorded, "diff", "h0", "h8")
    assert shown.exit_code == 0, shown.output
    assert f"min_delta: 0.0 → {raised}" in shown.output
    assert "verdicts that change: v1 promote → inconclusive" in shown.output
    assert "  v1: promote (rule significant_gain) → inconclusive (rule otherwise)" in \
        shown.output
    backtest = harness_cli(recorded, "backtest", "h8")
    assert "v1: promote (rule significant_gain) → inconclusive" in backtest.output

    # Lowering alpha widens every interval: the same numbers at another level.
    write_revision(recorded, "h6", gate={**doc["gate"], "alpha": 0.01})
    lowered = json.loads(harness_cli(recorded, "diff", "h0", "h6", "--json").output)
    assert lowered["gate"] == {"alpha": {"from": 0.05, "to": 0.01}}
    # v1's gain (Δ about +0.4) clears a 99% interval too: nothing flips, and the diff says so.
    assert lowered["changed_verdicts"] == []


def test_a_revision_of_the_test_itself_reaches_the_gate_and_the_diff(recorded, harness_cli):
    """A revision that changes only how the gate tests (BCa intervals, tasks pooled
    across data sources, fewer resamples) is diffed field by field, and the backtest's gate
    decides under it: v1's recorded interval is recomputed by that procedure."""
    doc = yaml.safe_load((recorded.root / "harness_revisions" / "h0.yaml").read_text())
    write_revision(recorded, "h7", gate={**doc["gate"], "ci_method": "bca", "strata": "none",
                                         "resamples": 2000})
    result = json.loads(harness_cli(recorded, "diff", "h0", "h7", "--json").output)
    assert result["gate"] == {"ci_method": {"from": "percentile", "to": "bca"},
                              "resamples": {"from": 10000, "to": 2000},
                              "strata": {"from": "data_source", "to": "none"}}
    revision = resolve_harness("h7", recorded.root)
    assert (revision.procedure.ci_method, revision.procedure.stratified) == ("bca", False)
    recorded_ci = recorded.version("v1").records["decision"]["comparison"]
    states = recorded.versions()
    redecided = decide(recorded, states, states["v1"], revision)["comparison"]
    assert redecided["ci_method"] == "bca" and redecided["stratified"] is False
    assert redecided["delta"] == pytest.approx(recorded_ci["delta"])  # the same scores
    parent = states["v1"].parent
    assert redecided == compare_tables(
        recorded_scores(recorded, parent), recorded_scores(recorded, "v1"), B=2000,
        ci_method="bca", stratified=False)


def test_a_revised_early_stop_rule_is_replayed_over_the_recorded_runs(recorded, harness_cli):
    """The collapse stop without its logprob clause and at any dead-group share: replayed
    step by step over the stored rollouts, it would have stopped every recorded run at its
    first step (96 train rollouts, past params.stop_min_rollouts = 64)."""
    doc = yaml.safe_load((recorded.root / "harness_revisions" / "h0.yaml").read_text())
    rules = [{**r, "when": "rows >= params.stop_min_rollouts && "
              "latest.dead_group_ratio >= 0.0"} if r["name"] == "collapse" else r
             for r in doc["early_stop"]]
    write_revision(recorded, "h5", early_stop=rules)
    result = json.loads(harness_cli(recorded, "diff", "h0", "h5", "--json").output)
    assert list(result["early_stop"]["changed"]) == ["collapse"]
    assert [c["version"] for c in result["early_stops"]] == ["v0", "v1", "v2"]
    for change in result["early_stops"]:
        assert change["before"] is None and change["recorded"] is None
        assert change["after"] == {"rule": "collapse", "alert": "dead_groups", "step": 1,
                                   "steps": 150, "rows": 96}
    shown = harness_cli(recorded, "diff", "h0", "h5")
    assert "early stops that change: v0: no stop → collapse at step 1 of 150 (96 rollouts)" \
        in shown.output


def _once(condition, polls: int = 2400) -> bool:
    """Whether `condition` comes to hold, looked at every 50 ms (up to two minutes): what
    the forked children keep appears on disk while the test goes on."""
    import time

    for _ in range(polls):
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _h5(recorded):
    """h0 with its collapse rule holding from the first step: every run's stop changes."""
    from evotrainer.diagnosis.harness import resolve_harness

    doc = yaml.safe_load((recorded.root / "harness_revisions" / "h0.yaml").read_text())
    write_revision(recorded, "h5", early_stop=[
        {**r, "when": "rows >= params.stop_min_rollouts && latest.dead_group_ratio >= 0.0"}
        if r["name"] == "collapse" else r for r in doc["early_stop"]])
    return resolve_harness("h0", recorded.root), resolve_harness("h5", recorded.root)


def test_a_diffs_diagnoses_and_replays_are_made_by_children_and_read_back(
        recorded, monkeypatch):
    """shared_with_children: two children forked from the caller keep the replays and the
    diagnoses they make; the caller's backtest and replays read those back and answer as
    they do alone, and the children are stopped as the block ends. With everything kept, or
    on one core, no child is forked."""
    import os
    import shutil

    from evotrainer.agent import diff_work, stop_replay
    from evotrainer.gate import harness_backtest
    from evotrainer.gate.harness_backtest import backtest_harness

    h0, h5 = _h5(recorded)
    cache = recorded.state_dir / "cache" / "backtest"
    stops = stop_replay.stop_changes(recorded, h0, h5)
    assert [c["version"] for c in stops] == ["v0", "v1", "v2"]
    backtest = backtest_harness(recorded, h5, h0)
    kept = sorted(path.name for path in cache.iterdir())
    assert any(name.startswith("stop-") for name in kept)
    assert any(not name.startswith("stop-") for name in kept)
    shutil.rmtree(cache)
    caller, children = os.getpid(), []
    fork = os.fork
    monkeypatch.setattr(diff_work.os, "fork", lambda: children.append(fork()) or children[-1])

    def in_children(real):
        def made(*args, **kwargs):
            assert os.getpid() != caller, f"{real.__name__} in the caller"
            return real(*args, **kwargs)
        return made

    monkeypatch.setattr(stop_replay, "_replay", in_children(stop_replay._replay))
    monkeypatch.setattr(harness_backtest, "diagnose", in_children(harness_backtest.diagnose))
    with diff_work.shared_with_children(recorded, h0, h5, replay=True) as work:
        assert len(children) == 2 and all(pid > 0 for pid in children)
        assert _once(lambda: sorted(path.name for path in cache.glob("*.json")) == kept), \
            "the children kept too little"
        assert backtest_harness(recorded, h5, h0) == backtest
        assert work.early_stops() == stops
    for child in children:  # stopped and reaped as the block ended
        with pytest.raises(ChildProcessError):
            os.waitpid(child, os.WNOHANG)
    with diff_work.shared_with_children(recorded, h0, h5, replay=True) as work:
        assert work.early_stops() == stops  # everything kept: no child
    monkeypatch.undo()
    shutil.rmtree(cache)
    monkeypatch.setattr(diff_work.os, "fork", lambda: children.append(fork()) or children[-1])
    monkeypatch.setattr(diff_work, "cpus", lambda: 1)
    with diff_work.shared_with_children(recorded, h0, h5, replay=True) as work:
        assert work.early_stops() == stops
    assert len(children) == 2


def test_the_caller_and_the_diagnosing_child_diagnose_no_version_twice(
        recorded, monkeypatch, tmp_path):
    """The caller's backtest, run through `before_each_version`, waits where it meets the
    diagnosing child instead of diagnosing that version too: across both processes each
    version is diagnosed once, and the backtest answers as it does alone."""
    import os
    import shutil
    import time

    from evotrainer.agent import diff_work
    from evotrainer.gate import harness_backtest
    from evotrainer.gate.harness_backtest import backtest_harness

    h0, h5 = _h5(recorded)
    backtest = backtest_harness(recorded, h5, h0)
    shutil.rmtree(recorded.state_dir / "cache" / "backtest")
    made = tmp_path / "diagnosed"
    diagnose, caller = harness_backtest.diagnose, os.getpid()

    def logged(*args, **kwargs):  # one line per diagnosis, from whichever process makes it
        if os.getpid() != caller:  # a child slow at it, and working: the caller comes to it
            busy_until = time.process_time() + 0.5
            while time.process_time() < busy_until:
                pass
        result = diagnose(*args, **kwargs)
        with open(made, "a") as log:
            log.write(f"{os.getpid()} {result['versions']} {result['harness']['name']}\n")
        return result

    monkeypatch.setattr(harness_backtest, "diagnose", logged)
    with diff_work.shared_with_children(recorded, h0, h5, replay=False) as work:
        assert backtest_harness(recorded, h5, h0,
                                progress=work.before_each_version(None)) == backtest
    lines = made.read_text().splitlines()
    made_where = sorted(line.split(" ", 1)[1] for line in lines)
    # h0's diagnoses are reconcile's: only h5's are made.
    assert made_where == [f"['{row['version']}'] h5" for row in backtest["versions"]]
    assert len({line.split(" ", 1)[0] for line in lines}) == 2  # both made some


def test_a_child_stopped_while_it_keeps_its_work_leaves_no_file(recorded, monkeypatch):
    """The children are stopped wherever they are: one stopped between writing a replay's
    or a diagnosis' file and putting it in place leaves nothing behind in the cache, and the
    caller's answers are whole."""
    import os
    import shutil
    import time

    from evotrainer.agent import diff_work, stop_replay
    from evotrainer.gate import harness_backtest
    from evotrainer.gate.harness_backtest import backtest_harness

    h0, h5 = _h5(recorded)
    cache = recorded.state_dir / "cache" / "backtest"
    stops = stop_replay.stop_changes(recorded, h0, h5)
    backtest = backtest_harness(recorded, h5, h0)
    shutil.rmtree(cache)
    caller, replace = os.getpid(), os.replace

    def stuck(source, target):  # a child hangs with its file written, not yet in place
        if os.getpid() != caller:
            time.sleep(600)
        replace(source, target)

    monkeypatch.setattr(harness_backtest.os, "replace", stuck)
    with diff_work.shared_with_children(recorded, h0, h5, replay=True) as work:
        # Each child's unfinished file.
        assert _once(lambda: len(list(cache.glob("*.tmp"))) >= 2), "no child wrote"
        assert backtest_harness(recorded, h5, h0) == backtest
        assert work.early_stops() == stops
    assert not list(cache.glob("*.tmp"))


def test_early_stops_are_replayed_only_when_what_a_stop_reads_changes():
    import dataclasses

    from evotrainer.agent.stop_replay import stops_may_differ
    from evotrainer.diagnosis.harness import Metric, resolve_harness

    h0 = resolve_harness("h0")
    unread = dataclasses.replace(h0, metrics=(*h0.metrics, Metric("x_ratio", "behavior",
                                                                  "train", sql="SELECT 1")))
    assert not stops_may_differ(h0, unread)
    dead = h0.metric("dead_group_ratio")
    redefined = dataclasses.replace(h0, metrics=tuple(
        dataclasses.replace(m, sql="SELECT 0.0") if m is dead else m for m in h0.metrics))
    assert stops_may_differ(h0, redefined)  # the collapse rule reads latest.dead_group_ratio
    assert stops_may_differ(h0, dataclasses.replace(h0, params={**h0.params,
                                                                "stop_min_rollouts": 1}))
    assert not stops_may_differ(dataclasses.replace(h0, early_stop=()),
                                dataclasses.replace(unread, early_stop=()))


def test_a_stop_reads_the_alerts_its_rules_can_tell_apart():
    """What a replay diagnoses (stop_inputs): h0's rules read `critical` only as `'leak' in
    critical`, so the leak alert alone is kept, at its critical level, with the metrics the
    rules and that level name; a threshold of another alert moved changes no stop, the leak
    one's may. A rule that counts the critical behavior alerts keeps those; one that reads
    `critical` otherwise keeps every critical level; one that reads `warning_alerts` keeps
    every level."""
    import dataclasses

    from evotrainer.agent.stop_replay import stop_inputs, stops_may_differ
    from evotrainer.diagnosis.harness import resolve_harness

    h0 = resolve_harness("h0")
    cut = stop_inputs(h0)
    assert [a.name for a in cut.alerts] == ["leak"]
    assert all(level.severity == "critical" for a in cut.alerts for level in a.levels)
    assert all(a.sample_limit == 0 for a in cut.alerts)  # no rule reads examples
    assert {m.name for m in cut.metrics} == {"dead_group_ratio", "leak_ratio",
                                              "val_leak_ratio", "mean_logprob"}

    def moved(harness, alert, when):
        return dataclasses.replace(harness, alerts=tuple(
            dataclasses.replace(a, levels=tuple(
                dataclasses.replace(level, when=when) if level is a.levels[0] else level
                for level in a.levels)) if a.name == alert else a
            for a in harness.alerts))

    def ruled(when):
        return dataclasses.replace(h0, early_stop=(*h0.early_stop, dataclasses.replace(
            h0.early_stop[0], name="added", when=when)))

    assert not stops_may_differ(h0, moved(h0, "dead_groups", "dead_group_ratio > 0.9"))
    assert stops_may_differ(h0, moved(h0, "leak", "leak_ratio > 0.5"))
    behavior = ruled("critical_behavior_alerts > 1")
    assert {a.name for a in stop_inputs(behavior).alerts} == {"abandonment", "leak"}
    assert not stops_may_differ(behavior, moved(behavior, "dead_groups", "dead_group_ratio > 0.9"))
    counted = ruled("size(critical) > 1")
    assert {a.name for a in stop_inputs(counted).alerts} == {
        "dead_groups", "abandonment", "leak", "overconfidence"}
    assert stops_may_differ(counted, moved(counted, "dead_groups", "dead_group_ratio > 0.9"))
    warned = ruled("warning_alerts > 3")
    assert len(stop_inputs(warned).alerts) == len(h0.alerts)
    assert stops_may_differ(warned, moved(warned, "weak_signal", "reward_spread < 0.5"))


def test_a_backtest_reuses_its_diagnoses_of_the_same_evidence_and_reports_progress(
        recorded, monkeypatch):
    """A backtest keeps each diagnosis it computes, keyed by the revision, the version's and
    its parent's branches and the diagnosis code: the same backtest again re-diagnoses
    nothing and reports the same rows. Progress names each version in tree order and ends
    at the total."""
    from evotrainer.gate import harness_backtest

    gate = yaml.safe_load((recorded.root / "harness_revisions" / "h0.yaml").read_text())["gate"]
    write_revision(recorded, "h9", gate={**gate, "alpha": 0.2})
    seen: list[tuple[str, int, int]] = []
    first = harness_backtest.backtest_harness(
        recorded, "h9", "h0", progress=lambda *step: seen.append(step))
    assert [s[0] for s in seen] == ["v0", "v1", "v2", "v2"]
    assert [s[1:] for s in seen] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert list((recorded.state_dir / "cache" / "backtest").glob("*.json"))

    def no_diagnosis(*args, **kwargs):
        raise AssertionError("re-diagnosed evidence diagnosed before")

    monkeypatch.setattr(harness_backtest, "diagnose", no_diagnosis)
    again = harness_backtest.backtest_harness(recorded, "h9", "h0")
    assert again["versions"] == first["versions"]
    # Another revision is another key: its diagnoses are computed, not read.
    write_revision(recorded, "h8", gate={**gate, "alpha": 0.3})
    with pytest.raises(AssertionError, match="diagnosed before"):
        harness_backtest.backtest_harness(recorded, "h8", "h0")


def test_the_caller_and_a_child_meet_at_one_item_and_one_of_them_makes_it():
    """_Meeting: the child takes items from the last back while the caller is short of them,
    the caller finds the child on the item it comes to, and a child forked after the meeting
    was made sees where the caller is."""
    import os

    from evotrainer.agent.diff_work import _Meeting

    meeting = _Meeting(5)
    assert meeting.child_takes(4) and meeting.child_takes(3)
    assert not meeting.caller_meets(0) and not meeting.caller_meets(1)
    assert meeting.child_takes(2)
    assert meeting.caller_meets(2)  # the child is on it: the caller waits
    assert not meeting.child_takes(1)  # past the caller: the child stops
    other = _Meeting(3)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.read(read, 1)  # the caller has come to item 1
            os.write(write, b"y" if other.child_takes(2) and not other.child_takes(1) else b"n")
        finally:
            os._exit(0)
    assert not other.caller_meets(1)
    os.write(write, b".")
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"y"
