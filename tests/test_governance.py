"""The human gate: an approval is bound to what it approved; plan and reconcile
run validate's checks on every version and refuse the invalid ones; validate sees the
working tree and a pull request's head."""

from __future__ import annotations

import json

import git
import pytest
from sealing import seal_approval
from standin import converge, propose, record

from evotrainer.control.reconcile import load_context, plan
from evotrainer.control.versions import approve, new_version, spec_text
from evotrainer.store.workspace import version_spec_path

pytestmark = pytest.mark.usefixtures("standin")


def commit_spec(ws, name: str, text: str, branch: str | None = None) -> None:
    ws.git.commit_files(branch or f"evo/{name}", {version_spec_path(name): text.encode()},
                        "hand edit", start=f"evo/{name}")


def plans_by_version(ws) -> dict:
    return {p.version: p for p in plan(load_context(ws))}


def test_change_after_approval_makes_it_stale_and_nothing_launches(workspace, cli):
    propose(workspace, "v1", standin_skill=0.5)
    spec = dict(workspace.version("v1").spec)
    assert spec["approval"]["digest"].startswith("sha256:")
    spec["recipe"] = {**spec["recipe"], "grpo": {"steps": 1900}}
    commit_spec(workspace, "v1", spec_text(spec))  # the approval block is kept as it was
    v1 = plans_by_version(workspace)["v1"]
    assert v1.action is None and "awaiting re-approval" in v1.note
    converge(workspace)
    assert record(workspace, "v1", "run") is None  # never trained
    # An inherited change (the project's recipe) makes it stale too.
    approve(workspace, "v1", by="tester")
    assert plans_by_version(workspace)["v1"].action.kind == "launch"
    project = workspace.root / "spec" / "project.yaml"
    text = project.read_text().replace("recipe:\n", "recipe:\n  seeds: [3]\n", 1)
    assert text != project.read_text()
    project.write_text(text)
    from evotrainer.store.workspace import Workspace

    fresh = Workspace(workspace.root)
    assert "awaiting re-approval" in plans_by_version(fresh)["v1"].note
    out = cli("-C", str(workspace.root), "approve", "v1")
    assert out.code == 0 and out.out.startswith("Approved v1")
    again = cli("-C", str(workspace.root), "approve", "v1")
    assert again.code == 0 and "Already approved" in again.out


def test_hand_written_approval_is_not_an_approval(workspace, cli):
    new_version(workspace, "v1", "v0", rationale="forged")
    spec = dict(workspace.version("v1").spec, approval={"approved": True, "by": "me"})
    commit_spec(workspace, "v1", spec_text(spec))
    out = cli("-C", str(workspace.root), "validate")
    assert out.code == 1 and "not an approval" in out.err and "evotrainer approve v1" in out.err
    assert cli("-C", str(workspace.root), "plan").code == 1
    converge(workspace)
    assert record(workspace, "v1", "run") is None
    # A block with a digest, written by hand, is not the controller's: not an approval either.
    spec["approval"]["digest"] = "sha256:" + "0" * 64
    commit_spec(workspace, "v1", spec_text(spec))
    assert "not written by this controller" in plans_by_version(workspace)["v1"].note


def test_approve_refuses_what_plan_would_refuse_but_replaces_a_forged_block(workspace, cli):
    new_version(workspace, "v1", "v0", rationale="reads a file outside the workspace")
    spec = dict(workspace.version("v1").spec)
    spec["recipe"] = {"domain": {"data": {"train": "/outside/secret.jsonl"}}}
    commit_spec(workspace, "v1", spec_text(spec))
    tip = workspace.git.rev("evo/v1")
    out = cli("-C", str(workspace.root), "approve", "v1")
    assert out.code == 1 and "Traceback" not in out.err
    assert "v1 cannot be approved" in out.err and "domain.data.train" in out.err
    assert workspace.git.rev("evo/v1") == tip  # nothing committed
    # A forged, digest-less approval block is what approving replaces: not a refusal.
    spec["recipe"] = {}
    commit_spec(workspace, "v1", spec_text(dict(spec, approval={"approved": True, "by": "me"})))
    assert cli("-C", str(workspace.root), "approve", "v1").code == 0
    assert workspace.approval_status(workspace.versions()["v1"]) == "approved"


