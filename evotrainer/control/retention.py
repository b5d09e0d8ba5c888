"""Retention: which versions' trained policies `evotrainer gc` may delete, and deleting them.

`retention.checkpoints` in the project spec:
- keep-promoted-and-open (the default): keep the policy of every version on main (the
  promoted path, the baseline included) and of every open version (no verdict yet); drop
  pruned, reverted and inconclusive ones.
- keep-frontier-and-open: also drop the versions on main that main's frontier supersedes
  (the frontier: the latest promotion, or the baseline while nothing was promoted; what
  `export main` writes).
- keep-all: drop nothing.
Whatever the policy, the parent of an open version that continues from it (`model.init:
parent`) keeps its policy, and so does a version whose promotion is decided but not yet
merged. Only weights go (the recorded checkpoint, the other seeds' checkpoints, and the
folders of weights the run's backend names in `Backend.weight_folders`); rollouts, scores and
records stay as evidence.

Run records and artifact folders are not trusted: a branch can edit its run.yaml and a job
can leave links in its folder. Every folder gc deletes is the real path of a plain directory
inside that version's own artifact folder (`<artifact root>/<version>/<job id>`), found
without following a link and checked again just before it is deleted.

A drop is recorded first (`artifacts.checkpoint.dropped: {at, reason}` in the version's
run.yaml, one commit on its branch), then the folders are deleted: a crash in between leaves a
record that says dropped over weights still on disk, which the next gc deletes; never a
record claiming weights that are gone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from evotrainer.backends import Backends
from evotrainer.backends.base import Backend
from evotrainer.control.reconcile import record_text
from evotrainer.errors import EvoError
from evotrainer.store.checkpoints import (
    CHECKPOINT,
    init_mode,
    is_dropped,
    own_folder,
    recorded_policy,
)
from evotrainer.store.clock import now_iso
from evotrainer.store.lineage import main_frontier, merged_into_main, verdict_of
from evotrainer.store.records import MERGING
from evotrainer.store.workspace import VersionState, Workspace, run_path

POLICIES = ("keep-promoted-and-open", "keep-frontier-and-open", "keep-all")
DEFAULT_POLICY = POLICIES[0]


@dataclass(frozen=True)
class Drop:
    version: str
    reason: str
    folders: list[Path]  # the recorded policy, the other seeds', the backend's own
    bytes: int
    artifact_dir: Path  # the run's own folder (a real path): every folder lies inside it
    recorded: bool  # already recorded as dropped (an interrupted gc): only delete


def retention_policy(ws: Workspace) -> str:
    return ((ws.project.get("retention") or {}).get("checkpoints")) or DEFAULT_POLICY


def plan_gc(
    ws: Workspace,
    states: dict[str, VersionState] | None = None,
    backends: Backends | Mapping[str, Backend] | None = None,
) -> tuple[list[Drop], dict[str, str]]:
    """What gc would delete, and why each version with a policy on disk is kept. `backends`:
    the ones that ran the jobs, by name (default: the registry's), each naming its own
    folders of weights."""
    states = states if states is not None else ws.versions()
    if not isinstance(backends, Backends):
        backends = Backends(backends)
    policy = retention_policy(ws)
    on_main = merged_into_main(ws) & states.keys()
    frontier = main_frontier(states, on_main)
    continued = _continued_parents(ws, states)
    drops, kept = [], {}
    for name, state in sorted(states.items()):
        if state.record_errors:  # forged or malformed: read by no one, gc included
            errors = state.record_errors
            problem = errors.get("seal") or next(iter(errors.values()))  # forged first
            kept[name] = f"its records are refused ({problem.message})"
            continue
        run = state.run
        if run is None or not run.artifacts.get(CHECKPOINT):
            continue
        folder, artifact = recorded_policy(ws, name, state.records["run"])
        verdict = verdict_of(state)
        reason = None
        if name in continued:
            kept[name] = f"{continued[name]} continues from it"
        elif policy == "keep-all":
            kept[name] = "retention keep-all"
        elif verdict is None:
            kept[name] = "open (no verdict yet)"
        elif name == frontier:
            kept[name] = f"main's frontier ({verdict})"
        elif name in on_main and policy == "keep-promoted-and-open":
            kept[name] = f"on main ({verdict})"
        elif name in on_main and frontier is not None:
            reason = f"superseded by {frontier}"
        elif verdict in MERGING:  # kept until on main
            kept[name] = f"{verdict}, not yet merged into main"
        else:
            reason = f"{verdict}"
        if reason is None:
            continue
        folders = _weight_folders(folder.parent, backends[run.backend].weight_folders)
        if is_dropped(artifact) and not folders:
            continue  # dropped earlier, nothing left on disk
        drops.append(Drop(name, reason, folders, sum(_size(f) for f in folders),
                          folder.parent, is_dropped(artifact)))
    return drops, kept


def apply_gc(ws: Workspace, drops: list[Drop], policy: str) -> None:
    """Record each drop on its branch (sealed), then delete its folders."""
    states = ws.versions()
    for drop in drops:
        if not drop.recorded:
            run = dict(states[drop.version].records["run"])
            artifacts = {k: dict(v) for k, v in run["artifacts"].items()}
            artifacts[CHECKPOINT]["dropped"] = {
                "at": now_iso(), "reason": f"retention {policy}: {drop.reason}"
            }
            run["artifacts"] = artifacts
            ws.commit_records(  # sealed, as every record the controller writes
                drop.version,
                {run_path(drop.version, "run.yaml"): record_text("run", run).encode()},
                f"Drop the policy of {drop.version} ({drop.reason}); rollouts and records stay",
                {"Action": "gc", "Version": drop.version},
            )
        for folder in drop.folders:
            # Checked again: the folder may have become a link since it was planned.
            if not _plain_dir(folder, drop.artifact_dir):
                raise EvoError(
                    f"{folder} changed since gc planned to delete it (a link now stands on "
                    "its path); nothing there was deleted",
                    where=str(drop.artifact_dir),
                    hint="remove the link from the run's artifact folder, then run gc again",
                )
            shutil.rmtree(folder)  # fd-based: never follows a link inside the folder


def _continued_parents(ws: Workspace, states: dict[str, VersionState]) -> dict[str, str]:
    """parent → an open child that starts from the parent's policy (model.init: parent)."""
    out = {}
    for name, state in states.items():
        if not state.parent or verdict_of(state) is not None:
            continue
        if state.run and state.run.succeeded:
            continue  # trained already: it no longer needs its parent's weights
        try:
            continues = init_mode(ws.resolved_recipe(name, states)) == "parent"
        except EvoError:
            continues = True  # unreadable: keep the parent rather than guess
        if continues:
            out[state.parent] = name
    return out


def _weight_folders(artifact_dir: Path, backend_folders: tuple[str, ...]) -> list[Path]:
    """Every folder of weights in a run's artifact dir (`checkpoint`, `checkpoint-seed*`, and
    the backend's own, `backend_folders`), each a plain directory inside it: a link anywhere
    on the way (`shards -> /elsewhere`) is not followed, nor is anything else touched."""
    patterns = (CHECKPOINT, f"{CHECKPOINT}-seed*", *backend_folders)
    folders = [f for pattern in patterns for f in _matching(artifact_dir, pattern)]
    return [f for f in folders if _plain_dir(f, artifact_dir)]


def _matching(artifact_dir: Path, pattern: str) -> list[Path]:
    """The paths under `artifact_dir` that `pattern` names, part by part (a part ending in `*`:
    every folder of that prefix, none reached through a link)."""
    found = [artifact_dir]
    for part in pattern.split("/"):
        if part.endswith("*"):
            found = [child for folder in found for child in _children(folder, part[:-1])]
        else:
            found = [folder / part for folder in found]
    return found


def _children(folder: Path, prefix: str) -> list[Path]:
    """`folder`'s entries named `prefix*` that are directories themselves (not links)."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    with os.scandir(folder) as entries:
        return sorted(Path(e.path) for e in entries
                      if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False))


def _plain_dir(path: Path, artifact_dir: Path) -> bool:
    return path.is_dir() and own_folder(path, artifact_dir)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
