"""One reconcile at a time per workspace. The lock file names its holder, so a lock left
by a crashed process is recognised as stale and can be broken safely.

Whatever is found at the lock's path gets a clear answer instead of a traceback: an empty
or unreadable file (a holder that died while writing it, or garbage), a directory, a holder
record with wrong types, a holder on another host (whose liveness cannot be checked here).
`evotrainer unlock --force` can break each of them."""

from __future__ import annotations

import json
import os
import reprlib
import shutil
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import psutil

from evotrainer.errors import EvoError

# Linux caps pids at 2**22 (pid_max); anything past a C int is not a process id, and psutil
# would overflow on it.
MAX_PID = 2**31 - 1


@dataclass
class LockState:
    """What holds the lock: `info` when the file names a holder, else why it cannot."""

    info: dict | None
    problem: str | None = None  # unreadable: empty, garbage, wrong types, a directory

    @property
    def foreign(self) -> bool:
        return self.info is not None and self.info.get("host") != socket.gethostname()

    def describe(self) -> str:
        if self.info is None:
            return f"an unreadable lock ({self.problem})"
        info = self.info
        return (
            f"{info.get('command', '?')!r} (pid {info.get('pid')} on {info.get('host')}, "
            f"since {info.get('started_at')})"
        )


def read_lock(path: Path) -> LockState | None:
    """None when no lock is held."""
    if path.is_dir():
        return LockState(None, "the lock path is a directory")
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        return LockState(None, f"cannot read it: {exc.__class__.__name__}")
    if not text.strip():
        return LockState(None, "the file is empty")
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):  # bad JSON, an int past Python's digit limit, nesting
        return LockState(None, "the file is not a lock record")
    if not isinstance(info, dict):
        return LockState(None, "the file is not a lock record")
    pid = info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= MAX_PID:
        return LockState(None, f"its pid is not a process id ({reprlib.repr(pid)})")
    if not isinstance(info.get("create_time", 0), (int, float)):
        return LockState(None, "its create_time is not a number")
    return LockState(info)


def holder(path: Path) -> dict | None:
    """The holder record, when the lock file holds a readable one."""
    state = read_lock(path)
    return state.info if state else None


def is_stale(info: dict) -> bool:
    """The holder's process is gone (only decidable on the holder's own host)."""
    if info.get("host") != socket.gethostname():
        return False
    try:
        process = psutil.Process(info["pid"])
        return abs(process.create_time() - info.get("create_time", 0)) > 1.0
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return True


def breakable(state: LockState) -> bool:
    """Safe to break here: unreadable (no holder can be named), or a dead local holder."""
    return state.info is None or is_stale(state.info)


def break_lock(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def workspace_lock(path: Path, command: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    info = {
        "host": socket.gethostname(),
        "pid": me.pid,
        "create_time": me.create_time(),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command or " ".join(sys.argv),
    }
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except (FileExistsError, IsADirectoryError):
        current = read_lock(path) or LockState(None, "it vanished while being read")
        who = current.describe()
        if current.info is None:
            raise EvoError(
                f"the workspace lock is unreadable: {current.problem}",
                where=str(path),
                hint="no holder can be named; check nothing else runs, then "
                "`evotrainer unlock --force`",
            ) from None
        if is_stale(current.info):
            raise EvoError(
                f"stale lock: {who} is no longer running",
                where=str(path),
                hint="check nothing else runs, then `evotrainer unlock --force`",
            ) from None
        if current.foreign:
            raise EvoError(
                f"another reconcile holds the workspace lock from another host: {who}",
                where=str(path),
                hint="its liveness cannot be checked from here; if it is gone, "
                "`evotrainer unlock --force --other-host`",
            ) from None
        raise EvoError(
            f"another reconcile holds the workspace lock: {who}",
            where=str(path),
            hint="wait for it to finish; plans are level-triggered, so rerunning later converges",
        ) from None
    with os.fdopen(fd, "w") as handle:
        json.dump(info, handle)
    try:
        yield info
    finally:
        if (holder(path) or {}).get("pid") == me.pid:
            path.unlink(missing_ok=True)
