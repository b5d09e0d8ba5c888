"""The trained policy as a recorded artifact, and children that continue from their parent.

A run's final policy is a directory (a Hugging Face checkpoint: config, weights, tokenizer).
It is recorded in `run.yaml` like the rollouts, under `artifacts.checkpoint`, by path and a
digest over its files (a sorted manifest of `name sha256 size`), so swapping one weight file
is caught like swapping a Parquet file. A checkpoint that the retention policy dropped stays
recorded with `dropped: {at, reason}`: its rollouts and records remain negative evidence,
and nothing mistakes it for a lost artifact.

Continuation: `model.init: parent` in a version's recipe starts its job from the parent's
recorded policy instead of the base model (no warm start); `grpo.steps` then counts only
the new steps. The job's recipe carries `model.init_checkpoint: {path, digest}`, so the run's
recipe digest covers exactly which weights it started from.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import Workspace, run_path

CHECKPOINT = "checkpoint"  # artifacts key and the first seed's directory name
INIT_CHOICES = ("base", "parent")


def seed_checkpoint_name(index: int, seed: int) -> str:
    """The directory a job writes seed number `index` (value `seed`) of its recipe's seeds to."""
    return CHECKPOINT if index == 0 else f"{CHECKPOINT}-seed{seed}"


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def directory_digest(path: Path, follow_links: bool = False) -> tuple[str, int]:
    """`sha256:` over the sorted manifest of every file under `path`, and the total bytes.
    Links are refused: a recorded checkpoint is plain files inside the artifact dir. A model
    directory whose file links were confined first (a Hugging Face hub snapshot links its
    files to blobs) is read through them with `follow_links`."""
    lines, total = [], 0
    for file in sorted(p for p in path.rglob("*") if not p.is_dir()):
        if (file.is_symlink() and not follow_links) or not file.is_file():
            raise EvoError("a checkpoint holds something other than a plain file",
                           where=str(file), hint="remove the link or special file")
        size = file.stat().st_size
        total += size
        lines.append(f"{file.relative_to(path).as_posix()} {file_sha256(file)} {size}")
    manifest = "\n".join(lines).encode()
    return "sha256:" + hashlib.sha256(manifest).hexdigest(), total


def checkpoint_record(path: Path, recorded_path: str) -> dict[str, Any]:
    """The `artifacts.checkpoint` entry of a run record for the directory at `path`."""
    digest, size = directory_digest(path)
    return {"path": recorded_path, "digest": digest, "bytes": size}


def is_dropped(artifact: dict[str, Any] | None) -> bool:
    return bool(artifact and artifact.get("dropped"))


def verify_directory(path: Path, artifact: dict[str, Any], what: str) -> None:
    """Refuse a recorded checkpoint that is missing or changed, naming the directory."""
    if not path.is_dir():
        raise EvoError(f"the recorded policy of {what} is missing", where=str(path),
                       hint="restore it, or re-approve the version to retrain it")
    found, _ = directory_digest(path)
    if found != artifact.get("digest"):
        raise EvoError(
            f"the recorded policy of {what} changed since it was recorded "
            f"(digest {found[:19]}…, recorded {str(artifact.get('digest'))[:19]}…)",
            where=str(path),
            hint="restore the recorded checkpoint; a child never starts from other weights",
        )


def init_mode(recipe: dict[str, Any]) -> str:
    return (recipe.get("model") or {}).get("init") or "base"


def parent_checkpoint(ws: Workspace, parent: str, parent_run: dict[str, Any] | None) -> dict:
    """`{path, digest}` of the parent's recorded policy for a continuing child, checked: its
    own folder (`recorded_policy`), its digest."""
    artifact = ((parent_run or {}).get("artifacts") or {}).get(CHECKPOINT)
    if not artifact:
        raise EvoError(
            f"model.init is parent, but {parent} has no recorded policy yet",
            field="recipe.model.init",
            hint=f"wait for {parent} to finish, or set model.init: base",
        )
    if is_dropped(artifact):
        raise EvoError(
            f"model.init is parent, but {parent}'s policy was dropped by the retention policy "
            f"({artifact['dropped'].get('reason', 'gc')})",
            field="recipe.model.init",
            hint=f"retrain {parent} (evotrainer retry {parent}) or set model.init: base",
        )
    verify_directory(recorded_policy(ws, parent, parent_run)[0], artifact, parent)
    return {"path": artifact["path"], "digest": artifact["digest"]}


def check_job_start(recipe: dict[str, Any]) -> None:
    """A continuing job (`model.init: parent`) starts only from the exact weights its recipe
    names: reconcile sets `model.init_checkpoint`, and the job checks its digest before
    loading (either backend)."""
    start = (recipe.get("model") or {}).get("init_checkpoint")
    if init_mode(recipe) == "parent" and not start:
        raise EvoError(
            "model.init is parent, but the job names no model.init_checkpoint",
            field="recipe.model.init",
            hint="run the version through reconcile (it sets the parent's recorded policy), "
            "or set model.init: base",
        )
    if start:
        verify_directory(Path(start["path"]), start, "the parent version")


def own_folder(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies under it with no link anywhere on the way (its real path is
    itself), `folder` being a real path: a link inside a run's artifact folder (a job can make
    one) never leads gc or export outside it."""
    return os.path.realpath(path) == str(path) and path.is_relative_to(folder)


def run_folder(ws: Workspace, name: str, run: dict[str, Any]) -> Path:
    """The real path of the artifact folder `name`'s run record names: exactly
    `<artifact root>/<name>/<job id>`, the job id one plain path component (no `/`, no
    `..`), with no link below the artifact root. A record edited on a branch cannot point it
    at another version's folder (`job_id: ../v1/<its job>`) or anywhere else."""
    job_id = str(run.get("job_id") or "")
    own = Path(os.path.realpath(ws.artifact_root)) / name
    folder = own / job_id
    if job_id in ("", ".", "..") or Path(job_id).name != job_id or not own_folder(folder, own):
        raise EvoError(
            f"the run record of {name} names job {job_id!r}, whose folder is not inside "
            f"{name}'s own artifact folder {ws.record_path(own)}",
            where=f"{branch_name(name)}:{run_path(name, 'run.yaml')}", field="job_id",
            hint="a job id is one folder name under its version's artifact folder, with no "
            "link on the way; restore the record",
        )
    return folder


def recorded_policy(ws: Workspace, name: str, run: dict[str, Any] | None) -> tuple[Path, dict]:
    """The directory and record of `name`'s recorded policy. The path a run record names
    must be exactly `checkpoint` in the run's own artifact folder (`run_folder`), with no link
    on the way: a record edited on a branch can make neither export read nor gc delete any
    other folder."""
    run = run or {}
    artifact = (run.get("artifacts") or {}).get(CHECKPOINT)
    where = f"{branch_name(name)}:{run_path(name, 'run.yaml')}"
    if not artifact:
        raise EvoError(f"{name} has no recorded policy", where=where,
                       hint="only a version whose run finished has one")
    expected = run_folder(ws, name, run) / CHECKPOINT
    recorded = ws.root / str(artifact.get("path"))
    if os.path.realpath(recorded) != str(expected) or not own_folder(expected, expected.parent):
        raise EvoError(
            f"the run record of {name} names {artifact.get('path')!r} as its policy, not "
            f"{ws.record_path(expected)}",
            where=where, field=f"artifacts.{CHECKPOINT}.path",
            hint="a version's policy lives only in its own artifact folder; restore the record",
        )
    return expected, artifact
