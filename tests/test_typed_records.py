"""Typed run/diagnosis/decision records: what the readers see of a record is what
the YAML says, a null field reads as its default, and converting the readers kept what gc,
the harness backtest and the model card decide."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from sealing import controller_commit
from test_checkpoints import lineage  # noqa: F401  (the fixture: v1 promoted, v2 pruned, v3 open)

from evotrainer.control.retention import plan_gc
from evotrainer.errors import EvoError
from evotrainer.gate.harness_backtest import recorded_versions
from evotrainer.report.views import _Evidence
from evotrainer.store.git import branch_name
from evotrainer.store.records import ACTIVE_STATES, DecisionRecord, JobState, RunRecord
from evotrainer.store.workspace import Workspace, run_path


def test_a_run_record_holds_the_job_states_as_their_strings():
    """JobState is the one list of run states: run.schema.json allows each but Unknown (a
    backend's word for a job it has no record of, never recorded), a record's string reads
    as its member, and what is active is one group of them."""
    schema = Path(__file__).resolve().parents[1] / "spec/schemas/run.schema.json"
    recorded = json.loads(schema.read_text())["properties"]["state"]["enum"]
    assert recorded == [s.value for s in JobState if s is not JobState.UNKNOWN]
    assert yaml.safe_dump({"state": JobState.STALLED.value}) == "state: Stalled\n"
    run = RunRecord.from_record({"state": "Stalled", "job_id": "evo-v1-a1-0123456789"})
    assert run.state == JobState.STALLED and run.active
    assert [s for s in JobState if s.active] == list(ACTIVE_STATES)
    assert not any(s.active and s.finished for s in JobState)


def test_null_fields_read_as_their_defaults_not_as_the_text_none():
    run = RunRecord.from_record({"state": None, "job_id": "evo-v1-a1-0123456789",
                                 "backend": None, "artifact_dir": None, "attempt": None})
    assert (run.state, run.backend, run.artifact_dir, run.attempt) == ("—", "local", "", 1)
    assert not run.succeeded and not run.active
    decision = DecisionRecord.from_record({"verdict": None, "reason": None, "blocked_by": None})
    assert (decision.verdict, decision.reason, decision.blocked_by) == ("", "", [])
    assert RunRecord.from_record(None) is None and DecisionRecord.from_record("x") is None


def test_the_typed_views_carry_what_the_readers_need(lineage):  # noqa: F811
    ws, _ = lineage
    v1, v3 = ws.version("v1"), ws.version("v3")
    assert v1.run.succeeded and v1.run.recipe_digest == "sha256:x" and v1.run.steps_done == 3
    assert v1.decision.verdict == "promote" and v1.decision.decided_at == "2026-01-02"
    assert v1.decision.comparison["delta"] == 0.1 and v1.decision.blocked_by == []
    assert v3.decision is None


def test_a_decision_without_a_verdict_keeps_its_policy_from_gc(lineage):  # noqa: F811
    """A decision record whose verdict is null is no verdict: v3's policy stays as open
    (read as "" or "None" it would be dropped as if the gate had pruned it)."""
    ws, policies = lineage
    path = run_path("v3", "decision.yaml")
    controller_commit(ws, "v3", {path: yaml.safe_dump(
        {"verdict": None, "reason": "interrupted"}).encode()}, "a verdict-less decision")
    drops, kept = plan_gc(ws)
    assert [d.version for d in drops] == ["v2"]
    assert kept["v3"] == "open (no verdict yet)"
    assert policies["v3"].is_dir()


def test_a_succeeded_run_naming_no_artifact_dir_is_not_backtested(lineage):  # noqa: F811
    """Without the guard the workspace root itself (an existing folder) passed for its
    artifacts; a record missing the key made the whole backtest fail instead."""
    ws, _ = lineage
    states = ws.versions()
    assert recorded_versions(ws, states) == ["v1", "v2", "v3"]
    run = {k: v for k, v in states["v2"].records["run"].items() if k != "artifact_dir"}
    states["v2"] = dataclasses.replace(states["v2"], records={**states["v2"].records,
                                                              "run": run})
    assert recorded_versions(ws, states) == ["v1", "v3"]


@pytest.mark.parametrize("field, value", [
    ("attempt", "many"), ("attempt", float("inf")), ("result", [1, 2]), ("artifacts", "x"),
    ("attempts", ["not a mapping"]),
])
def test_a_run_record_of_the_wrong_shape_is_one_error_line_not_a_traceback(
    lineage, cli, field, value,  # noqa: F811
):
    """The attack: a branch edits v2's run.yaml so a field has the wrong type (before,
    `int("many")` or `dict([1, 2])` raised out of the CLI as a traceback). The error belongs
    to v2: `plan` refuses it naming the field and exits 1; the other versions still list."""
    ws, _ = lineage
    branch, path = branch_name("v2"), run_path("v2", "run.yaml")
    run = yaml.safe_load(ws.git.read(branch, path))
    run[field] = value
    ws.git.commit_files(branch, {path: yaml.safe_dump(run).encode()}, "tamper", {})
    result = cli("-C", str(ws.root), "plan")
    assert result.code == 1
    assert "Traceback" not in result.output and "must be" in result.output
    assert field in result.output and "v2" in result.output
    listed = cli("-C", str(ws.root), "lineage")
    assert listed.code == 0 and "v3" in listed.output and "Traceback" not in listed.output


def test_a_record_pointing_elsewhere_cannot_make_the_report_show_its_rollouts(
    lineage, tmp_path,  # noqa: F811
):
    """The attack: a branch edits v2's run.yaml so its artifact_dir names a folder outside
    the artifact root holding rollouts. The report shows why instead of that folder's rows
    (before, it read them as v2's evidence)."""
    ws, _ = lineage
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "rollouts").mkdir(parents=True)
    (elsewhere / "rollouts" / "train.parquet").write_bytes(b"not v2's")
    branch, path = branch_name("v2"), run_path("v2", "run.yaml")
    run = yaml.safe_load(ws.git.read(branch, path))
    run["artifact_dir"] = str(elsewhere)
    # Sealed (as if the controller itself had written it), the folder check still refuses it.
    controller_commit(ws, "v2", {path: yaml.safe_dump(run).encode()}, "elsewhere")
    evidence = _Evidence(ws, ws.version("v2"))
    assert evidence.folder is None and "not its artifact folder" in evidence.missing()
    # Committed by a branch author, the record is forged: the report says so.
    run["artifact_dir"] = str(elsewhere / "rollouts" / "..")
    ws.git.commit_files(branch, {path: yaml.safe_dump(run).encode()}, "tamper", {})
    evidence = _Evidence(ws, Workspace(ws.root).version("v2"))
    assert evidence.folder is None and "forged records" in evidence.missing()
    assert _Evidence(ws, ws.version("v1")).missing() is None  # an untouched record reads


def test_a_run_record_carries_its_stop_times_exit_code_and_log_tail_typed():
    """What reconcile and lineage read of a run (its stop, start and end, a failure's exit
    code and log tail) comes from the typed view; a wrong shape names its field."""
    base = {"state": "Failed", "job_id": "evo-v1-a1-0123456789", "attempt": 1}
    run = RunRecord.from_record({**base, "exit_code": 3, "log_tail": "oom", "started_at": "t0",
                                 "finished_at": "t1", "stopped": {"rule": "leak", "step": 4}})
    assert (run.exit_code, run.log_tail, run.started_at, run.finished_at) == (3, "oom", "t0", "t1")
    assert run.stopped == {"rule": "leak", "step": 4}
    quiet = RunRecord.from_record(base)
    assert quiet.exit_code is None and quiet.stopped is None and quiet.log_tail == ""
    for key, value in (("exit_code", "crashed"), ("stopped", ["leak"])):
        with pytest.raises(EvoError) as err:
            RunRecord.from_record({**base, key: value}, "evo/v1:runs/v1/run.yaml")
        assert err.value.field == key and err.value.where == "evo/v1:runs/v1/run.yaml"
