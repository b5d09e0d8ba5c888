"""init, validate, version new/show, lineage, and the git store underneath them."""

import json

import git
import yaml

from evotrainer.control.versions import approve, new_version
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import Workspace, version_spec_path


def test_init_makes_main_baseline_branch_and_library(workspace: Workspace):
    repo = git.Repo(workspace.root)
    assert repo.active_branch.name == "main"
    assert set(workspace.git.version_branches()) == {"v0"}
    assert (workspace.root / "harness_revisions" / "h0.yaml").is_file()
    assert (workspace.root / "spec" / "schemas" / "project.schema.json").is_file()
    assert ".evotrainer/" in (workspace.root / ".gitignore").read_text()
    workflow = yaml.safe_load((workspace.root / ".github/workflows/evotrainer.yml").read_text())
    assert set(workflow["jobs"]) == {
        "validate-and-plan", "harness-backtest", "approve", "reconcile"}
    steps = " ".join(s.get("run", "") for s in workflow["jobs"]["validate-and-plan"]["steps"])
    assert "evotrainer validate" in steps and "GITHUB_STEP_SUMMARY" in steps
    v0 = workspace.version("v0")
    assert v0.spec["train"] is False and v0.approved
    assert not repo.is_dirty(untracked_files=True)


def test_validate_clean_workspace(workspace, cli):
    result = cli("-C", str(workspace.root), "validate", "--format", "json")
    assert result.code == 0, result.out
    assert json.loads(result.out) == {"valid": True, "problems": []}


def test_version_new_forks_branch_with_overrides(workspace, cli):
    result = cli("-C", str(workspace.root), "version", "new", "v1", "--parent", "v0",
                 "--set", "grpo.lr=3e-4", "--set", "seeds=[1, 2]", "--rationale", "faster lr")
    assert result.code == 0, result.err
    states = workspace.versions()
    v1 = states["v1"]
    assert v1.spec["recipe"] == {"grpo": {"lr": 3e-4}, "seeds": [1, 2]}
    assert not v1.approved and v1.parent == "v0"
    assert workspace.git.is_ancestor(states["v0"].sha, v1.sha)  # lineage is git ancestry
    recipe = workspace.resolved_recipe("v1", states)
    assert recipe["grpo"]["lr"] == 3e-4 and recipe["grpo"]["group_size"] == 8
    diff = git.Repo(workspace.root).git.diff("evo/v0..evo/v1", "--name-only")
    assert diff.splitlines() == [version_spec_path("v1")]
    # The user's checkout is untouched by commits to version branches.
    assert not git.Repo(workspace.root).is_dirty(untracked_files=True)


def test_version_new_refuses_bad_input_and_writes_nothing(workspace, cli):
    before = workspace.git.version_branches()
    cases = [
        (["v1", "--parent", "nope"], "no version 'nope'"),
        (["v0", "--parent", "v0"], "already exists"),
        (["v1", "--parent", "v0", "--set", "grpo.group_size=1"], "grpo.group_size"),
        (["v1", "--parent", "v0", "--set", "grpo.lrr=1"], "did you mean 'lr'"),
        (["v1", "--parent", "v0", "--skill", "nope"], "unknown skill"),
        (["V 1", "--parent", "v0"], "name"),
    ]
    for args, expected in cases:
        result = cli("-C", str(workspace.root), "version", "new", *args, "--rationale", "x")
        assert result.code == 1, args
        assert expected in result.err, (args, result.err)
    assert workspace.git.version_branches() == before


def test_version_show_and_lineage(workspace, cli):
    new_version(workspace, "v1", "v0", rationale="default recipe")
    approve(workspace, "v1", by="alice")
    shown = cli("-C", str(workspace.root), "version", "show", "v1")
    assert shown.code == 0 and "approved" in shown.out and "sha256:" in shown.out
    rows = json.loads(cli("-C", str(workspace.root), "lineage", "--json").out)
    assert [(r["name"], r["parent"], r["status"]) for r in rows] == [
        ("v0", None, "approved"), ("v1", "v0", "approved")]
    assert workspace.version("v1").spec["approval"]["by"] == "alice"
    tree = cli("-C", str(workspace.root), "lineage").out
    assert tree.index("v0") < tree.index("v1")


def commit_spec(ws: Workspace, branch_version: str, text: str, start: str = "evo/v0") -> None:
    ws.git.commit_files(branch_name(branch_version), {version_spec_path(branch_version):
                        text.encode()}, "test", start=start)


SPEC = """apiVersion: evotrainer/v1
kind: PolicyVersion
name: {name}
parent: {parent}
"""


def validate_errors(ws, cli) -> list[dict]:
    result = cli("-C", str(ws.root), "validate", "--format", "json")
    payload = json.loads(result.out)
    assert result.code == (0 if payload["valid"] else 1)
    return payload["problems"]


def test_validate_reads_branch_tips_and_catches_cross_reference_errors(workspace, cli):
    commit_spec(workspace, "v1", SPEC.format(name="v1", parent="ghost"))
    commit_spec(workspace, "v2", SPEC.format(name="v9", parent="v0"))
    commit_spec(workspace, "a", SPEC.format(name="a", parent="b"))
    commit_spec(workspace, "b", SPEC.format(name="b", parent="a"))
    commit_spec(workspace, "v3", SPEC.format(name="v3", parent="v0")
                + "recipe:\n  model:\n    path: ../../etc\n")
    commit_spec(workspace, "v4", SPEC.format(name="v4", parent="v0")
                + "harness: h9\nintervention:\n  skills: [nope]\n")
    problems = validate_errors(workspace, cli)
    messages = [(p["where"], p["field"], p["message"]) for p in problems]
    text = json.dumps(messages)
    assert "parent 'ghost' does not exist" in text
    assert "name 'v9' does not match 'v2'" in text
    assert "parent cycle" in text
    assert "leaves the workspace" in text and "recipe.model.path" in text
    assert "unknown harness revision 'h9'" in text and "unknown skill 'nope'" in text
    ghost = next(p for p in problems if "ghost" in p["message"])
    assert ghost["where"] == "evo/v1:spec/versions/v1.yaml:4:9"


