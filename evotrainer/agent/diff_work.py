"""`harness diff`'s work shared with children forked from the caller.

A cold `harness diff` diagnoses every recorded version under both revisions (the backtest,
gate/harness_backtest.py) and replays the early stops of every recorded run under both
(agent/stop_replay.py). Both keep what they make on disk as they make it
(.evotrainer/cache/backtest), so the caller and children forked from it share the work
without talking: a child goes through its list from the last item back, keeping each one;
the caller goes through the same list from the first, reading back what a child kept and
making the rest, and stops the children once it has everything (at most the item a child is
on is made twice; nothing waits on a child). One child replays the early stops from the
start; a second diagnoses, forked once the comparisons' statistics library is imported,
which each child would otherwise import again. A child starts with the caller's modules
imported and the workspace read, where a fresh interpreter takes a second for both.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from evotrainer.agent.stop_replay import changes_over, replayed_versions, replays_kept, stop_inputs
from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.errors import EvoError
from evotrainer.gate.harness_backtest import diagnose_version, diagnoses_kept, recorded_versions
from evotrainer.stats.paired import import_tests
from evotrainer.store.workspace import VersionState, Workspace


@contextmanager
def shared_with_children(ws: Workspace, old: HarnessRevision, new: HarnessRevision, *,
                         replay: bool) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Children forked to diagnose every recorded version under `old` and `new`, and where
    `replay`, to replay the early stops of every recorded run: for the caller's backtest of
    `new` against `old`. Yields the function that answers `stop_changes(ws, old, new)` (none
    where not `replay`), for the caller to ask after its backtest. No child where one core is
    there, for the work kept from an earlier diff, or (diagnoses) for records the backtest
    refuses; the children are stopped as the block ends."""
    states = ws.versions()  # read once, before any fork: a child reads no git
    cut = [stop_inputs(old), stop_inputs(new)]
    runs = replayed_versions(ws, states) if replay else []
    names = recorded_versions(ws, states)
    children: list[int] = []
    try:
        if len(os.sched_getaffinity(0)) >= 2:
            if not replays_kept(ws, states, runs, cut):
                children.append(_forked(
                    lambda: changes_over(ws, states, cut, runs, backwards=True)))
            if not diagnoses_kept(ws, states, names, [old, new]) and _verified(ws, states):
                import_tests()
                children.append(_forked(lambda: [diagnose_version(ws, states, name, old, new)
                                                 for name in reversed(names)]))
        yield lambda: changes_over(ws, states, cut, runs)
    finally:
        for child in children:
            _stop(child, ws)


def _verified(ws: Workspace, states: dict[str, VersionState]) -> bool:
    """Whether the backtest will diagnose these records (it refuses, and says why, where a
    record cannot be checked)."""
    try:
        ws.refuse_unverified(states, "the backtest")
    except EvoError:
        return False
    return True


def _forked(work: Callable[[], object]) -> int:
    """The pid of a child forked to run `work`. It writes nothing but what it keeps (its
    output goes nowhere) and leaves by `os._exit`, running none of this process's exit
    handlers; what fails in it fails again in the caller, which reports it."""
    pid = os.fork()
    if pid:
        return pid
    try:
        nowhere = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(nowhere, fd)
        work()
    finally:
        os._exit(0)


def _stop(child: int, ws: Workspace) -> None:
    """Stop the child and remove the file it may have been writing (harness_backtest's
    `_remember` names each after its process)."""
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    for unfinished in (ws.state_dir / "cache" / "backtest").glob(f"{child}-*.tmp"):
        unfinished.unlink(missing_ok=True)
