"""Shared fixtures: a fresh workspace made by `init`, and the real CLI entry point."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from evotrainer.control.scaffold import init_workspace
from evotrainer.store.workspace import Workspace

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
# Record keys live under the user's config folder (store/seal.py): the suite's go to a folder
# of its own, never into the home of whoever runs it.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="evotrainer-test-config-")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast lane first: every test that trains a model for real (`slow`) runs after the
    rest, so a broken check shows within the first minutes of a run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    # The names click's CliRunner uses, so either style of test reads the same.
    @property
    def exit_code(self) -> int:
        return self.code

    @property
    def output(self) -> str:
        return self.out + self.err


@pytest.fixture
def standin(monkeypatch):
    """Jobs run tests/standin_engine.py (see tests/standin.py) instead of the engine."""
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [tests, *filter(None, [os.environ.get("PYTHONPATH")])]))
    from standin import StandinBackend

    from evotrainer.backends import BACKEND_TYPES

    monkeypatch.setitem(BACKEND_TYPES, "local", StandinBackend)


@pytest.fixture
def standin_verl(monkeypatch):
    """verl jobs import tests/verl_standin's verl instead of the real one, through
    PYTHONPATH (a job's worktree never can: its jobs run with PYTHONSAFEPATH)."""
    standin = str(Path(__file__).resolve().parent / "verl_standin")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [standin, *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    return Workspace(init_workspace(tmp_path / "ws", "arith"))


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `evotrainer ARGS...` in-process through `main()`, as a user would."""
    from evotrainer.cli import main

    def run(*args: str, cwd: Path | None = None) -> CliResult:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", ["evotrainer", *args])
        monkeypatch.setenv("COLUMNS", "200")
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
