"""Records and runs: atomic promotion, errors that belong to their version, a
lock that cannot deadlock, idempotent launches, infrastructure failures and `retry`,
absolute artifact roots, verified artifact digests, no raw tracebacks."""

from __future__ import annotations

import json
import os
import shutil
import sys

import git
import psutil
import pytest
import standin
from standin import StandinBackend, converge, propose, record, wait_for

from evotrainer.backends.base import JobSpec
from evotrainer.backends.local import JOB_FILE, spawn_detached
from evotrainer.control.reconcile import diagnose_version
from evotrainer.control.versions import new_version, spec_text
from evotrainer.errors import EvoError
from evotrainer.store.git import GitStore
from evotrainer.store.records import JobState
from evotrainer.store.workspace import Workspace, version_spec_path

pytestmark = pytest.mark.usefixtures("standin")
IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t"}


def plans_of(ws) -> dict:
    return {p.version: p for p in converge(ws)}


def test_failed_promotion_leaves_main_and_the_records_untouched(workspace, monkeypatch):
    """An untracked runs/v1/run.yaml in main's checkout is in the way of v1's promotion:
    main must not move (else the next ordinary commit deletes the records)."""
    propose(workspace, "v1", standin_skill=0.65)
    untracked = workspace.root / "runs" / "v1" / "run.yaml"
    original = GitStore.merge_into
    placed = []

    def place_file_then_merge(self, target, source, message):
        if source == "evo/v1" and not placed:
            placed.append(source)
            untracked.parent.mkdir(parents=True, exist_ok=True)
            untracked.write_text("local\n")
        return original(self, target, source, message)

    monkeypatch.setattr(GitStore, "merge_into", place_file_then_merge)
    plans = plans_of(workspace)
    assert "cannot follow" in plans["v1"].error and "runs/v1/run.yaml" in plans["v1"].error
    repo = git.Repo(workspace.root)
    assert not repo.is_ancestor(repo.rev_parse("evo/v1").hexsha, repo.rev_parse("main").hexsha)
    assert untracked.read_text() == "local\n"
    assert not [line for line in repo.git.status("--porcelain").splitlines()
                if line.startswith(" D")]  # no record shows as deleted
    untracked.unlink()
    assert plans_of(workspace)["v1"].error is None
    assert repo.is_ancestor(repo.rev_parse("evo/v1").hexsha, repo.rev_parse("main").hexsha)


def test_one_bad_version_does_not_stop_the_others(workspace, cli):
    new_version(workspace, "v1", "v0", rationale="typo")
    spec = dict(workspace.version("v1").spec, parent="v9")
    workspace.git.commit_files("evo/v1", {version_spec_path("v1"): spec_text(spec).encode()},
                               "typo")
    new_version(workspace, "v2", "v0", rationale="cycle a")
    new_version(workspace, "v3", "v2", rationale="cycle b")
    spec = dict(workspace.version("v2").spec, parent="v3")
    workspace.git.commit_files("evo/v2", {version_spec_path("v2"): spec_text(spec).encode()},
                               "cycle")
    propose(workspace, "v4", standin_skill=0.6)
    out = cli("-C", str(workspace.root), "plan", "--json")
    rows = {r["version"]: r for r in json.loads(out.out)["versions"]}
    assert out.code == 1
    assert "v9" in rows["v1"]["error"] and "cycle" in rows["v2"]["error"]
    assert rows["v4"]["error"] is None
    result = cli("-C", str(workspace.root), "reconcile")
    assert result.code == 1 and "v1" in result.out
    converge(workspace)
    assert record(workspace, "v4", "decision") is not None  # the others went ahead


@pytest.mark.parametrize("content", ["", "garbage{", '{"pid": "1"}', "DIR", "FOREIGN"])
def test_lock_file_in_any_shape_gets_a_clear_answer_and_can_be_broken(workspace, cli, content):
    lock = workspace.state_dir / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    if content == "DIR":
        lock.mkdir()
    elif content == "FOREIGN":
        lock.write_text(json.dumps({"host": "elsewhere.example", "pid": 1, "create_time": 0,
                                    "command": "evotrainer reconcile"}))
    else:
        lock.write_text(content)
    root = str(workspace.root)
    result = cli("-C", root, "reconcile")
    assert result.code == 1 and "lock" in result.err and "Traceback" not in result.output
    assert "unlock --force" in result.err
    if content == "FOREIGN":
        refused = cli("-C", root, "unlock", "--force")
        assert refused.code == 1 and "another host" in refused.err and lock.exists()
        assert cli("-C", root, "unlock", "--force", "--other-host").code == 0
    else:
        assert cli("-C", root, "unlock", "--force").code == 0
    assert not lock.exists()
    assert cli("-C", root, "reconcile").code == 0


