"""Proof of authorship for what only the controller may write: run records and approvals.

A version branch is writable by its author, so anything on it — `runs/<v>/run.yaml` naming
another version's job, a `scores.csv` copied from a better run, an approval block with the
(public) digest — could have been committed by hand. The controller therefore seals what it
writes with an HMAC-SHA256 whose key lives outside the repository:

- `EVOTRAINER_RECORD_KEY` in the environment (a CI secret in the pull-request flow; share it
  between every machine that reconciles or approves for one workspace), else
- a key file outside the workspace: `$XDG_CONFIG_HOME/evotrainer/keys/<id>.key` (default
  `~/.config`; the id is kept in the repository's git config, so a moved or copied
  workspace keeps its key; folder 0700, file 0600, made on first use). Never inside the
  workspace: a job's working directory is its worktree under `.evotrainer/`, so
  `../../record.key` would be in its reach. A key left
  at the old place, `.evotrainer/record.key`, is moved out on first use, saying so.

The seal is one file, `runs/<v>/seal.yaml`, committed with every record: `records` is the MAC
of the version's record files as that commit leaves them, `approval` the MAC of the approval
block (its digest binds the whole tree the version would merge). Nothing here is secret but
the key: a record or approval that does not verify was not written by a controller holding
it, and the version stops there.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import yaml

from evotrainer.errors import EvoError
from evotrainer.store import specs

KEY_ENV = "EVOTRAINER_RECORD_KEY"
KEY_FILE = "record.key"
SEAL_FILE = "seal.yaml"
# The files of runs/<v>/ the controller writes (and reads); the seal covers exactly these.
SEALED_FILES = ("run.yaml", "scores.csv", "diagnosis.yaml", "decision.yaml")
APPROVAL_FIELDS = ("approved", "by", "at", "digest")


def keys_dir() -> Path:
    """The folder holding this user's workspace keys (what a job's namespace hides)."""
    config = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(config) if os.path.isabs(config) else Path.home() / ".config"
    return base / "evotrainer" / "keys"


ID_CONFIG = "evotrainer.workspaceid"


def workspace_id(root: Path, create: bool = False) -> str | None:
    """The workspace's id: kept in its git config (`evotrainer.workspaceid`, made when
    `create`), so a moved or copied workspace finds its key and a fresh clone does not; the
    digest of its path where the folder is no git repository."""
    if not (root / ".git").exists():
        return hashlib.sha256(str(root).encode()).hexdigest()[:16]
    git = ["git", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "config",
           "--local"]
    found = subprocess.run([*git, "--get", ID_CONFIG], cwd=root, capture_output=True,
                           text=True, check=False).stdout.strip()
    if re.fullmatch(r"[0-9a-f]{16}", found):
        return found
    if not create:
        return None
    made = secrets.token_hex(8)
    subprocess.run([*git, ID_CONFIG, made], cwd=root, capture_output=True, check=True)
    return made


def key_file(state_dir: Path, create: bool = False) -> Path:
    """Where the key of the workspace whose state folder is `state_dir` lives: outside the
    workspace, named by its id (`workspace_id`)."""
    ident = workspace_id(state_dir.resolve().parent, create) or "none"
    return keys_dir() / f"{ident}.key"


def record_key(state_dir: Path, create: bool = True) -> bytes | None:
    """The controller's key: the environment's, else the workspace's key file outside the
    workspace (made, with mode 0600, when there is none yet and `create`; None when there is
    none and not). A key still at the old place inside the workspace is moved out first. A
    key file that is a link or not a plain file is refused: a branch or a neighbour must not
    be able to point the controller at its key."""
    from_env = os.environ.get(KEY_ENV, "")
    if from_env:
        return from_env.encode()
    legacy = state_dir / KEY_FILE
    path = key_file(state_dir, create=create or os.path.lexists(legacy))
    if os.path.lexists(legacy):
        return _move_out(legacy, path)
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    if not create:
        return None
    try:
        return _write_key(path, secrets.token_hex(32).encode())
    except FileExistsError:  # another process made it meanwhile
        return _read_key(path)


def _write_key(path: Path, key: bytes) -> bytes:
    """Write a new key file (its folder 0700, the file 0600, never over an existing one)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path.parent, 0o700)  # an existing folder too: the keys are no one else's
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise  # the caller's to handle (made meanwhile)
    except OSError as exc:
        raise EvoError(f"the record key cannot be written: {exc.strerror}", where=str(path),
                       hint=f"make {path.parent} writable, set XDG_CONFIG_HOME to a private "
                       f"folder, or set {KEY_ENV}") from None
    with os.fdopen(fd, "wb") as out:
        out.write(key + b"\n")
    return _read_key(path)


