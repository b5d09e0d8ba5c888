"""A workspace made by an older evotrainer keeps its harness revisions in harness_versions/:
every command but `migrate` refuses it with the fix in one line, and `migrate` moves the
folder to harness_revisions/ in one commit on main, each file keeping its content, digest
and history. A version branch made before the move still holds the old folder: it merges
into main under the new name, and a file it added to the old folder stops the merge."""

from __future__ import annotations

import git
import pytest

from evotrainer.agent.retrieval import knowledge
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import new_version
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.errors import EvoError
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import Workspace

OLD, NEW = "harness_versions", "harness_revisions"


def old_layout(ws: Workspace) -> git.Repo:
    """`ws` as an older evotrainer made it: every commit holds the harness revisions under
    harness_versions/ (history rewritten), and a version v1 forked from v0."""
    repo = git.Repo(ws.root)
    rename = (f"git ls-files -s | sed 's#\t{NEW}/#\t{OLD}/#' | GIT_INDEX_FILE=$GIT_INDEX_FILE.new "
              "git update-index --index-info && mv $GIT_INDEX_FILE.new $GIT_INDEX_FILE")
    repo.git.filter_branch("--index-filter", rename, "--", "--all",
                           env={"FILTER_BRANCH_SQUELCH_WARNING": "1"})
    assert (ws.root / OLD).is_dir() and not (ws.root / NEW).exists()
    new_version(ws, "v1", "v0", rationale="forked before the move")
    return repo


def tree(repo: git.Repo, ref: str, folder: str) -> dict[str, str]:
    """{file name: mode, type and object id} under `folder` at `ref`."""
    entries = (line.split("\t", 1) for line in
               repo.git.ls_tree("-r", ref, "--", folder + "/").splitlines())
    return {path.removeprefix(folder + "/"): meta for meta, path in entries}


@pytest.mark.parametrize("command", [["validate"], ["plan"], ["lineage"],
                                     ["harness", "backtest", "h0"]])
def test_a_command_refuses_the_old_folder_with_the_fix(workspace, cli, command):
    old_layout(workspace)
    result = cli("-C", str(workspace.root), *command)
    assert result.code == 1
    assert f"{OLD}/ is now named {NEW}/" in result.output
    assert "evotrainer migrate" in result.output and f"git mv {OLD} {NEW}" in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_migrate_moves_the_folder_in_one_commit_and_keeps_everything(workspace, cli):
    repo = old_layout(workspace)
    before = tree(repo, "main", OLD)
    names = sorted(name.removesuffix(".yaml") for name in before)
    digests = {name: resolve_harness(name).digest for name in names}  # the built-in ones
    history = len(repo.git.log("--follow", "--format=%H", "--", f"{OLD}/h0.yaml").split())
    main_before = repo.head.commit.hexsha

    result = cli("-C", str(workspace.root), "migrate")
    assert result.code == 0, result.output
    assert f"moved {len(before)} file(s)" in result.out
    head = repo.head.commit
    assert head.parents == (repo.commit(main_before),)
    assert "Evotrainer-Action: migrate" in head.message
    assert tree(repo, "main", NEW) == before and tree(repo, "main", OLD) == {}
    assert not (workspace.root / OLD).exists()
    assert not repo.is_dirty(untracked_files=True)  # the checkout followed main
    moved = Workspace(workspace.root)
    assert moved.harness_names() == names
    assert {name: resolve_harness(name, moved.root).digest for name in names} == digests
    assert len(repo.git.log("--follow", "--format=%H", "--", f"{NEW}/h0.yaml").split()) \
        == history + 1
    assert cli("-C", str(workspace.root), "validate").code == 0
    again = cli("-C", str(workspace.root), "migrate")
    assert again.code == 0 and "nothing to migrate" in again.out
    assert repo.head.commit == head

    # v1 still holds the old folder; merged into main, it brings no harness_versions/ back.
    assert tree(repo, branch_name("v1"), OLD) == before
    workspace.git.merge_into("main", branch_name("v1"), "Promote v1")
    assert tree(repo, "main", OLD) == {} and tree(repo, "main", NEW) == before
    assert not (workspace.root / OLD).exists()
    assert cli("-C", str(workspace.root), "validate").code == 0


def test_a_revision_added_under_the_old_folder_stops_the_merge(workspace, cli):
    repo = old_layout(workspace)
    text = workspace.git.read("main", f"{OLD}/h0.yaml")
    workspace.git.commit_files(branch_name("v1"), {f"{OLD}/h9.yaml": text}, "add h9")
    assert cli("-C", str(workspace.root), "migrate").code == 0
    main = repo.head.commit
    with pytest.raises(EvoError, match="conflicts"):
        workspace.git.merge_into("main", branch_name("v1"), "Promote v1")
    assert repo.head.commit == main and not (workspace.root / OLD).exists()


def test_migrate_names_what_it_cannot_move(workspace, cli):
    old_layout(workspace)
    draft = workspace.root / OLD / "draft.yaml"
    draft.write_text("name: draft\n")
    result = cli("-C", str(workspace.root), "migrate")
    assert result.code == 1 and f"{OLD}/draft.yaml" in result.err
    assert (workspace.root / NEW / "h0.yaml").is_file() and draft.is_file()
    refused = cli("-C", str(workspace.root), "validate")
    assert refused.code == 1 and f"{OLD}/ is left beside {NEW}/" in refused.output


def test_migrate_refuses_main_with_both_folders(workspace, cli):
    repo = git.Repo(workspace.root)
    (workspace.root / OLD).mkdir()
    (workspace.root / OLD / "h9.yaml").write_bytes((workspace.root / NEW / "h0.yaml").read_bytes())
    repo.git.add(OLD)
    repo.git.commit("-m", "both")
    head = repo.head.commit
    result = cli("-C", str(workspace.root), "migrate")
    assert result.code == 1 and f"main holds both {OLD}/ and {NEW}/" in result.err
    assert repo.head.commit == head


def test_a_listed_workspace_in_the_old_layout_is_named_with_its_fix(workspace, tmp_path):
    """A workspace whose skill_library lists one in the old layout: retrieval names the
    listed workspace, the field that lists it and the migration to run there."""
    other = Workspace(init_workspace(tmp_path / "older", "arith"))
    old_layout(other)
    with pytest.raises(EvoError) as refused:
        knowledge(workspace, workspaces=(str(other.root),))
    assert refused.value.field == "skill_library.workspaces"
    assert f"{OLD}/ is now named {NEW}/" in refused.value.message
    assert refused.value.hint.startswith(f"in {other.root}: run `evotrainer migrate`")
