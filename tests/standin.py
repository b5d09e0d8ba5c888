"""Helpers for tests that run the whole loop fast: the local backend launching
tests/standin_engine.py (real subprocess, real evidence, no training) instead of the engine.
Use with the `standin` fixture (conftest.py), which puts this folder on the jobs' PYTHONPATH
and makes `version new` apply the stand-in's recipe checks."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from evotrainer.backends.local import LocalBackend
from evotrainer.control.reconcile import Reconciler
from evotrainer.control.versions import approve, new_version
from evotrainer.store.workspace import Workspace


class StandinBackend(LocalBackend):
    """The local backend, launching tests/standin_engine.py instead of the engine."""

    engine_module = "standin_engine"
    python_flags = ()  # the stand-in is found through PYTHONPATH (tests/), which -I ignores

    def environment(self, job) -> dict[str, str]:
        return {**super().environment(job), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}

    def check(self, recipe: dict) -> None:
        pass  # the stand-in reads its own `domain.params`, which the engine would reject


def reconciler(ws: Workspace) -> Reconciler:
    return Reconciler(ws, log=lambda _: None, backends={"local": StandinBackend()})


def converge(ws: Workspace):
    return reconciler(ws).run(wait=True, poll_s=0.05)


def standin_settings(**params) -> list[str]:
    return [f"domain.params.{key}={json.dumps(value)}" for key, value in params.items()]


def propose(ws: Workspace, name: str, parent: str = "v0", **params) -> None:
    """Create and approve a version whose stand-in job has the given `domain.params`."""
    new_version(ws, name, parent, rationale="test", settings=standin_settings(**params))
    approve(ws, name, by="tester")


def record(ws: Workspace, name: str, kind: str) -> dict | None:
    return ws.version(name).records[kind]


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll `condition` until it holds; fail the test if it never does (a hang, not a speed
    bound: the timeout only keeps a broken job from blocking the suite)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def no_std_group_filter(ws: Workspace) -> None:
    """Set StdGroupFilter aside: it fires on any dead-group share above 15% (the paper's
    Math transfer at 0.21), which stand-in runs (about 0.2-0.25 at 4 samples a group) reach
    by chance; the tests that call this are about what happens when no trigger fires."""
    (ws.root / "skills" / "std-group-filter.yaml").unlink()
