"""Retention: which versions' trained policies `evotrainer gc` may delete, and deleting them.

`retention.checkpoints` in the project spec:
- keep-promoted-and-open (the default): keep the policy of every version promoted into main
  and of every open version (no verdict yet); drop pruned, reverted and inconclusive ones.
- keep-frontier-and-open: also drop promoted versions superseded by a later promotion.
- keep-all: drop nothing.
Whatever the policy, the parent of an open version that continues from it (`model.init:
parent`) keeps its policy. Only weights go (the recorded checkpoint, the other seeds'
checkpoints, verl's FSDP shards); rollouts, scores and records stay as evidence.

A drop is recorded first (`artifacts.checkpoint.dropped: {at, reason}` in the version's
run.yaml, one commit on its branch), then the folders are deleted: a crash in between leaves a
record that says dropped over weights still on disk, which the next gc deletes; never a
record claiming weights that are gone.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from evotrainer.control.reconcile import record_text
from evotrainer.errors import EvoError
from evotrainer.store.checkpoints import CHECKPOINT, init_mode, is_dropped, recorded_policy
from evotrainer.store.clock import now_iso
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import VersionState, Workspace, run_path

POLICIES = ("keep-promoted-and-open", "keep-frontier-and-open", "keep-all")
DEFAULT_POLICY = POLICIES[0]


@dataclass(frozen=True)
class Drop:
    version: str
    reason: str
    folders: list[Path]  # the recorded policy, the other seeds', verl's shards
    bytes: int
    recorded: bool  # already recorded as dropped (an interrupted gc): only delete


def retention_policy(ws: Workspace) -> str:
    return ((ws.project.get("retention") or {}).get("checkpoints")) or DEFAULT_POLICY


def plan_gc(
    ws: Workspace, states: dict[str, VersionState] | None = None
) -> tuple[list[Drop], dict[str, str]]:
    """What gc would delete, and why each version with a policy on disk is kept."""
    states = states if states is not None else ws.versions()
    policy = retention_policy(ws)
    main = ws.git.rev("refs/heads/main")
    on_main = ws.git.merged_versions("main") if main else set()
    promoted = {
        name for name, state in states.items()
        if _verdict(state) == "promote" and name in on_main
    }
    frontier = max(
        promoted, key=lambda n: (states[n].decision.decided_at, n),
        default=None,
    )
    continued = _continued_parents(ws, states)
    drops, kept = [], {}
    for name, state in sorted(states.items()):
        run = state.run
        if run is None or not run.artifacts.get(CHECKPOINT):
            continue
        folder, artifact = recorded_policy(ws, name, state.records["run"])
        verdict = _verdict(state)
        reason = None
        if name in continued:
            kept[name] = f"{continued[name]} continues from it"
        elif policy == "keep-all":
            kept[name] = "retention keep-all"
        elif verdict is None:
            kept[name] = "open (no verdict yet)"
        elif name in promoted and (policy == "keep-promoted-and-open" or name == frontier):
            kept[name] = "the promoted frontier" if name == frontier else "promoted"
        elif name in promoted:
            reason = f"superseded by {frontier}"
        else:
            reason = f"{verdict}"
        if reason is None:
            continue
        folders = _weight_folders(folder)
        if is_dropped(artifact) and not folders:
            continue  # dropped earlier, nothing left on disk
        drops.append(Drop(name, reason, folders, sum(_size(f) for f in folders),
                          is_dropped(artifact)))
    return drops, kept


def apply_gc(ws: Workspace, drops: list[Drop], policy: str) -> None:
    """Record each drop on its branch, then delete its folders."""
    states = ws.versions()
    for drop in drops:
        if not drop.recorded:
            run = dict(states[drop.version].records["run"])
            artifacts = {k: dict(v) for k, v in run["artifacts"].items()}
            artifacts[CHECKPOINT]["dropped"] = {
                "at": now_iso(), "reason": f"retention {policy}: {drop.reason}"
            }
            run["artifacts"] = artifacts
            ws.git.commit_files(
                branch_name(drop.version),
                {run_path(drop.version, "run.yaml"): record_text("run", run).encode()},
                f"Drop the policy of {drop.version} ({drop.reason}); rollouts and records stay",
                {"Action": "gc", "Version": drop.version},
            )
        for folder in drop.folders:
            shutil.rmtree(folder)


def _verdict(state: VersionState) -> str | None:
    decision = state.decision
    return (decision.verdict or None) if decision else None  # "": a record without one


def _continued_parents(ws: Workspace, states: dict[str, VersionState]) -> dict[str, str]:
    """parent → an open child that starts from the parent's policy (model.init: parent)."""
    out = {}
    for name, state in states.items():
        if not state.parent or _verdict(state) is not None:
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


def _weight_folders(policy: Path) -> list[Path]:
    """Every folder of weights in a run's artifact dir (a verl job keeps its shards under
    verl/seed*/checkpoints); nothing else in it is touched."""
    artifact_dir = policy.parent
    folders = [policy, *sorted(artifact_dir.glob(f"{CHECKPOINT}-seed*"))]
    folders += sorted(artifact_dir.glob("verl/seed*/checkpoints"))
    return [f for f in folders if f.is_dir() and not f.is_symlink()]


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
