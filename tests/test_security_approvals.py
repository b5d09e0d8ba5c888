"""Approvals, the record key, unverifiable records and rewound branches, attacked as a
branch author would (someone who can push `evo/*` branches and open pull requests, but is
no maintainer). Each test performs the attack for real on a real git workspace and checks
the promise of docs/security.md: nothing unreviewed merged, nothing read or acted on, one
clear line naming the version and the way out, no traceback."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from standin import converge, propose, record, standin_settings
from test_pull_requests import github  # noqa: F401 (the fake GitHub fixture)

from evotrainer.backends.base import JobSpec
from evotrainer.control.reconcile import load_context, plan
from evotrainer.control.versions import new_version
from evotrainer.errors import EvoError
from evotrainer.store import seal
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import PROJECT_FILE, Workspace, run_path

pytestmark = pytest.mark.usefixtures("standin")
EVIL = ".github/workflows/evil.yml"


def plans_by_version(ws: Workspace) -> dict:
    return {p.version: p for p in plan(load_context(ws))}


def author_commit(ws: Workspace, name: str, files: dict[str, bytes | None], message: str) -> str:
    """What a branch author can do: commit anything onto the version's branch."""
    return ws.git.commit_files(branch_name(name), files, message)


# ---- unreviewed files through a parent -----------------------------------------------------


def test_files_pushed_onto_a_parent_after_it_ran_are_shown_to_the_reviewer(workspace, cli):
    """After v0 ran and main took it, its author pushes a workflow and a file onto evo/v0;
    v1 is forked from that tip. The review the tool asks for shows both files (the PR body,
    `approve`'s own output), v0 says it changed after its records, and the approval binds
    them: a later edit of the smuggled file makes it stale and nothing reaches main."""
    ws = workspace
    converge(ws)
    assert "v0" in ws.git.merged_versions("refs/heads/main")
    author_commit(ws, "v0", {EVIL: b"on: push\njobs: {x: {runs-on: self-hosted}}\n",
                             "SMUGGLED.txt": b"unreviewed\n"}, "tidy up")
    new_version(ws, "v1", "v0", rationale="harmless-looking",
                settings=standin_settings(standin_skill=0.6))

    v0 = plans_by_version(ws)["v0"]
    assert v0.error is not None and "done" not in v0.note
    assert EVIL in v0.error and "SMUGGLED.txt" in v0.error

    body = cli("-C", str(ws.root), "pr", "body", "v1")
    assert body.code == 0, body.output
    assert "git diff main...evo/v1" in body.out
    listed = body.out.split("```")[0]  # the files list, before the diff's fence
    assert "evil.yml" in listed and "SMUGGLED.txt" in listed and "besides its spec" in listed

    approved = cli("-C", str(ws.root), "approve", "v1")
    assert approved.code == 0, approved.output
    assert EVIL in approved.out and "SMUGGLED.txt" in approved.out
    assert "brings into main" in approved.out and "Traceback" not in approved.output

    # The approval binds what it listed: a change to a smuggled file after it is unapproved.
    before_main = ws.git.rev("main")
    author_commit(ws, "v1", {"SMUGGLED.txt": b"changed after the review\n"}, "one more")
    fresh = Workspace(ws.root)
    assert fresh.approval_status(fresh.version("v1")) == "stale"
    converge(fresh)
    assert record(fresh, "v1", "run") is None
    assert fresh.git.rev("main") == before_main
    assert fresh.git.read("main", "SMUGGLED.txt") is None
    assert fresh.git.read("main", EVIL) is None


def test_the_merge_list_leaves_out_only_records_sealed_on_their_own_branch(workspace):
    """A child's tree that carries a hand-edited copy of its parent's records lists it:
    only records standing exactly as the controller sealed them are left out."""
    ws = workspace
    converge(ws)
    new_version(ws, "v1", "v0", rationale="child", settings=standin_settings(standin_skill=0.6))
    states = ws.versions()
    assert [p for _, p in ws.merge_changes(states["v1"], states)] == ["spec/versions/v1.yaml"]
    author_commit(ws, "v1", {run_path("v0", "scores.csv"): b"task,score\nt,1.0\n"}, "better")
    states = ws.versions()
    assert run_path("v0", "scores.csv") in [p for _, p in ws.merge_changes(states["v1"], states)]