def test_validate_reports_bad_files_in_working_tree(workspace, cli):
    (workspace.root / "skills" / "broken.yaml").write_bytes(b"kind: Skill\nname: [x\n")
    (workspace.root / "harness_revisions" / "h1.yaml").write_bytes(b"\xff\xfe")
    problems = validate_errors(workspace, cli)
    wheres = [p["where"] for p in problems]
    assert any(w.startswith("skills/broken.yaml:") for w in wheres)
    assert "harness_revisions/h1.yaml" in wheres


def test_data_root_allows_outside_path(workspace, cli, tmp_path):
    project = workspace.root / "spec" / "project.yaml"
    project.write_text(project.read_text() + f"data_roots: [{tmp_path / 'data'}]\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.jsonl").write_text(json.dumps(
        {"id": "p1", "problem": "1+1?", "answer": "2", "data_source": "mine"}) + "\n")
    commit_spec(workspace, "v1", SPEC.format(name="v1", parent="v0")
                + "recipe:\n  domain:\n    name: math\n    params: null\n    train_size: 1\n"
                "    val_size: 1\n"
                f"    data:\n      train: {tmp_path / 'data' / 't.jsonl'}\n"
                f"      val: {tmp_path / 'data' / 't.jsonl'}\n  grpo:\n    prompts_per_step: 1\n")
    assert validate_errors(workspace, cli) == []


def test_not_a_git_repo_or_workspace(tmp_path, cli):
    result = cli("-C", str(tmp_path), "lineage")
    assert result.code == 1 and "not inside an EvoTrainer workspace" in result.err
    assert "git init" not in result.err  # it would only lead to a second error
    git.Repo.init(tmp_path)
    result = cli("-C", str(tmp_path), "validate")
    assert result.code == 1 and "EvoTrainer workspace" in result.err


def test_init_refuses_non_empty_dir(tmp_path, cli):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    result = cli("init", str(tmp_path / "x"))
    assert result.code == 1 and "not empty" in result.err
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["keep.txt"]
    result = cli("init", str(tmp_path / "y"), "--example", "nope")
    assert result.code == 1 and "unknown example" in result.err


def test_git_store_worktree_tag_and_merge(workspace):
    store = workspace.git
    new_version(workspace, "v1", "v0", rationale="x")
    tip = store.rev("refs/heads/evo/v1")
    path = store.worktree_add(workspace.worktree_path("v1"), tip)
    assert (path / version_spec_path("v1")).is_file()
    assert store.worktree_add(path, tip) == path  # reused
    store.commit_files("evo/v1", {"runs/v1/run.yaml": b"state: Running\n"}, "record",
                       {"Action": "launch", "Version": "v1"})
    assert store.read("evo/v1", "runs/v1/run.yaml") == b"state: Running\n"
    # Detached: record commits on the branch leave the worktree untouched.
    assert not git.Repo(path).is_dirty(untracked_files=True)
    message = git.Repo(workspace.root).commit("evo/v1").message
    assert "Evotrainer-Action: launch" in message and "Evotrainer-Version: v1" in message
    store.tag("pruned/v1", "evo/v1", "pruned")
    assert "v1" in store.tags("pruned/")
    store.merge_into("main", "evo/v1", "Promote v1")
    assert (workspace.root / "runs" / "v1" / "run.yaml").is_file()  # checkout followed main
    assert not git.Repo(workspace.root).is_dirty(untracked_files=True)
    store.worktree_remove(path)
    assert not path.exists()


def test_backend_checks_run_at_version_new_and_validate(workspace, cli):
    result = cli("-C", str(workspace.root), "version", "new", "v1", "--parent", "v0",
                 "--set", "grpo.clip_high=0.1", "--rationale", "x")
    assert result.code == 1 and "recipe.grpo.clip_high" in result.err
    assert "v1" not in workspace.git.version_branches()
    commit_spec(workspace, "v1", SPEC.format(name="v1", parent="v0")
                + "recipe:\n  domain:\n    name: chess\n")
    problems = validate_errors(workspace, cli)
    assert [p["field"] for p in problems] == ["recipe.domain.name"]
    assert problems[0]["where"] == "evo/v1:spec/versions/v1.yaml:7:11"


def test_project_recipe_error_is_reported_once(workspace, cli):
    new_version(workspace, "v1", "v0", rationale="a")
    new_version(workspace, "v2", "v0", rationale="b")
    project = workspace.root / "spec" / "project.yaml"
    text = project.read_text()
    assert "recipe:\n" in text
    project.write_text(text.replace("    steps: 150\n", "    steps: 150\n    group_size: 1\n", 1))
    out = cli("-C", str(workspace.root), "validate")
    assert out.code == 1
    lines = [line for line in out.err.splitlines() if "group_size" in line]
    assert len(lines) == 1 and "spec/project.yaml" in lines[0]
