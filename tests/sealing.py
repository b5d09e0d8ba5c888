"""Commits a test makes *as the controller* (sealed with the workspace's record key), for
tests whose subject is what happens after: a record or an approval the controller wrote.
Tests of forgery commit with plain `ws.git.commit_files`, as a branch author would."""

from __future__ import annotations

from evotrainer.store.workspace import Workspace


def seal_approval(ws: Workspace, name: str) -> None:
    """Seal the approval block `name`'s branch carries now, as `evotrainer approve` does."""
    ws.commit_records(name, {}, "seal the approval (test)", {},
                      approval=ws.versions()[name].approval)


def controller_commit(ws: Workspace, name: str, files: dict[str, bytes | None],
                      message: str = "a record (test)") -> str:
    """Commit record files onto `name`'s branch with the controller's seal."""
    return ws.commit_records(name, files, message, {})