# ---- approvals from reviewers main lists ---------------------------------------------------


def test_only_reviewers_main_lists_approve_and_never_the_author(workspace, github, cli):  # noqa: F811
    """Pushing an evo/* branch makes a person a COLLABORATOR, and MEMBER is anyone in the
    organisation: neither is an approval. Nor is a reviewer list the branch writes into its
    own project file, nor the PR author's review. Only a login main lists approves."""
    ws = workspace
    new_version(ws, "v1", "v0", rationale="mine", settings=standin_settings(standin_skill=0.6))
    # The branch lists its own author as a reviewer: read from main only, so no effect.
    project = yaml.safe_load(ws.git.read("evo/v1", PROJECT_FILE))
    project["reviewers"] = ["mallory"]
    author_commit(ws, "v1", {PROJECT_FILE: yaml.safe_dump(project).encode()}, "reviewers")
    assert cli("pr", "open", "v1", cwd=ws.root).code == 0
    head = github.pull(1)["head"]["sha"]
    github.review(1, "mallory", "APPROVED", head, "COLLABORATOR")
    github.review(1, "mallet", "APPROVED", head, "MEMBER")
    github.review(1, github.bot_login, "APPROVED", head, "OWNER")  # the PR's author
    synced = cli("pr", "sync", cwd=ws.root)
    assert synced.code == 0, synced.output
    assert "approved 0" in synced.out and "not listed under `reviewers:`" in synced.out
    fresh = Workspace(ws.root)
    assert fresh.approval_status(fresh.version("v1")) == "unapproved"
    converge(fresh)
    assert record(fresh, "v1", "run") is None  # nothing launched

    # Main listing the PR's author does not make its own review count either.
    text = (ws.root / PROJECT_FILE).read_text().replace(
        "reviewers: [alice, bob, carol]", f"reviewers: [alice, {github.bot_login}]")
    ws.git.commit_files("main", {PROJECT_FILE: text.encode()}, "reviewers")
    assert "approved 0" in cli("pr", "sync", cwd=ws.root).out

    github.review(1, "Alice", "APPROVED", head, "NONE")  # listed (logins ignore case)
    synced = cli("pr", "sync", cwd=ws.root)
    assert "approved 1" in synced.out, synced.output
    fresh = Workspace(ws.root)
    assert fresh.approval_status(fresh.version("v1")) == "approved"
    assert fresh.version("v1").approval["by"].startswith("Alice (GitHub review of ")


def test_without_a_reviewer_list_on_main_no_review_approves(workspace, github, cli):  # noqa: F811
    ws = workspace
    text = (ws.root / PROJECT_FILE).read_text().replace("reviewers: [alice, bob, carol]\n", "")
    ws.git.commit_files("main", {PROJECT_FILE: text.encode()}, "no reviewers")
    new_version(ws, "v1", "v0", rationale="x", settings=standin_settings(standin_skill=0.6))
    assert cli("pr", "open", "v1", cwd=ws.root).code == 0
    github.review(1, "alice", "APPROVED", github.pull(1)["head"]["sha"], "OWNER")
    synced = cli("pr", "sync", cwd=ws.root)
    assert synced.code == 0 and "approved 0" in synced.out
    assert "no reviewers" in synced.out and "reviewers:" in synced.out


# ---- a reader without the key ------------------------------------------------------------


