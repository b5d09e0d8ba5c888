"""Early stop wired into reconcile, with the stand-in engine as real subprocess jobs that
flush their rollouts at each step (tests/standin_engine.py `standin_flush`): a leaky running
job is stopped, recorded in one commit and pruned; a clean one runs to the end; a reconcile
that dies between the stop's commit and the cancel is repaired by the next pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
from standin import converge, reconciler, record, standin_settings, wait_for

from evotrainer.control.live import live_dir
from evotrainer.control.reconcile import diagnose_version, load_context, plan, steps_spent
from evotrainer.control.versions import approve, new_version
from evotrainer.errors import EvoError
from evotrainer.store.git import PRUNED_TAG_PREFIX
from evotrainer.store.lineage import lineage_rows
from evotrainer.store.workspace import Workspace, run_path

pytestmark = pytest.mark.usefixtures("standin")
# At 0.05 s a step: 150 s if nothing stopped it, so however loaded the machine, the job is
# still running when the stop (or the crash before its cancel) comes.
STEPS = 3000


def flushing_version(ws: Workspace, name: str, leak: bool, steps: int = STEPS) -> None:
    new_version(ws, name, "v0", rationale="live", settings=[
        *standin_settings(standin_step_s=0.05, standin_flush=True, standin_leak=leak,
                          standin_skill=0.5),
        f"grpo.steps={steps}"])
    approve(ws, name, by="tester")


def job_pid(ws: Workspace, name: str) -> int:
    return json.loads(next(ws.artifact_root.glob(f"{name}/evo-*/job.json")).read_text())["pid"]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop_commits(ws: Workspace, name: str) -> list[str]:
    """The commits of `name`'s branch made by an early stop, each as its changed paths."""
    log = ws.git.repo.git.log(f"evo/{name}", "--grep=Evotrainer-Action: stop",
                              "--format=%H")
    return [ws.git.repo.git.show("--name-only", "--format=", sha).split() for sha in
            log.split()]


def test_a_leaky_running_job_is_stopped_recorded_in_one_commit_and_pruned(workspace):
    converge(workspace)  # v0 first: v1 then runs alone
    flushing_version(workspace, "v1", leak=True)
    converge(workspace)
    pid = job_pid(workspace, "v1")
    wait_for(lambda: gone(pid))

    run = record(workspace, "v1", "run")
    assert run["state"] == "Stopped" and run["stopped"]["rule"] == "leak"
    step = run["stopped"]["step"]
    assert 1 <= step < STEPS and run["result"]["steps_done"] == step
    # One commit holds the stopped run, its (live) diagnosis and the prune decision, with the
    # controller's seal over them.
    [paths] = stop_commits(workspace, "v1")
    assert sorted(paths) == sorted(run_path("v1", f"{kind}.yaml")
                                   for kind in ("run", "diagnosis", "decision", "seal"))
    decision = record(workspace, "v1", "decision")
    assert decision["verdict"] == "prune" and decision["blocked_by"] == ["leak"]
    assert decision["rule"] == "early_stop.leak"
    assert "leak" in [a["name"] for a in record(workspace, "v1", "diagnosis")["alerts"]]
    assert "v1" in workspace.git.tags(PRUNED_TAG_PREFIX)

    # Nothing left to do; plan and lineage show it pruned by the alert at its step.
    ctx = load_context(workspace)
    [v1] = [p for p in plan(ctx) if p.version == "v1"]
    assert v1.action is None and v1.health == "Stopped"
    assert v1.note == f"stopped early by alert leak at step {step} of {STEPS}; done: prune"
    [row] = [r for r in lineage_rows(workspace) if r.name == "v1"]
    assert row.status == "prune" and row.pruned and row.stopped["step"] == step
    # The steps it ran count in the autonomy budget, the steps it was spared do not.
    assert steps_spent(ctx) == step + (ctx.states["v0"].run.steps_done)
    # Diagnosing it again points at the diagnosis recorded at the stop, not at a reconcile
    # that has nothing left to do.
    with pytest.raises(EvoError) as err:
        diagnose_version(workspace, "v1")
    assert f"stopped early by rule leak at step {step}" in err.value.message
    assert "git show evo/v1:runs/v1/diagnosis.yaml" in err.value.hint


def test_a_clean_running_job_is_diagnosed_live_and_not_stopped(workspace):
    converge(workspace)
    flushing_version(workspace, "v1", leak=False, steps=16)
    converge(workspace)
    assert record(workspace, "v1", "run")["state"] == "Succeeded"
    assert stop_commits(workspace, "v1") == []
    # It was looked at while it ran (train rollouts diagnosed), and no rule held.
    live = json.loads((live_dir(workspace, "v1") / "state.json").read_text())
    assert live["progress"]["rows"] > 0 and live["stop"] is None
    assert record(workspace, "v1", "decision")["rule"] != "early_stop.leak"


CRASH_BEFORE_CANCEL = """
import os, sys
from pathlib import Path
from standin import StandinBackend
from evotrainer.control.reconcile import Reconciler
from evotrainer.store.workspace import Workspace

class CrashOnCancel(StandinBackend):
    def cancel(self, job):
        os._exit(99)  # the reconcile process dies after the stop's commit, before the kill

Reconciler(Workspace(Path(sys.argv[1])), log=lambda _: None,
           backends={"local": CrashOnCancel()}).run(wait=True, poll_s=0.05)
"""


def test_a_crash_between_the_stop_commit_and_the_cancel_converges(workspace):
    converge(workspace)
    flushing_version(workspace, "v1", leak=True)
    crashed = subprocess.run([sys.executable, "-c", CRASH_BEFORE_CANCEL, str(workspace.root)],
                             env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert crashed.returncode == 99, crashed.stderr
    pid = job_pid(workspace, "v1")
    try:
        assert not gone(pid)  # recorded as stopped, still running
        assert record(workspace, "v1", "run")["state"] == "Stopped"
        [v1] = [p for p in plan(load_context(workspace)) if p.version == "v1"]
        assert v1.action.kind == "stop" and "still running" in v1.action.reason

        reconciler(workspace).run()
        wait_for(lambda: gone(pid))
    finally:  # a failed assertion must not leave the orphaned job running
        if not gone(pid):
            psutil.Process(pid).kill()
    assert len(stop_commits(workspace, "v1")) == 1  # cancelled again, not recorded again
    assert "v1" in workspace.git.tags(PRUNED_TAG_PREFIX)
    assert record(workspace, "v1", "run")["state"] == "Stopped"
