"""Per-item work over thousands of items (parsing and schema-checking every version spec of
a large lineage) on two CPUs: the second half in a forked child, whose answer comes back
pickled through a pipe, while this process does the first.

The child is a copy of this process, so nothing is sent to it; only its answer travels.
Whatever goes wrong there (an exception, a crash, an answer that does not read back) costs
time, never the answer: its half is then computed here. Below MIN_ITEMS, on one CPU, where
fork does not exist or while other Python threads run (a lock one of them holds would stay
held in the child), everything is computed here.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

# A spec costs about a quarter of a millisecond to parse and check, a fork a few: below
# this many items the second CPU saves under a tenth of a second, not worth a process.
MIN_ITEMS = 1000


def map_in_halves(work: Callable[[Sequence[T]], list[R]], items: Sequence[T]) -> list[R]:
    """`work(items)`, one answer per item in order, computed in two halves at once where a
    second CPU is there to take one."""
    if (len(items) < MIN_ITEMS or not hasattr(os, "fork") or cpus() < 2
            or _other_threads()):
        return work(items)
    half = len(items) // 2
    first, second = items[:half], items[half:]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its half down the pipe, then out without any of this
        code = 1  # process's exit handlers, buffered output or temporary files
        try:
            os.close(read)
            with os.fdopen(write, "wb") as out:
                pickle.dump(work(second), out, protocol=pickle.HIGHEST_PROTOCOL)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    answer = os.fdopen(read, "rb")
    try:
        mine = work(first)
        data = answer.read()
    finally:
        answer.close()  # before the wait: a child still writing gets EPIPE, not a hang
        _, status = os.waitpid(pid, 0)
    theirs = _answer(data) if os.waitstatus_to_exitcode(status) == 0 else None
    if not isinstance(theirs, list) or len(theirs) != len(second):
        theirs = work(second)
    return mine + theirs


def _other_threads() -> bool:
    """Whether a Python thread besides this one runs (a lock it holds would stay held in a
    forked child)."""
    return threading.active_count() > 1


def cpus() -> int:
    """The CPUs this process may run on (its affinity, where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _answer(data: bytes) -> object:
    """The child's answer; None when it does not read back (cut short)."""
    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001 — any unreadable answer means: compute that half here
        return None