def test_a_reader_without_the_key_regates_nothing_and_plans_from_nothing(workspace, cli):
    """The scaffolded harness-backtest job holds no key. v1's author rewrites its recorded
    scores so a re-gate flips it; without the key, `harness backtest`, `harness diff` and
    `propose` act on none of it and say that nothing could be verified."""
    ws = workspace
    propose(ws, "v1", standin_skill=0.6)
    converge(ws)
    assert record(ws, "v1", "decision")["verdict"] == "promote"
    seal.key_file(ws.state_dir).rename(ws.root.parent / "kept.key")
    scores = ws.git.read("evo/v1", run_path("v1", "scores.csv")).decode().splitlines()
    worse = [scores[0]] + [",".join([*line.split(",")[:-1], "0.0"]) for line in scores[1:]]
    author_commit(ws, "v1", {run_path("v1", "scores.csv"): "\n".join(worse).encode()},
                  "rescore")
    for args in (["harness", "backtest", "h0"], ["harness", "diff", "h0", "h0"],
                 ["propose"]):
        out = cli("-C", str(ws.root), *args)
        assert out.code == 1, (args, out.output)
        assert "nothing could be verified" in out.output and "v1" in out.output
        assert "Traceback" not in out.output
    assert not seal.key_file(ws.state_dir).exists()  # no reader made a key
    assert set(ws.git.version_branches()) == {"v0", "v1"}  # nothing proposed
    fresh = Workspace(ws.root)
    assert fresh.version("v1").records["decision"] is None  # no reader sees it as evidence
    shown = cli("-C", str(ws.root), "lineage")
    assert "unverified" in shown.output and "Traceback" not in shown.output


# ---- rewound branches ----------------------------------------------------------------------


def test_a_branch_rewound_to_its_approval_after_promotion_is_named_rewound(workspace, cli):
    """After v1 was promoted, its author moves evo/v1 back to the approval commit (whose seal
    verifies: content, not sequence). Nothing is launched, gated or merged again; v1 is
    named rewound with the commit to restore."""
    ws = workspace
    propose(ws, "v1", standin_skill=0.6)
    converge(ws)
    assert record(ws, "v1", "decision")["verdict"] == "promote"
    promoted, before_main = ws.git.rev("evo/v1"), ws.git.rev("main")
    approval = ws.spec_commit(ws.version("v1"))
    ws.git.repo.git.update_ref("refs/heads/evo/v1", approval)

    v1 = plans_by_version(Workspace(ws.root))["v1"]
    assert v1.action is None and "rewound: evo/v1 was moved back" in v1.error
    assert "git branch -f evo/v1" in v1.error
    converge(Workspace(ws.root))
    assert ws.git.rev("evo/v1") == approval and ws.git.rev("main") == before_main
    out = cli("-C", str(ws.root), "plan")
    assert "rewound" in out.output and "Traceback" not in out.output
    ws.git.repo.git.update_ref("refs/heads/evo/v1", promoted)  # the way out it names
    assert plans_by_version(Workspace(ws.root))["v1"].error is None


def test_records_restored_by_a_new_commit_are_out_of_place(workspace):
    """Without moving the ref back: a new commit restores the approval-era runs/v1/ (its
    genuine seal, the records deleted). The seal names the commit it was written onto, so
    it does not stand anywhere else."""
    ws = workspace
    propose(ws, "v1", standin_skill=0.6)
    converge(ws)
    approval = ws.spec_commit(ws.version("v1"))
    old_seal = ws.git.read(approval, run_path("v1", seal.SEAL_FILE))
    author_commit(ws, "v1", {run_path("v1", f): None for f in seal.SEALED_FILES}
                  | {run_path("v1", seal.SEAL_FILE): old_seal}, "start over")
    fresh = Workspace(ws.root)
    assert "records out of place" in str(fresh.version("v1").record_errors["seal"])
    v1 = plans_by_version(fresh)["v1"]
    assert v1.action is None and "records out of place" in v1.error
    tip = fresh.git.rev("evo/v1")
    converge(fresh)
    assert fresh.git.rev("evo/v1") == tip  # nothing relaunched over it


# ---- the record key and jobs ---------------------------------------------------------------


def test_the_record_key_lives_outside_the_workspace_and_an_old_one_moves_out(workspace, cli):
    """A key at the old place inside the workspace (`.evotrainer/record.key`, in a job's
    reach as `../../record.key`) is moved out on first use, saying so; records still
    verify with it."""
    ws = workspace
    propose(ws, "v1", standin_skill=0.6)
    key_file = seal.key_file(ws.state_dir)
    assert key_file.is_file() and not key_file.is_relative_to(ws.root)
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.parent.stat().st_mode & 0o777 == 0o700
    legacy = ws.state_dir / seal.KEY_FILE
    ws.state_dir.mkdir(exist_ok=True)
    key_file.rename(legacy)
    out = cli("-C", str(ws.root), "plan")
    assert "moved the record key out of the workspace" in out.err and str(key_file) in out.err
    assert not legacy.exists() and key_file.is_file()
    fresh = Workspace(ws.root)
    assert fresh.approval_status(fresh.version("v1")) == "approved"
    # Two different keys: one clear line, nothing overwritten.
    legacy.write_text("k" * 64 + "\n")
    with pytest.raises(EvoError, match="two record keys"):
        seal.record_key(ws.state_dir)
    assert legacy.exists()


