"""`harness diff`'s work shared with children forked from the caller.

A cold `harness diff` diagnoses every recorded version under both revisions (the backtest,
gate/harness_backtest.py) and replays the early stops of every recorded run under both
(agent/stop_replay.py). Both keep what they make on disk as they make it
(.evotrainer/cache/backtest), so the caller and children forked from it share the work: a
child goes through its list from the last item back, keeping each one; the caller goes
through the same list from the first, reading back what the child kept and making the rest.
One child replays the early stops; a second diagnoses, forked once the comparisons'
statistics library is imported where they are left to make (each child would import it
again). Where a child and the caller meet, the caller waits for the item the child is on
(while the child is there and working) and the child stops (`_Meeting`), so no item is
made twice. A child starts with the caller's modules imported and the workspace read,
where a fresh interpreter takes a second for both; the children are stopped once the
caller has everything.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evotrainer.agent.stop_replay import (
    changes_over,
    replay_stops,
    replayed_versions,
    replays_kept,
    stop_inputs,
)
from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.errors import EvoError
from evotrainer.gate.harness_backtest import (
    Progress,
    diagnose_version,
    diagnoses_kept,
    recorded_versions,
)
from evotrainer.stats.paired import import_tests
from evotrainer.store.halves import cpus
from evotrainer.store.workspace import VersionState, Workspace


@dataclass(frozen=True)
class SharedWork:
    """What the caller of `shared_with_children` asks: `early_stops()` answers
    `stop_changes(ws, old, new)` (none where not replayed), after its backtest;
    `before_each_version(progress)` is the `progress` its backtest takes, which shows
    `progress` and, where the diagnosing child is on the version in hand, waits for it."""

    early_stops: Callable[[], list[dict[str, Any]]]
    before_each_version: Callable[[Progress | None], Progress]


@contextmanager
def shared_with_children(ws: Workspace, old: HarnessRevision, new: HarnessRevision, *,
                         replay: bool) -> Iterator[SharedWork]:
    """Children forked to diagnose every recorded version under `old` and `new`, and where
    `replay`, to replay the early stops of every recorded run: for the caller's backtest of
    `new` against `old`. No child where one CPU is there or fork is not, for the work kept
    from an earlier diff, or (diagnoses) for records the backtest refuses; the children are
    stopped as the block ends."""
    states = ws.versions()  # read once, before any fork: the children start with them
    cut = [stop_inputs(old), stop_inputs(new)]
    runs = replayed_versions(ws, states) if replay else []
    names = recorded_versions(ws, states)
    cache = ws.state_dir / "cache" / "backtest"
    # Before any fork: the children share them.
    runs_met, versions_met = _Meeting(len(runs)), _Meeting(len(names))
    replayer: _Child | None = None
    diagnoser: _Child | None = None
    try:
        replays_left = not replays_kept(ws, states, runs, cut)
        diagnoses_left = not diagnoses_kept(ws, states, names, [old, new]) and \
            _verified(ws, states)
        if hasattr(os, "fork") and cpus() >= 2 and (replays_left or diagnoses_left):
            _load_what_children_read()
            if replays_left:
                def replay_from_the_last() -> None:
                    for i in reversed(range(len(runs))):
                        if not runs_met.child_takes(i):
                            return
                        replay_stops(ws, states, runs[i], cut)

                replayer = _Child.fork(cache, replay_from_the_last)
            if diagnoses_left:
                # Each version is compared with its parent in its diagnosis under `old`
                # (`new`'s reads that comparison where both test alike): where those are
                # left to make, the statistics library is imported before the fork.
                if new.procedure != old.procedure or not diagnoses_kept(ws, states, names,
                                                                        [old]):
                    import_tests()

                def diagnose_from_the_last() -> None:
                    for i in reversed(range(len(names))):
                        if not versions_met.child_takes(i):
                            return
                        diagnose_version(ws, states, names[i], old, new)

                diagnoser = _Child.fork(cache, diagnose_from_the_last)

        def early_stops() -> list[dict[str, Any]]:
            for i, name in enumerate(runs):
                if replayer is not None and runs_met.caller_meets(i):
                    replayer.wait_while_working(
                        lambda name=name: replays_kept(ws, states, [name], cut))
                replay_stops(ws, states, name, cut)  # kept by the replayer, else made here
            return changes_over(ws, states, cut, runs)

        def before_each_version(shown: Progress | None) -> Progress:
            def before(name: str, done: int, total: int) -> None:
                if shown is not None:
                    shown(name, done, total)
                if diagnoser is not None and name in names and \
                        versions_met.caller_meets(names.index(name)):
                    diagnoser.wait_while_working(
                        lambda: diagnoses_kept(ws, states, [name], [old, new]))
            return before

        yield SharedWork(early_stops, before_each_version)
    finally:
        for child in (replayer, diagnoser):
            if child is not None:
                child.stop()


class _Meeting:
    """Where the caller (from the first item of a list on) and a child (from the last one
    back) are, in memory both see (an anonymous shared mapping, made before the fork).
    Each writes where it is before reading where the other is, so when both come to one
    item at least one of them sees the other there."""

    def __init__(self, items: int) -> None:
        self.slots = mmap.mmap(-1, 8)
        self._put(0, -1)
        self._put(1, items)

    def child_takes(self, item: int) -> bool:
        """The child comes to `item`: whether it makes it (the caller is not there yet)."""
        self._put(1, item)
        return self._get(0) < item

    def caller_meets(self, item: int) -> bool:
        """The caller comes to `item`: whether the child is on it."""
        self._put(0, item)
        return self._get(1) == item

    def _put(self, slot: int, value: int) -> None:
        struct.pack_into("i", self.slots, 4 * slot, value)

    def _get(self, slot: int) -> int:
        return struct.unpack_from("i", self.slots, 4 * slot)[0]


def _load_what_children_read() -> None:
    """Import what reading rollouts and querying them loads on first use (pyarrow's dataset
    and acero modules, and pandas, which pyarrow and DuckDB import where it is installed:
    a few tenths of a second), once here rather than once in each child."""
    import pyarrow.acero  # noqa: F401
    import pyarrow.dataset  # noqa: F401


def _verified(ws: Workspace, states: dict[str, VersionState]) -> bool:
    """Whether the backtest will diagnose these records (it refuses, and says why, where a
    record cannot be checked)."""
    try:
        ws.refuse_unverified(states, "the backtest")
    except EvoError:
        return False
    return True


class _Child:
    """A child forked to run `work`, which keeps what it makes under `cache`. It writes
    nothing else (its output goes nowhere) and leaves by `os._exit`, running none of this
    process's exit handlers; what fails in it fails again in the caller, which reports it.
    Unlike store/halves.py's, this child is forked whatever threads run here: nothing waits
    on it but the caller at the item they meet on, and that only while its CPU time grows."""

    def __init__(self, pid: int, cache: Path) -> None:
        self.pid, self.cache, self.ended = pid, cache, False

    @classmethod
    def fork(cls, cache: Path, work: Callable[[], object]) -> _Child | None:
        """The child, or None where the system forks no process (the caller does it all)."""
        try:
            pid = os.fork()
        except OSError:
            return None
        if pid:
            return cls(pid, cache)
        try:
            nowhere = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(nowhere, fd)
            work()
        finally:
            os._exit(0)

    def wait_while_working(self, done: Callable[[], bool], poll_s: float = 0.01) -> None:
        """Wait until `done`, while the child runs and its CPU time grows from one second
        to the next (one stuck or gone leaves the work to the caller)."""
        working, since = self._cpu_ticks(), time.monotonic()
        while not done() and not self._exited():
            if time.monotonic() - since >= 1.0:
                ticks = self._cpu_ticks()
                if ticks is None or ticks == working:
                    return
                working, since = ticks, time.monotonic()
            time.sleep(poll_s)

    def _exited(self) -> bool:
        if not self.ended:
            self.ended = os.waitpid(self.pid, os.WNOHANG)[0] != 0
        return self.ended

    def _cpu_ticks(self) -> int | None:
        """The child's user and system time so far (/proc/PID/stat), None where unknown."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            return None

    def stop(self) -> None:
        """Stop the child and remove the file it may have been writing (harness_backtest's
        `_remember` names each after its process)."""
        if not self._exited():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.ended = True
        for unfinished in self.cache.glob(f"{self.pid}-*.tmp"):
            unfinished.unlink(missing_ok=True)
