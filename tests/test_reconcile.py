"""Reconcile end to end with a stand-in engine (tests/standin_engine.py): real subprocess
jobs, real h0 diagnosis, real paired bootstrap gate, real git history."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import git
import pytest
import yaml
from standin import converge, propose, record

from evotrainer.control.reconcile import FAULT_ENV, load_context, plan
from evotrainer.control.versions import approve, new_version
from evotrainer.store.lock import workspace_lock
from evotrainer.store.workspace import Workspace

# What the clock decides: timestamps, and the hours measured between them (a run's usage).
TIMESTAMPS = {"created_at", "started_at", "finished_at", "decided_at", "at", "usage",
              "wall_hours", "gpu_hours"}
pytestmark = pytest.mark.usefixtures("standin")


def test_full_loop_launches_diagnoses_gates_and_promotes(workspace, cli):
    propose(workspace, "v1", standin_skill=0.65)
    assert cli("-C", str(workspace.root), "plan").code == 2
    plans = converge(workspace)
    assert [(p.version, p.sync, p.health, p.action) for p in plans] == [
        ("v0", "Synced", "Succeeded", None), ("v1", "Synced", "Succeeded", None)]
    v0, v1 = record(workspace, "v0", "decision"), record(workspace, "v1", "decision")
    assert v0["verdict"] == "baseline"
    assert v1["verdict"] == "promote" and v1["comparison"]["ci_low"] > 0
    assert "Δ avg@k +" in v1["reason"]
    run = record(workspace, "v1", "run")
    assert run["state"] == "Succeeded" and run["attempt"] == 1
    assert run["artifacts"]["scores"]["digest"].startswith("sha256:")
    repo = git.Repo(workspace.root)
    assert (workspace.root / "runs" / "v1" / "decision.yaml").is_file()  # merged into main
    actions = [c.message.split("Evotrainer-Action: ")[1].split()[0]
               for c in repo.iter_commits("evo/v0..evo/v1")]
    # Every state change is one commit, newest first. A `poll` (Pending → Running) is
    # committed only when a pass sees the job still running: once at most, before collect.
    assert [a for a in actions if a != "poll"] == [
        "gate", "diagnose", "collect", "launch", "approve", "propose"]
    assert actions.count("poll") <= 1 and actions[3] in ("poll", "launch")
    assert "Evotrainer-Action: promote" in repo.commit("main").message
    assert cli("-C", str(workspace.root), "plan").code == 0
    rows = json.loads(cli("-C", str(workspace.root), "lineage", "--json").out)
    assert rows[1]["status"] == "promote" and rows[1]["ci"][0] > 0 and rows[1]["on_main"]


def test_leak_blocks_promotion_whatever_the_score(workspace):
    propose(workspace, "v1", standin_skill=0.65, standin_leak=True)
    converge(workspace)
    decision = record(workspace, "v1", "decision")
    assert decision["comparison"]["ci_low"] > 0  # it did score higher ...
    assert decision["verdict"] == "prune" and "leak" in decision["blocked_by"]  # ... and is blocked
    assert "pruned/v1" in [t.name for t in git.Repo(workspace.root).tags]
    assert not (workspace.root / "runs" / "v1").exists()  # main never saw it


def test_failed_job_is_retried_then_kept_as_failed(workspace):
    propose(workspace, "v1", standin_fail=True)
    plans = converge(workspace)
    v1 = next(p for p in plans if p.version == "v1")
    assert v1.health == "Failed" and v1.action is None and "negative evidence" in v1.note
    run = record(workspace, "v1", "run")
    assert run["attempt"] == 2 and run["state"] == "Failed"
    assert run["attempts"][0]["state"] == "Failed"
    assert "failing on purpose" in run["log_tail"]


def test_unapproved_version_is_never_launched(workspace):
    new_version(workspace, "v1", "v0", rationale="not yet")
    plans = converge(workspace)
    v1 = next(p for p in plans if p.version == "v1")
    assert v1.action is None and "awaiting approval" in v1.note
    assert record(workspace, "v1", "run") is None


def test_drift_and_harness_change(workspace):
    propose(workspace, "v1", standin_skill=0.5)
    converge(workspace)
    # Edit the spec after the run: Drifted, and nothing happens until re-approval.
    state = workspace.version("v1")
    spec = dict(state.spec, description="edited after the run")
    from evotrainer.control.versions import spec_text

    workspace.git.commit_files("evo/v1", {"spec/versions/v1.yaml": spec_text(spec).encode()},
                               "edit")
    v1 = next(p for p in plan(load_context(workspace)) if p.version == "v1")
    assert v1.sync == "Drifted" and v1.action is None and "re-approve" in v1.note
    # A new harness revision in force: re-diagnose only, no new launch.
    h0 = workspace.root / "harness_revisions" / "h0.yaml"
    doc = yaml.safe_load(h0.read_text())
    doc["name"], doc["description"] = "h1", "h0 with a stricter truncation alert"
    (workspace.root / "harness_revisions" / "h1.yaml").write_text(yaml.safe_dump(doc))
    project = workspace.root / "spec" / "project.yaml"
    project.write_text(project.read_text().replace("harness: h0", "harness: h1"))
    repo = git.Repo(workspace.root)
    repo.git.add("-A")
    repo.git.commit("-m", "harness h1", env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                             "GIT_COMMITTER_NAME": "t",
                                             "GIT_COMMITTER_EMAIL": "t@t"})
    fresh = Workspace(workspace.root)
    kinds = {p.version: p.action.kind for p in plan(load_context(fresh)) if p.action}
    assert kinds == {"v0": "rediagnose"}  # v1 is Drifted: it waits for re-approval
    jobs_before = sorted(p.name for p in fresh.artifact_root.glob("*/evo-*"))
    converge(fresh)
    assert record(fresh, "v0", "diagnosis")["harness"]["name"] == "h1"
    assert sorted(p.name for p in fresh.artifact_root.glob("*/evo-*")) == jobs_before
    approve(fresh, "v1", by="tester")  # re-approval retrains the drifted spec
    assert next(p for p in plan(load_context(fresh)) if p.version == "v1").action.kind == "retry"


def test_missing_artifacts_and_dirty_worktree_give_clear_errors(workspace, monkeypatch):
    propose(workspace, "v1", standin_skill=0.5)
    converge(workspace)
    # The re-approval below lands in the launch's own second (records are to the second): it
    # still counts. This once flaked on a fast machine.
    import evotrainer.control.versions as versions

    monkeypatch.setattr(versions, "now_iso", lambda: record(workspace, "v1", "run")["created_at"])
    # Uncommitted work in a worktree that a retrain would have to move: refused, untouched.
    worktree = workspace.worktree_path("v1")
    (worktree / "notes.txt").write_text("my analysis")
    state = workspace.version("v1")
    from evotrainer.control.versions import spec_text

    spec = dict(state.spec, recipe={"domain": {"params": {"standin_skill": 0.55}}})
    workspace.git.commit_files("evo/v1", {"spec/versions/v1.yaml": spec_text(spec).encode()},
                               "edit")
    approve(workspace, "v1", by="tester")
    plans = {p.version: p for p in converge(workspace)}  # v1's error does not stop the pass
    assert "uncommitted changes" in plans["v1"].error
    assert (worktree / "notes.txt").read_text() == "my analysis"
    # Refused before anything is recorded: no attempt spent on a job never submitted.
    assert record(workspace, "v1", "run")["attempt"] == 1
    # Artifacts deleted under a recorded run: the re-diagnosis names the folder and the fix.
    run = record(workspace, "v0", "run")
    shutil.rmtree(workspace.root / run["artifact_dir"])
    h0 = workspace.root / "harness_revisions" / "h0.yaml"
    h0.write_text(h0.read_text().replace("truncation_rate > 0.15", "truncation_rate > 0.2")
                  .replace("threshold: 0.15", "threshold: 0.2"))
    plans = {p.version: p for p in converge(workspace)}
    assert "artifacts of v0 are gone" in plans["v0"].error
    assert record(workspace, "v0", "decision") is not None  # records are intact


def test_lock_blocks_second_reconcile_and_stale_lock_is_reported(workspace, cli):
    with workspace_lock(workspace.state_dir / "lock", "evotrainer reconcile"):
        result = cli("-C", str(workspace.root), "reconcile")
        assert result.code == 1 and "another reconcile holds the workspace lock" in result.err
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (workspace.state_dir / "lock").write_text(json.dumps(
        {"host": os.uname().nodename, "pid": int(dead), "create_time": 0,
         "command": "evotrainer reconcile", "started_at": "2026-01-01T00:00:00+00:00"}))
    result = cli("-C", str(workspace.root), "reconcile")
    assert result.code == 1 and "stale lock" in result.err and "unlock --force" in result.err
    assert cli("-C", str(workspace.root), "unlock", "--force").code == 0
    assert not (workspace.state_dir / "lock").exists()


def signature(root: Path) -> dict:
    """Every recorded file on every ref, timestamps removed; tags; record commits."""
    repo = git.Repo(root)
    out: dict = {"tags": sorted(t.name for t in repo.tags)}
    for ref in repo.heads:
        files = {}
        for blob in ref.commit.tree.traverse():
            # A seal is the MAC of timestamped records: that it verifies is checked apart.
            if blob.path.endswith("/seal.yaml"):
                continue
            if blob.type == "blob" and blob.path.startswith(("runs/", "spec/versions/")):
                data = yaml.safe_load(blob.data_stream.read()) if blob.path.endswith(
                    ".yaml") else blob.data_stream.read()
                files[blob.path] = _strip(data)
        # The record commits in order; whether a job was *seen* Running (a poll commit)
        # depends on timing, everything else must be identical.
        actions = [c.message.split("Evotrainer-Action: ")[-1].split()[0]
                   for c in repo.iter_commits(ref, first_parent=True)
                   if "Evotrainer-Action: " in c.message]
        out[ref.name] = {"files": files, "actions": [a for a in actions if a != "poll"]}
    return out


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in TIMESTAMPS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


CRASHING_RUN = """
import sys
from pathlib import Path
from evotrainer.store.workspace import Workspace
from standin import converge, propose, record
from standin import reconciler
reconciler(Workspace(Path(sys.argv[1]))).run(wait=True, poll_s=0.05)
"""


def test_crash_at_every_action_boundary_converges_to_the_same_state(workspace, tmp_path):
    propose(workspace, "v1", standin_skill=0.65)
    template = tmp_path / "template"
    shutil.copytree(workspace.root, template)
    converge(workspace)
    expected = signature(workspace.root)
    boundary = 1
    while True:
        ws_dir = tmp_path / f"crash{boundary}"
        shutil.copytree(template, ws_dir)
        env = {**os.environ, FAULT_ENV: str(boundary)}
        crashed = subprocess.run([sys.executable, "-c", CRASHING_RUN, str(ws_dir)], env=env,
                                 capture_output=True, text=True)
        assert crashed.returncode in (0, 99), crashed.stderr
        ws = Workspace(ws_dir)
        converge(ws)
        assert signature(ws_dir) == expected, f"diverged after a crash at boundary {boundary}"
        assert not any(s.record_errors or s.unverified for s in ws.versions().values())
        launches = [p for p in ws.artifact_root.glob("*/evo-*/job.json")]
        assert len(launches) == 2  # one job per version: no duplicate launch
        if crashed.returncode == 0:  # the run finished before reaching this boundary
            break
        boundary += 1
    assert boundary > 8  # every boundary of a two-version lineage was exercised


def test_a_stalled_job_keeps_its_concurrency_slot(workspace):
    """Active has one meaning (store.records.ACTIVE_STATES): a Stalled job still holds its
    machine, so another version waits for `max_concurrent_jobs` rather than launching."""
    from sealing import controller_commit

    from evotrainer.control.reconcile import load_context, plan
    from evotrainer.store.workspace import run_path

    propose(workspace, "v1", standin_skill=0.6)
    propose(workspace, "v2", standin_skill=0.6)
    stalled = {"apiVersion": "evotrainer/v1", "kind": "Run", "version": "v1", "attempt": 1,
               "job_id": "evo-v1-a1-0123456789", "backend": "local", "state": "Stalled",
               "artifact_dir": ".evotrainer/artifacts/v1/evo-v1-a1-0123456789"}
    controller_commit(workspace, "v1", {run_path("v1", "run.yaml"): yaml.safe_dump(
        stalled).encode()})
    controller_commit(workspace, "v0", {run_path("v0", "run.yaml"): yaml.safe_dump(
        dict(stalled, version="v0", job_id="evo-v0-a1-0123456789", state="Succeeded",
             artifact_dir=".evotrainer/artifacts/v0/evo-v0-a1-0123456789")).encode()})
    plans = {p.version: p for p in plan(load_context(workspace))}
    assert plans["v2"].action is None and "max_concurrent_jobs" in plans["v2"].note