READ_KEYS = ("cat ../../record.key {key}; ls {folder}; "
             "cat /proc/{controller}/environ | tr '\\0' '\\n' | grep RECORD; "
             "umount {folder}; cat {key}; echo job-ran")


def _job_output(ws: Workspace, key: Path, tmp: Path) -> str:
    """Run a job the way the local backend does (its worktree as working directory) whose
    command tries every way to the key, and return what it printed."""
    from evotrainer.backends.local import spawn_detached

    workdir = ws.worktree_path("v1")
    workdir.mkdir(parents=True, exist_ok=True)  # .evotrainer/worktrees/v1
    artifacts = tmp / "job"
    artifacts.mkdir(exist_ok=True)
    job = JobSpec("evo-v1-a1-0123456789", "v1", {}, workdir, artifacts)
    script = READ_KEYS.format(key=key, folder=key.parent, controller=os.getpid())
    record_ = spawn_detached(["/bin/sh", "-c", script], job, {"PATH": "/usr/bin:/bin"},
                             artifacts / "process.log")
    os.waitpid(record_["pid"], 0)
    return (artifacts / "process.log").read_text()


def test_a_job_cannot_read_the_record_key(workspace, tmp_path, monkeypatch):
    """A job's working directory is its worktree: `../../record.key`, the key file outside
    the workspace, the controller's environment and unmounting the folder that hides it all
    come up empty. (As root the job is root, yet holds no capability outside its own user
    namespace.)"""
    ws = workspace
    key = seal.key_file(ws.state_dir)
    secret = seal.record_key(ws.state_dir)
    monkeypatch.setenv(seal.KEY_ENV + "_PROBE", "RECORD-in-the-controller-environment")
    out = _job_output(ws, key, tmp_path)
    assert "job-ran" in out, out
    assert secret.decode() not in out and "RECORD-in-the-controller" not in out
    assert key.read_bytes().strip() == secret  # still there for the controller


@pytest.mark.skipif(os.geteuid() != 0, reason="the test above runs as this user already")
def test_a_job_of_an_unprivileged_controller_cannot_read_the_record_key():
    """The same as a user who is not root (a self-hosted runner, a laptop): the test drops
    to an unprivileged uid and runs the job there."""
    from evotrainer.backends.local import KeyHider

    home = Path(tempfile.mkdtemp(prefix="evotrainer-nobody-"))  # pytest's folder is root's
    os.chown(home, 65534, 65534)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (reported through the pipe)
        try:
            os.setgid(65534)
            os.setuid(65534)
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable, as any user's process is
            os.environ["XDG_CONFIG_HOME"] = str(home)
            state = home / "ws" / ".evotrainer"
            state.mkdir(parents=True)
            secret = seal.record_key(state).decode()
            key = seal.key_file(state)
            hider = KeyHider.for_jobs()
            job = subprocess.run(["/bin/sh", "-c", f"cat {key}; umount {key.parent}; "
                                  f"cat {key}; echo job-ran"], preexec_fn=hider,
                                 capture_output=True, text=True, cwd=str(state))
            plain = subprocess.run(["cat", str(key)], capture_output=True, text=True)
            report = {"out": job.stdout + job.stderr, "secret": secret,
                      "plain": plain.stdout.strip()}
        except Exception as exc:  # noqa: BLE001
            report = {"error": repr(exc)}
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    report = json.loads(os.read(read, 65536))
    shutil.rmtree(home)
    assert "error" not in report, report
    assert report["plain"] == report["secret"]  # the file is there, readable to its owner
    assert "job-ran" in report["out"] and report["secret"] not in report["out"]
