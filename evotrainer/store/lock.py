"""One reconcile at a time per workspace. The lock file names its holder, so a lock left
by a crashed process is recognised as stale and can be broken safely."""

from __future__ import annotations

import json
import os
import socket
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import psutil

from evotrainer.errors import EvoError


def holder(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_stale(info: dict) -> bool:
    """The holder's process is gone (only decidable on the holder's own host)."""
    if info.get("host") != socket.gethostname():
        return False
    try:
        process = psutil.Process(info["pid"])
        return abs(process.create_time() - info.get("create_time", 0)) > 1.0
    except (psutil.NoSuchProcess, KeyError):
        return True


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
    except FileExistsError:
        current = holder(path) or {}
        who = (
            f"{current.get('command', '?')!r} (pid {current.get('pid')} on "
            f"{current.get('host')}, since {current.get('started_at')})"
        )
        if current and is_stale(current):
            raise EvoError(
                f"stale lock: {who} is no longer running",
                where=str(path),
                hint="check nothing else runs, then `evotrainer unlock --force`",
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
