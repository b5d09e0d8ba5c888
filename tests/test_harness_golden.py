"""Built-in harness revisions are frozen: each one's file, digest, analyzers, diagnosis of a
fixed checked-in dump (tests/golden/harness/) and gate verdict never change. Diagnoses are
recorded against a revision by name and digest; a revision that changed in place would make
them say something else. A change is a new revision (h1 extends h0), backtested and adopted;
adding one means adding its golden entry (tests/golden/make_harness_golden.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from same_diagnosis import assert_same

from evotrainer.diagnosis.analyzers import ANALYZERS, Analyzer
from evotrainer.diagnosis.harness import parse_harness_text
from evotrainer.errors import EvoError
from evotrainer.store.builtin import builtin_dir

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_harness_golden import (  # noqa: E402
    EXPECTED,
    builtin_revisions,
    dump_tables,
    file_digest,
    golden,
)

EXPECTED_DATA = json.loads(EXPECTED.read_text())
HINT = (
    "a built-in harness revision is frozen: put the change in a new revision (parent: the "
    "one it changes), backtest it (`evotrainer harness backtest NEW --against OLD`), then add "
    "its golden entry with tests/golden/make_harness_golden.py"
)


def test_every_builtin_revision_has_its_golden_entry():
    assert sorted(builtin_revisions()) == sorted(EXPECTED_DATA), HINT


@pytest.mark.parametrize("name", sorted(EXPECTED_DATA))
def test_builtin_revision_file_never_changes(name):
    assert file_digest(name) == EXPECTED_DATA[name]["file"], f"{name}.yaml was edited; {HINT}"


@pytest.mark.parametrize("name", sorted(EXPECTED_DATA))
def test_builtin_revision_diagnoses_the_dump_as_recorded(name):
    revision = builtin_revisions()[name]
    rollouts, parent = dump_tables()
    got = golden(revision, rollouts, parent)
    want = EXPECTED_DATA[name]
    assert got["digest"] == want["digest"], f"{name}'s digest changed; {HINT}"
    assert got["analyzers"] == want["analyzers"], f"an analyzer {name} uses changed; {HINT}"
    assert_same(got["diagnosis"], want["diagnosis"], name)
    assert got["verdict"] == want["verdict"]


def test_the_dump_tells_the_revisions_apart():
    # The dump is a yardstick only if what differs between revisions shows on it.
    h0, h1 = (EXPECTED_DATA[n]["diagnosis"] for n in ("h0", "h1"))
    assert h0["metrics"]["dead_group_ratio"] == 0.5  # the 5e-4 group is dead, the 2e-3 one not
    assert h0["metrics"]["echo_trap_ratio"] == pytest.approx(1 / 24)  # 61 turns, not 60
    assert h1["metrics"]["echo_repeat_ratio"] > 0 and "echo_repeat_ratio" not in h0["metrics"]
    assert h1["metrics"]["leak_ratio"] > h0["metrics"]["leak_ratio"]
    assert h1["metrics"]["tampered_ratio"] > 0 and h1["metrics"]["val_tampered_ratio"] > 0
    assert {a["name"] for a in h1["alerts"]} - {a["name"] for a in h0["alerts"]} == {
        "echo_trap", "tampering"}


# ---- the check fails on the edits it exists to catch


def test_an_edit_to_h0_changes_what_the_golden_test_compares():
    text = (builtin_dir("harness_revisions") / "h0.yaml").read_text()
    assert "echo_turns: 60 " in text
    edited = parse_harness_text(text.replace("echo_turns: 60 ", "echo_turns: 59 "), "h0.yaml")
    rollouts, parent = dump_tables()
    got = golden(edited, rollouts, parent)
    assert got["digest"] != EXPECTED_DATA["h0"]["digest"]
    # Even under the old digest, the diagnosis of the dump tells (the 60-turn failure).
    assert got["diagnosis"]["metrics"]["echo_trap_ratio"] != pytest.approx(
        EXPECTED_DATA["h0"]["diagnosis"]["metrics"]["echo_trap_ratio"]
    )


def test_an_edit_to_an_analyzer_h0_uses_changes_what_the_golden_test_compares(monkeypatch):
    original = ANALYZERS["echo_trap"]

    def echo_trap(table: pa.Table, params: dict) -> np.ndarray:  # the drift h0 went through
        values = original.fn(table, params)
        return np.where(np.isnan(values), values, values)

    monkeypatch.setitem(ANALYZERS, "echo_trap", dataclasses.replace(original, fn=echo_trap))
    assert isinstance(ANALYZERS["echo_trap"], Analyzer)
    rollouts, parent = dump_tables()
    got = golden(builtin_revisions()["h0"], rollouts, parent)
    # Same values on the dump, yet the analyzer's source differs: the check still fails.
    assert got["analyzers"]["echo_trap"] != EXPECTED_DATA["h0"]["analyzers"]["echo_trap"]


# ---- a built-in revision's text is not parsed by DuckDB again (diagnosis/harness.py)


def test_every_builtin_revision_passes_the_sql_checks_its_text_skips(monkeypatch):
    from evotrainer.diagnosis import harness

    monkeypatch.setattr(harness, "_builtin_texts", lambda: frozenset())  # no text is built-in
    for name in sorted(EXPECTED_DATA):
        path = builtin_dir("harness_revisions") / f"{name}.yaml"
        assert harness.load_harness(path).name == name


def test_a_text_other_than_a_builtin_ones_has_its_sql_checked():
    text = (builtin_dir("harness_revisions") / "h0.yaml").read_text()
    select = "SELECT step, avg(correct) AS value FROM rollouts GROUP BY ROLLUP (step)"
    assert text.count(select) == 1
    assert parse_harness_text(text + "\n", "h0.yaml").name == "h0"
    with pytest.raises(EvoError, match="exactly one SELECT statement, found DELETE"):
        parse_harness_text(text.replace(select, "DELETE FROM rollouts"), "h0.yaml")