DUPLICATE_APPROVAL = """apiVersion: evotrainer/v1
kind: PolicyVersion
name: {name}
parent: v0
intervention: {{skills: [], factors: 0, rationale: dup}}
recipe: {recipe}
approval: {{approved: false}}
approval: {{approved: true, by: x, digest: "{digest}"}}
"""


@pytest.mark.parametrize("case", ["duplicate_key", "name_mismatch", "outside_path", "bad_name"])
def test_plan_and_reconcile_refuse_what_validate_rejects(workspace, cli, case):
    new_version(workspace, "v1", "v0", rationale="ok")
    approve(workspace, "v1", by="tester")
    spec = dict(workspace.version("v1").spec)
    name = "v1"
    if case == "duplicate_key":
        text = DUPLICATE_APPROVAL.format(name="v1", recipe="{}",
                                         digest=spec["approval"]["digest"])
    elif case == "name_mismatch":
        text = spec_text(dict(spec, name="v9"))
    elif case == "outside_path":
        spec["recipe"] = {"domain": {"data": {"train": "/outside/secret.jsonl"}}}
        text = spec_text(spec)
    else:
        name = "-rf"
        workspace.git.commit_files("evo/-rf", {version_spec_path("-rf"): spec_text(
            dict(spec, name="-rf")).encode()}, "bad name", start="evo/v0")
        text = None
    if text is not None:
        commit_spec(workspace, "v1", text)
    # Bind the approval to the edited content: only validation may stop it now.
    digest = workspace.approval_digest(name)
    raw = workspace.git.read(f"evo/{name}", version_spec_path(name)).decode()
    bound = raw.replace(spec["approval"]["digest"], digest)
    workspace.git.commit_files(f"evo/{name}", {version_spec_path(name): bound.encode()}, "bind")
    seal_approval(workspace, name)
    assert workspace.approval_status(workspace.versions()[name]) == "approved"
    validated = cli("-C", str(workspace.root), "validate", "--json")
    assert validated.code == 1 and not json.loads(validated.out)["valid"]
    planned = cli("-C", str(workspace.root), "plan", "--json")
    assert planned.code == 1
    rows = {r["version"]: r for r in json.loads(planned.out)["versions"]}
    assert rows[name]["error"] and rows[name]["action"] is None
    assert rows["v0"]["action"] == "launch"  # the others go ahead
    reconciled = cli("-C", str(workspace.root), "reconcile")
    assert reconciled.code == 1
    assert record(workspace, "v0", "run") is not None
    assert workspace.git.read(f"evo/{name}", f"runs/{name}/run.yaml") is None  # never launched


def test_validate_checks_working_tree_and_a_pull_request_ref(workspace, cli):
    new_version(workspace, "v2", "v0", rationale="base")
    root = str(workspace.root)
    assert cli("-C", root, "validate").code == 0
    spec = dict(workspace.version("v2").spec, recipe={"grpo": {"group_size": "many"}})
    repo = git.Repo(workspace.root)
    repo.git.branch("tweak-v2", "evo/v2")
    commit_spec(workspace, "v2", spec_text(spec), branch="tweak-v2")
    assert cli("-C", root, "validate").code == 0  # not on an evo/* tip ...
    out = cli("-C", root, "validate", "--ref", "tweak-v2")
    assert out.code == 1 and "tweak-v2:spec/versions/v2.yaml" in out.err  # ... but on the PR
    assert cli("-C", root, "validate", "--ref", "no-such-ref").code == 1
    # A bad edit left in the working tree.
    (workspace.root / "spec" / "versions").mkdir(parents=True, exist_ok=True)
    (workspace.root / "spec" / "versions" / "v2.yaml").write_text(spec_text(spec))
    out = cli("-C", root, "validate", "--format", "json")
    problems = json.loads(out.out)["problems"]
    assert out.code == 1 and any(p["where"].startswith("spec/versions/v2.yaml") for p in problems)
