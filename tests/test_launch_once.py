"""The work of a launch and of a look is done once, counted, never timed: in a
reconcile pass that launches a version, its recipe goes through the backend's checks once
and the parent's policy it continues from is hashed once; a running job gets one live look
a pass even when an earlier action of the pass makes reconcile decide its version again."""

from __future__ import annotations

import collections
import json

import psutil
import pytest
import yaml
from standin import StandinBackend, converge, propose, reconciler, standin_settings, wait_for
from test_early_stop import flushing_version, job_pid

from evotrainer.control import observe
from evotrainer.control.versions import approve, new_version
from evotrainer.store import checkpoints
from evotrainer.store.workspace import PROJECT_FILE, Workspace

pytestmark = pytest.mark.usefixtures("standin")


class Calls:
    """How often each wrapped function ran, and with what first arguments."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.args: dict[str, list[tuple]] = collections.defaultdict(list)

    def count(self, owner: object, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.args[name].append(args)
            return original(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, counted)


def continuing_child(ws: Workspace, name: str) -> None:
    new_version(ws, name, "v0", rationale="continue", settings=[
        *standin_settings(standin_skill=0.5), 'model.init="parent"'])
    approve(ws, name, by="tester")


def test_a_launch_checks_its_recipe_once_and_hashes_the_parents_policy_once(
        workspace, monkeypatch):
    converge(workspace)  # v0's recorded policy is what v1 continues from
    continuing_child(workspace, "v1")
    calls = Calls(monkeypatch)
    calls.count(StandinBackend, "check")
    calls.count(checkpoints, "directory_digest")
    plans, applied = reconciler(workspace).pass_once()
    assert applied == 1 and [p.action.kind for p in plans if p.action] == ["launch"]
    # The job's recipe (the one that names the parent's policy) is checked once...
    starts = [args[1] for args in calls.args["check"]
              if (args[1].get("model") or {}).get("init_checkpoint")]
    assert len(starts) == 1
    # ...and is the one submitted, naming the policy hashed once (of the one policy there).
    run = workspace.version("v1").run
    job = json.loads((workspace.root / run.artifact_dir / "job.json").read_text())
    assert job["pid"] and len(calls.args["directory_digest"]) == 1
    assert calls.args["directory_digest"][0][0].name == "checkpoint"


def test_a_recipe_the_pass_validated_is_not_checked_again_at_its_launch(workspace, monkeypatch):
    """v1 trains from the base model: its job runs the very recipe the pass's validation
    checked, so its launch asks the backend nothing more. Every distinct recipe of the pass
    (the project's, which v0 resolves to, and v1's) is checked once."""
    converge(workspace)
    propose(workspace, "v1", standin_skill=0.5)
    calls = Calls(monkeypatch)
    calls.count(StandinBackend, "check")
    plans, applied = reconciler(workspace).pass_once()
    assert applied == 1 and [p.action.kind for p in plans if p.action] == ["launch"]
    checked = [json.dumps(args[1], sort_keys=True) for args in calls.args["check"]]
    assert len(checked) == len(set(checked))
    launched = workspace.version("v1").run
    assert launched.state == "Pending" and any(
        json.loads(recipe)["domain"]["params"].get("standin_skill") == 0.5 for recipe in checked)


def test_a_running_job_gets_one_live_look_a_pass_even_when_decided_again(workspace,
                                                                         monkeypatch):
    """Two job slots. v1 runs (its record still Pending: the pass polls it); a0, approved
    meanwhile, sorts before it and launches first, so the pass decides v1 again after that
    launch. v1's job is looked at once in that pass, not once per decision."""
    project = workspace.root / PROJECT_FILE
    data = yaml.safe_load(project.read_text())
    data["autonomy"] = {**(data.get("autonomy") or {}), "max_concurrent_jobs": 2}
    project.write_text(yaml.safe_dump(data, sort_keys=False))
    ws = Workspace(workspace.root)
    approve(ws, "v0", by="tester")  # the project changed after init approved it
    converge(ws)
    flushing_version(ws, "v1", leak=False)
    launching = reconciler(ws)
    launching.pass_once()  # v1's Pending record, its job submitted
    pid = job_pid(ws, "v1")
    try:
        wait_for(lambda: (ws.artifact_root / "v1").is_dir() and any(
            (ws.artifact_root / "v1").glob("evo-*/rollouts/train.parquet")))
        new_version(ws, "a0", "v0", rationale="first in tree order",
                    settings=standin_settings(standin_skill=0.5))
        approve(ws, "a0", by="tester")
        calls = Calls(monkeypatch)
        calls.count(observe, "observe_running")
        calls.count(observe, "observe")
        plans, applied = reconciler(ws).pass_once()
        actions = {p.version: p.action.kind for p in plans if p.action}
        assert actions == {"a0": "launch", "v1": "poll"} and applied == 2
        observed = collections.Counter(args[1].name for args in calls.args["observe"])
        assert observed["v1"] == 2  # decided again after a0's launch...
        looks = [args[1].name for args in calls.args["observe_running"]]
        assert looks == ["v1"]  # ...from the one look of the pass
    finally:
        psutil.Process(pid).kill()
        for job in ws.artifact_root.glob("a0/evo-*/job.json"):
            psutil.Process(json.loads(job.read_text())["pid"]).kill()