def test_crash_between_spawn_and_job_record_adopts_the_job(tmp_path):
    """The job runs but job.json was never written (the reconcile died in between)."""
    artifact_dir = tmp_path / "art"
    artifact_dir.mkdir()
    job = JobSpec("evo-v1-a1-deadbeef00", "v1", {"threads": 1}, tmp_path, artifact_dir)
    spawn_detached([sys.executable, "-c", "import time; time.sleep(60)"], job, dict(os.environ),
                   artifact_dir / "process.log")
    backend = StandinBackend()
    try:
        # Found by its job id (once the child has exec'd: before, its environment is still
        # the parent's, which names no job — a later pass finds it then).
        wait_for(lambda: backend.status(job).state is JobState.RUNNING, timeout=20)
        adopted = json.loads((artifact_dir / JOB_FILE).read_text())
        assert adopted["adopted"] and psutil.pid_exists(adopted["pid"])
        launched = []
        backend_spawn = "evotrainer.backends.local.spawn_detached"
        mp = pytest.MonkeyPatch()
        mp.setattr(backend_spawn, lambda *a, **k: launched.append(a))
        try:
            backend.submit(job)
        finally:
            mp.undo()
        assert launched == []  # never launched twice
    finally:
        backend.cancel(job)
    # A job that finished before any pass saw it: its result is adopted, not relaunched.
    done_dir = tmp_path / "done"
    done_dir.mkdir()
    (done_dir / "result.json").write_text(json.dumps({"status": "ok"}))
    done = JobSpec("evo-v1-a1-cafe000000", "v1", {}, tmp_path, done_dir)
    assert backend.status(done).state is JobState.SUCCEEDED


def test_infrastructure_failure_burns_no_attempt_and_retry_recovers(workspace, tmp_path, cli):
    full = tmp_path / "disk-full"
    full.write_text("")
    propose(workspace, "v1", standin_skill=0.6, standin_disk_full=str(full))
    plans = plans_of(workspace)
    run = record(workspace, "v1", "run")
    assert run["state"] == "Failed" and run["attempt"] == 1  # no automatic second attempt
    assert "infrastructure failure" in plans["v1"].note and "retry v1" in plans["v1"].note
    full.unlink()  # space freed
    root = str(workspace.root)
    assert cli("-C", root, "retry", "v1").code == 0
    head = git.Repo(workspace.root).commit("evo/v1").message
    assert "Evotrainer-Action: retry" in head
    converge(workspace)
    run = record(workspace, "v1", "run")
    assert run["state"] == "Succeeded" and run["attempt"] == 2
    assert "No space left" in run["attempts"][0]["detail"]
    assert cli("-C", root, "retry", "v1").code == 1  # nothing failed to retry


def test_absolute_artifact_root(workspace, tmp_path):
    project = workspace.root / "spec" / "project.yaml"
    outside = tmp_path / "shared-disk"
    lines = [line for line in project.read_text().splitlines()
             if not line.startswith("artifact_root:")]
    project.write_text("\n".join(lines + [f"artifact_root: {outside}"]) + "\n")
    repo = git.Repo(workspace.root)
    repo.git.commit("-am", "artifacts on a shared disk", env=IDENTITY)
    ws = Workspace(workspace.root)
    from evotrainer.control.versions import approve

    approve(ws, "v0", by="tester")  # the project changed: re-approve what it inherits
    plans = plans_of(ws)
    assert plans["v0"].error is None
    run = record(ws, "v0", "run")
    assert run["state"] == "Succeeded" and run["artifact_dir"].startswith(str(outside))
    assert record(ws, "v0", "decision")["verdict"] == "baseline"


def test_swapped_artifact_is_refused_before_diagnosis(workspace):
    propose(workspace, "v1", standin_skill=0.5)
    converge(workspace)
    run = record(workspace, "v1", "run")
    val = workspace.root / run["artifacts"]["val_rollouts"]["path"]
    train = workspace.root / run["artifacts"]["train_rollouts"]["path"]
    shutil.copy(train, val)  # valid Parquet, wrong data
    with pytest.raises(EvoError, match="changed since it was recorded") as caught:
        diagnose_version(workspace, "v1")
    assert "val.parquet" in str(caught.value)


def test_corrupt_parquet_is_an_error_of_its_version(workspace, cli):
    propose(workspace, "v1", standin_skill=0.5, standin_corrupt=True)
    propose(workspace, "v2", standin_skill=0.5)
    plans = plans_of(workspace)
    assert "cannot be read" in plans["v1"].error
    assert record(workspace, "v2", "decision") is not None
    result = cli("-C", str(workspace.root), "reconcile")
    assert result.code == 1 and "Traceback" not in result.output


def test_foreign_commit_during_reconcile_is_an_error_not_a_traceback(workspace, monkeypatch):
    propose(workspace, "v1", standin_skill=0.5)
    original = GitStore._check_checkout_follows
    landed = []

    def foreign_commit_first(self, branch, old, new):
        if branch == "evo/v1" and old and not landed:  # someone pushes to evo/v1 right now
            landed.append(branch)
            sha = self.repo.git.commit_tree(f"{old}^{{tree}}", "-p", old, "-m", "foreign",
                                            env=IDENTITY)
            self.repo.git.update_ref(f"refs/heads/{branch}", sha)
        return original(self, branch, old, new)

    monkeypatch.setattr(GitStore, "_check_checkout_follows", foreign_commit_first)
    reconciler = standin.reconciler(workspace)
    plans = {p.version: p for p in reconciler.run(wait=True, poll_s=0.05)}
    assert landed and "moved while" in reconciler.errors["v1"]
    assert "foreign" in git.Repo(workspace.root).git.log("--format=%s", "evo/v1")  # kept
    assert plans["v1"].error is None and record(workspace, "v1", "decision") is not None
