"""Isolation of untrusted input, performed for real: a program fills /dev/shm,
reads /etc/shadow, writes to /etc, kills its parent and leaves setsid children, in the
sandbox's root mode and in its unprivileged mode while running as root; a link committed
on a version branch points the job's dataset outside the workspace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from test_sandbox import SHARED_PYTHON

from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import new_version
from evotrainer.domains import make_domain
from evotrainer.domains.data import DATA_ROOTS_ENV
from evotrainer.errors import EvoError
from evotrainer.sandbox.process import LocalSandbox
from evotrainer.store.workspace import Workspace

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the root modes need root")

PWNED = "/etc/evotrainer-isolation-pwned"
# Every attack in one program; it reports what each attempt did as one JSON line.
ATTACK = f"""
import json, os, signal, time
out = {{}}
def attempt(name, action):
    try:
        action()
        out[name] = "done"
    except OSError as err:
        out[name] = type(err).__name__
attempt("read_shadow", lambda: open("/etc/shadow").read())
attempt("write_etc", lambda: open({PWNED!r}, "w").write("x"))
parent = os.getppid()
out["parent_visible"] = parent != 0
if parent:
    attempt("kill_parent", lambda: os.kill(parent, signal.SIGKILL))
filled = 0
try:
    while filled < 40:  # 16 MiB a file in the report; 256 KiB here keeps the test light
        with open(f"/dev/shm/fill-{{filled}}", "wb") as f:
            f.write(b"x" * 2**18)
        filled += 1
except OSError:
    pass
out["shm_files"] = filled
out["dev"] = sorted(os.listdir("/dev"))
child = os.fork()
if child == 0:
    os.setsid()
    time.sleep(60)  # keeps stdout open, too
    os._exit(0)
out["escapee"] = child
print(json.dumps(out), flush=True)
"""

# The sandbox's caller in its own process: if the program killed its parent, this dies.
RUNNER = """
import json, sys
from evotrainer.sandbox.process import Limits, LocalSandbox
python, privileged = sys.argv[1], sys.argv[2] == "1"
box = LocalSandbox(python, privileged=privileged)
result = box.run(sys.stdin.read(), limits=Limits(file_bytes=2**20, wall_seconds=30))
print(json.dumps({"privileged": box.privileged, "status": result.status,
                  "detail": result.detail, "stdout": result.stdout,
                  "isolation": list(result.isolation), "wall": result.wall_seconds}))
"""


def run_attack(python: str, privileged: bool) -> tuple[dict, dict]:
    before = set(os.listdir("/dev/shm"))
    done = subprocess.run([sys.executable, "-c", RUNNER, python, "1" if privileged else "0"],
                          input=ATTACK, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the sandbox's caller died: {done.returncode} {done.stderr}"
    result = json.loads(done.stdout)
    assert result["status"] == "ok", result
    # The setsid child holds stdout open: the run must end when the program does.
    assert result["wall"] < 20
    assert set(os.listdir("/dev/shm")) == before  # the host's /dev/shm kept nothing
    assert not os.path.exists(PWNED)
    return result, json.loads(result["stdout"])


@needs_root
def test_root_mode_gives_a_private_small_dev_shm_and_a_minimal_dev() -> None:
    result, attack = run_attack(sys.executable, privileged=True)
    if not result["privileged"]:
        pytest.skip("this machine refuses the namespaces (no CAP_SYS_ADMIN)")
    assert {"uid", "mountns"} <= set(result["isolation"])
    assert attack["read_shadow"] in ("PermissionError", "FileNotFoundError")
    assert attack["write_etc"] in ("PermissionError", "OSError")
    assert not attack["parent_visible"]  # pid 1 of its own namespace
    # 1 MiB of /dev/shm: four 256 KiB files at most, then ENOSPC.
    assert attack["shm_files"] <= 4
    assert attack["dev"] == ["fd", "full", "null", "random", "shm", "stderr", "stdin",
                             "stdout", "urandom", "zero"]


@needs_root
@pytest.mark.skipif(SHARED_PYTHON is None, reason="no interpreter other uids may run")
def test_unprivileged_mode_as_root_drops_to_a_fresh_uid_and_cleans_up() -> None:
    result, attack = run_attack(SHARED_PYTHON, privileged=False)
    assert "uid" in result["isolation"] and "mountns" not in result["isolation"]
    assert attack["read_shadow"] == "PermissionError"
    assert attack["write_etc"] == "PermissionError"
    assert attack["kill_parent"] == "PermissionError"
    assert attack["shm_files"] > 4  # the host's /dev/shm took them during the run...
    # ...and the escapee (a host pid here) is gone with the run.
    escapee = attack["escapee"]
    deadline = time.monotonic() + 5
    while psutil.pid_exists(escapee) and time.monotonic() < deadline:
        if psutil.Process(escapee).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    assert not psutil.pid_exists(escapee) or \
        psutil.Process(escapee).status() == psutil.STATUS_ZOMBIE


@needs_root
def test_root_never_runs_a_program_as_root(tmp_path) -> None:
    """An interpreter the fresh uid cannot run means no run at all, never a run as root."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    interpreter = private / "python"  # runs anything, and says as whom
    interpreter.write_text("#!/bin/sh\nid -u\n")
    interpreter.chmod(0o755)
    result = LocalSandbox(str(interpreter), privileged=False).run("print(1)")
    assert result.status == "sandbox_error", result
    assert "must be able to run the interpreter" in result.detail
    assert result.stdout == ""


