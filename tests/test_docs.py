"""The generated reference pages are what their sources say now: a
command's help or a column's meaning changed without `scripts/gen_docs.py` fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
gen_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_docs)


@pytest.mark.parametrize("page", sorted(gen_docs.PAGES))
def test_the_generated_page_is_current(page):
    committed = (ROOT / "docs" / page).read_text()
    assert committed == gen_docs.PAGES[page](), (
        f"docs/{page} is out of date: run .venv/bin/python scripts/gen_docs.py")


def test_every_column_of_the_rollout_table_is_documented():
    # ROLLOUT_COLUMNS (the documented columns' names, what checking a harness revision reads)
    # are the schema's, in its order.
    from evotrainer.evidence.columns import ROLLOUT_COLUMNS
    from evotrainer.evidence.schema import ROLLOUT_SCHEMA

    assert list(ROLLOUT_COLUMNS) == ROLLOUT_SCHEMA.names


def test_the_readme_test_command_is_what_ci_runs():
    """The README's two commands stay on its first screen and its test block is, byte for
    byte, the command `.ci/run` runs."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = readme.split("```bash\n")
    install = blocks[1].split("```")[0]
    test_block = next(b.split("```")[0] for b in blocks if b.startswith("python3 -m venv .venv"
                                                                       " && .venv/bin/pip "
                                                                       "install torch==2.13.0 \\"))
    assert test_block.strip() in ci
    assert install.startswith("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0")
    first_screen = "\n".join(readme.splitlines()[:50])
    assert install in first_screen and "bash .ci/run" in first_screen
    assert test_block in first_screen
    assert len(readme.splitlines()) <= 200