def _move_out(legacy: Path, path: Path) -> bytes:
    """Move a key kept inside the workspace (where a job could read it) to `path`."""
    key = _read_key(legacy)
    with contextlib.suppress(FileExistsError):  # made meanwhile, or kept at both places
        _write_key(path, key)
    if _read_key(path) != key:
        raise EvoError("two record keys: one inside the workspace, another outside it",
                       where=str(legacy), hint=f"keep the one the controller sealed with at "
                       f"{path} and remove the other")
    legacy.unlink()
    print(f"evotrainer: moved the record key out of the workspace, where a job could read "
          f"it: {legacy} -> {path}", file=sys.stderr)
    return key


def _read_key(path: Path) -> bytes:
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_size > 4096:
        raise EvoError(
            "the record key is not a plain file",
            where=str(path),
            hint=f"remove it (a new key is made) or set {KEY_ENV}",
        )
    key = path.read_bytes().strip()
    if len(key) < 32:
        raise EvoError("the record key is too short", where=str(path),
                       hint=f"remove it (a new key is made) or set {KEY_ENV}")
    return key


def _mac(key: bytes, *parts: str) -> str:
    return "hmac-sha256:" + hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def records_mac(key: bytes, version: str, files: Mapping[str, bytes | None],
                previous: str | None = None) -> str:
    """The MAC of a version's record files (absent ones included as absent) and, where
    given, `previous`: the commit the sealing commit was written onto, which binds the
    records to their place in the branch's history (a seal restored onto another commit,
    or replayed later, does not verify there)."""
    parts = [
        f"{name}={hashlib.sha256(files[name]).hexdigest() if files.get(name) is not None else '-'}"
        for name in SEALED_FILES
    ]
    if previous is not None:
        parts.append(f"previous={previous}")
    return _mac(key, "records", version, *parts)


def parsed_mac(key: bytes, raw: bytes, data: bytes) -> str:
    """The MAC of a record file's bytes and of the data parsed from them (`data`, as JSON
    with sorted keys): a parse kept outside git is read back only where this controller
    kept it for those bytes."""
    return _mac(key, "parsed", hashlib.sha256(raw).hexdigest(), hashlib.sha256(data).hexdigest())


def approval_mac(key: bytes, version: str, approval: Mapping[str, object]) -> str:
    return _mac(key, "approval", version, *(f"{k}={approval.get(k)!s}" for k in APPROVAL_FIELDS))


def seal_text(seal: Mapping[str, str]) -> bytes:
    return (
        "# Written by the EvoTrainer controller: the HMAC of this version's records and\n"
        "# approval (store/seal.py). A hand-written or copied seal does not verify.\n"
        + yaml.safe_dump(dict(seal), sort_keys=True)
    ).encode()


def read_seal(blob: bytes | None) -> dict[str, str]:
    """The seal file's MACs ({} when absent or not a mapping of strings)."""
    if blob is None or len(blob) > 4096:
        return {}
    try:  # bounded: a 600-byte alias bomb is branch content too
        data = specs.load_yaml(blob, SEAL_FILE)
    except EvoError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, str)}


def same(a: str | None, b: str) -> bool:
    return isinstance(a, str) and hmac.compare_digest(a, b)
