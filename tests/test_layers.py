"""The layer contract in pyproject.toml ([tool.importlinter]): imports point down.

import-linter reads every import statement, those inside functions too, so a lazy import that
runs up a layer breaks the contract as surely as one at the top of a module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The console script the dev extra installs beside this interpreter.
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(repo: Path) -> subprocess.CompletedProcess[str]:
    """Run the contract over the `evotrainer` package found in `repo` (not the installed one)."""
    assert LINT_IMPORTS.exists(), "lint-imports comes with the dev extra: pip install -e '.[dev]'"
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)


def test_every_import_points_down() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_a_lazy_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    """The attack: a function in the store reaching up into control, the shape of the lazy
    imports store/validation.py used to make. The contract must name it."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "evotrainer", repo / "evotrainer",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    assert lint_imports(repo).returncode == 0  # the copy holds before the edit

    store_git = repo / "evotrainer" / "store" / "git.py"
    store_git.write_text(store_git.read_text() + (
        "\n\ndef _reaches_up() -> None:\n"
        "    from evotrainer.control import validation  # noqa: F401\n"))
    result = lint_imports(repo)
    assert result.returncode != 0
    assert "evotrainer.store.git -> evotrainer.control.validation" in result.stdout, result.stdout
