"""A version's job by hand (cancel, logs, progress), the trained policy as a recorded
artifact and children continuing from it, and records a tampered branch cannot abuse —
with the stand-in engine (tests/standin_engine.py) as real subprocess jobs."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from sealing import controller_commit
from standin import converge, propose, reconciler, record, standin_settings, wait_for

from evotrainer.control.reconcile import diagnose_version, load_context, plan
from evotrainer.control.versions import approve, new_version
from evotrainer.errors import EvoError
from evotrainer.store.checkpoints import directory_digest
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")
RUN_STATES = json.loads((Path(__file__).resolve().parents[1] / "spec/schemas/run.schema.json")
                        .read_text())["properties"]["state"]["enum"]
# The run schema's state enum gains "Cancelled" (a change the schema's owner applies).
needs_cancelled_state = pytest.mark.skipif(
    "Cancelled" not in RUN_STATES, reason="spec/schemas/run.schema.json lacks state Cancelled")

BOMB = b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}]\n".encode() for i in range(9))


def slow_version(ws: Workspace, name: str, steps: int, step_s: float) -> None:
    new_version(ws, name, "v0", rationale="slow", settings=[
        *standin_settings(standin_step_s=step_s), f"grpo.steps={steps}"])
    approve(ws, name, by="tester")


def plan_of(ws: Workspace, name: str):
    return next(p for p in plan(load_context(ws)) if p.version == name)


@needs_cancelled_state
def test_cancel_stops_the_job_records_cancelled_and_retry_relaunches(workspace, cli):
    converge(workspace)  # v0 first: v1 then runs alone
    slow_version(workspace, "v1", steps=200, step_s=0.2)
    reconciler(workspace).run()  # launches v1 and returns: its job is running
    job = json.loads(next(workspace.artifact_root.glob("v1/evo-*/job.json")).read_text())
    wait_for(lambda: "step 2:" in cli("-C", str(workspace.root), "logs", "v1").out)
    running = plan_of(workspace, "v1")
    assert running.health == "Running" and "step " in running.note and "of 200" in running.note

    result = cli("-C", str(workspace.root), "cancel", "v1", "--by", "ann")
    assert result.code == 0, result.output
    wait_for(lambda: not psutil.pid_exists(job["pid"]) or psutil.Process(
        job["pid"]).status() == psutil.STATUS_ZOMBIE)
    run = record(workspace, "v1", "run")
    assert run["state"] == "Cancelled" and run["detail"] == "cancelled by ann"
    assert run["usage"]["gpu_hours"] == 0.0 and run["usage"]["wall_hours"] >= 0.0  # recorded
    head = workspace.git.repo.commit("evo/v1").message
    assert "Evotrainer-Action: cancel" in head
    plans = reconciler(workspace).run()  # not relaunched, not failed
    v1 = next(p for p in plans if p.version == "v1")
    assert v1.health == "Cancelled" and v1.action is None and "retry" in v1.note
    assert record(workspace, "v1", "run")["state"] == "Cancelled"
    again = cli("-C", str(workspace.root), "cancel", "v0")
    assert again.code == 1 and "no running job" in again.output

    assert cli("-C", str(workspace.root), "retry", "v1").code == 0
    assert record(workspace, "v1", "run")["attempt"] == 2
    assert plan_of(workspace, "v1").action.kind == "launch"


def test_logs_follow_prints_the_job_log_until_it_ends(workspace, cli):
    converge(workspace)
    slow_version(workspace, "v1", steps=6, step_s=0.1)
    reconciler(workspace).run()
    result = cli("-C", str(workspace.root), "logs", "v1", "-f")
    assert result.code == 0, result.output
    lines = result.out.splitlines()
    assert lines[0] == "stand-in run of v1"
    assert [line.split(" step ")[1].split(":")[0] for line in lines if " step " in line] == [
        str(step) for step in range(1, 7)]  # every step once, in order
    never = cli("-C", str(workspace.root), "logs", "v9")
    assert never.code == 1 and "no version 'v9'" in never.output


def test_the_policy_is_recorded_and_a_child_continues_from_it(workspace):
    propose(workspace, "v1", standin_skill=0.5)
    new_version(workspace, "v2", "v1", rationale="continue", settings=[
        *standin_settings(standin_skill=0.5), 'model.init="parent"'])
    approve(workspace, "v2", by="tester")
    waiting = plan_of(workspace, "v2")
    assert waiting.action is None and "waiting for v1's trained policy" in waiting.note

    converge(workspace)
    policy = record(workspace, "v1", "run")["artifacts"]["checkpoint"]
    assert policy["digest"] == directory_digest(workspace.root / policy["path"])[0]
    child = record(workspace, "v2", "run")
    log = (workspace.root / child["artifact_dir"] / "train.log").read_text()
    assert f"continuing from {workspace.root / policy['path']} {policy['digest']}" in log
    assert record(workspace, "v2", "decision") is not None  # diagnosed and gated as usual

    # A policy changed under its record: no child starts from it.
    (workspace.root / policy["path"] / "model.safetensors").write_bytes(b"other weights")
    new_version(workspace, "v3", "v1", rationale="continue again", settings=[
        *standin_settings(standin_skill=0.5), 'model.init="parent"'])
    approve(workspace, "v3", by="tester")
    plans = converge(workspace)
    v3 = next(p for p in plans if p.version == "v3")
    assert v3.error and "recorded policy of v1 changed" in v3.error
    assert not list(workspace.artifact_root.glob("v3/evo-*/job.json"))


def test_an_alias_bomb_in_a_run_record_is_refused_at_once(workspace):
    new_version(workspace, "v1", "v0", rationale="bomb")
    approve(workspace, "v1", by="tester")
    workspace.git.commit_files("evo/v1", {"runs/v1/run.yaml": BOMB}, "a bomb")
    plans = converge(Workspace(workspace.root))
    v1 = next(p for p in plans if p.version == "v1")
    assert v1.error and "unreadable run record" in v1.error and v1.action is None
    assert not (workspace.artifact_root / "v1").exists()  # never launched over it


def test_a_run_record_pointing_at_another_folder_is_refused(workspace, cli):
    propose(workspace, "v1", standin_skill=0.5)
    converge(workspace)
    run = record(workspace, "v1", "run")
    v0_dir = record(workspace, "v0", "run")["artifact_dir"]
    from evotrainer.control.reconcile import record_text

    forged = dict(run, artifact_dir=v0_dir)  # diagnose v1 from v0's evidence
    # Even a sealed record (a leaked key) reaches no folder but the version's own.
    controller_commit(workspace, "v1", {"runs/v1/run.yaml": record_text("run", forged).encode()})
    with pytest.raises(EvoError, match="names .* not its artifact folder"):
        diagnose_version(Workspace(workspace.root), "v1")
    outside = dict(run, artifact_dir="/etc")
    controller_commit(workspace, "v1", {"runs/v1/run.yaml": record_text("run", outside).encode()})
    with pytest.raises(EvoError, match="not its artifact folder"):
        diagnose_version(Workspace(workspace.root), "v1")
    # A branch author's record is not the controller's: v1 reads as never collected.
    workspace.git.commit_files(
        "evo/v1", {"runs/v1/run.yaml": record_text("run", forged).encode()}, "forged")
    with pytest.raises(EvoError, match="no collected run"):
        diagnose_version(Workspace(workspace.root), "v1")


def test_compare_with_a_version_that_does_not_exist_says_so(workspace, cli):
    converge(workspace)
    result = cli("-C", str(workspace.root), "compare", "v0", "v9")
    assert result.code == 1 and "no version 'v9'" in result.output
    assert "reconcile it first" not in result.output