def test_a_link_committed_on_a_version_branch_cannot_feed_the_job(tmp_path, monkeypatch):
    """`evo/v1` commits data/train.jsonl as a link to a file outside the
    workspace; the job (in v1's worktree, as reconcile creates it) must refuse to read it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.jsonl"
    secret.write_text(json.dumps({"problem": "TOP-SECRET 1+1?", "answer": "2"}) + "\n")
    ws = Workspace(init_workspace(tmp_path / "ws", "arith"))
    new_version(ws, "v1", "v0", rationale="user data")
    branch = tmp_path / "branch"
    git = ["git", "-C", str(ws.root)]
    subprocess.run([*git, "worktree", "add", "-q", str(branch), "evo/v1"], check=True)
    (branch / "data").mkdir()
    (branch / "data" / "train.jsonl").symlink_to(secret)
    (branch / "data" / "own.jsonl").write_text(
        json.dumps({"problem": "1+2?", "answer": "3"}) + "\n")
    (branch / "data" / "alias.jsonl").symlink_to("own.jsonl")  # a link that stays inside
    subprocess.run(["git", "-C", str(branch), "add", "data"], check=True)
    subprocess.run(["git", "-C", str(branch), "-c", "user.name=a", "-c", "user.email=a@b",
                    "commit", "-q", "-m", "data"], check=True)
    subprocess.run([*git, "worktree", "remove", str(branch)], check=True)

    state = ws.version("v1")
    worktree = ws.git.worktree_add(ws.worktree_path("v1"), state.sha)
    assert (worktree / "data" / "train.jsonl").is_symlink()
    monkeypatch.chdir(worktree)  # where the local backend starts the job
    monkeypatch.delenv(DATA_ROOTS_ENV, raising=False)
    # The recipe section a math project with user data gives the job.
    domain_cfg = {"name": "math", "params": {}, "data": {"train": "data/train.jsonl"}}
    with pytest.raises(EvoError) as err:
        make_domain(domain_cfg).num_tasks()
    assert "outside the job's workspace" in err.value.message
    assert err.value.field == "domain.data.train" and "TOP-SECRET" not in str(err.value)

    inside = make_domain({**domain_cfg, "data": {"train": "data/alias.jsonl"}})
    assert [t.prompt.count("1+2?") for t in inside.pool("train")] == [1]
    # A declared data root makes the same link legitimate.
    monkeypatch.setenv(DATA_ROOTS_ENV, str(outside))
    assert "TOP-SECRET" in make_domain(domain_cfg).pool("train")[0].prompt
