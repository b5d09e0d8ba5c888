"""The generated reference pages are what their sources say now (issue 28 item 10): a
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
    from evotrainer.evidence.schema import COLUMN_DOCS, ROLLOUT_SCHEMA

    assert list(COLUMN_DOCS) == ROLLOUT_SCHEMA.names
