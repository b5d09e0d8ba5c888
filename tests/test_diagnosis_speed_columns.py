"""A diagnosis from Parquet reads only the columns its harness reads and gives what reading
every column gives; a query that may read a column it does not name makes it read them all."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from same_diagnosis import assert_same

from evotrainer.diagnosis import diagnose as diagnose_module
from evotrainer.diagnosis.diagnose import columns_read, diagnose
from evotrainer.diagnosis.harness import Metric, resolve_harness
from evotrainer.diagnosis.sql import query_columns
from evotrainer.errors import EvoError
from evotrainer.evidence import io
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.evidence.synthetic import random_rollouts

H0 = resolve_harness("h0")
COLUMNS = tuple(ROLLOUT_SCHEMA.names)


def _run(tmp_path) -> tuple[pa.Table, object]:
    val = random_rollouts(200, steps=4, seed=3)
    val = val.set_column(val.schema.get_field_index("split"), "split", pa.array(["val"] * 200))
    table = pa.concat_tables([random_rollouts(1200, steps=6), val])
    path = tmp_path / "rollouts.parquet"
    pq.write_table(table, path)
    return table, path


def test_h0_from_parquet_reads_its_columns_and_diagnoses_as_reading_all(tmp_path, monkeypatch):
    table, path = _run(tmp_path)
    parent = random_rollouts(200, steps=4, seed=5).select(
        ["seed", "task_id", "data_source", "sample_idx", "correct"]
    )
    read: list[list[str] | None] = []
    real = io.read_rollouts

    def spy(*args, **kwargs):
        read.append(kwargs.get("columns"))
        return real(*args, **kwargs)

    monkeypatch.setattr(diagnose_module, "read_rollouts", spy)
    for parent_scores in (None, parent):
        pruned = diagnose(path, None, H0, parent_scores)
        # Everything: the harness's queries as if one read a column it does not name.
        monkeypatch.setattr(diagnose_module, "columns_read", lambda *a: None)
        whole = diagnose(path, None, H0, parent_scores)
        monkeypatch.setattr(diagnose_module, "columns_read", columns_read)
        assert_same(pruned, whole)
        digest = pruned["evidence_digest"]
        assert_same(pruned, diagnose(table, None, H0, parent_scores, evidence_digest=digest))
    assert "prompt" not in read[0] and "response" not in read[0] and "extra" not in read[0]
    assert {"tool_calls", "turns", "reward", "task_id"} <= set(read[0])
    assert read[1] is None


@pytest.mark.parametrize(
    ("sql", "columns"),
    [
        ("SELECT step, avg(reward) AS value FROM rollouts GROUP BY ROLLUP (step)",
         {"step", "reward"}),
        ("SELECT avg(len(list_filter(tool_calls, lambda c: c.name = 'x'))) AS value "
         "FROM rollouts r JOIN groups g USING (seed, step) WHERE g.reward_sd > 0",
         {"tool_calls", "seed", "step"}),
        ("SELECT count(*) AS value FROM rollouts ORDER BY value", set()),
        ("SELECT * FROM rollouts", None),
        ("SELECT count(COLUMNS('re.*')) AS value FROM rollouts", None),
        ("SELECT count(DISTINCT to_json(rollouts)) AS value FROM rollouts", None),
        ("SELECT count(DISTINCT r) AS value FROM rollouts r", None),
        ("SELECT count(*) AS value FROM rollouts NATURAL JOIN all_rollouts", None),
        ("SELECT count(nothing_here) AS value FROM rollouts", None),
        ("not sql", None),
    ],
)
def test_query_columns_names_what_a_query_reads_or_none(sql, columns):
    got = query_columns(sql, COLUMNS)
    assert got == (None if columns is None else frozenset(columns))


def test_a_harness_query_reading_a_row_whole_makes_the_diagnosis_read_every_column(tmp_path):
    _, path = _run(tmp_path)
    whole_row = Metric(
        name="distinct_rows", layer="signal", split="train",
        sql="SELECT count(DISTINCT to_json(rollouts))::DOUBLE AS value FROM rollouts",
    )
    harness = dataclasses.replace(H0, metrics=(*H0.metrics, whole_row))
    assert columns_read(harness) is None
    assert diagnose(path, None, harness)["metrics"]["distinct_rows"] == 1400 - 200


def test_a_file_missing_an_unread_column_is_still_refused(tmp_path):
    table, path = _run(tmp_path)
    pq.write_table(table.drop_columns(["prompt"]), path)
    with pytest.raises(EvoError, match="missing column.*prompt"):
        diagnose(path, None, H0)


def test_calls_read_dictionary_encoded_analyze_as_plain_strings(tmp_path):
    # Row groups with dictionaries of their own, null and empty names and args, rows without
    # call data: every tool-call metric and the leak examples as from the plain table.
    table = random_rollouts(800, steps=4)
    calls = table.column("tool_calls").to_pylist()
    for i in range(0, len(calls), 7):
        calls[i] = None
    for i in range(3, len(calls), 11):
        if calls[i]:
            calls[i][0] = {"name": None if i % 2 else "", "args": None if i % 3 else ""}
    calls[5] = [{"name": "git", "args": "log -p"}, {"name": None, "args": None}]
    column = pa.array(calls, table.schema.field("tool_calls").type)
    table = table.set_column(table.schema.get_field_index("tool_calls"), "tool_calls", column)
    path = tmp_path / "calls.parquet"
    pq.write_table(table, path, row_group_size=150)
    encoded = io.read_rollouts(path, encoded_calls=True)
    assert encoded.schema.field("tool_calls").type == io.ENCODED_TOOL_CALLS
    from_file = diagnose(path, None, H0)
    assert_same(from_file, diagnose(table, None, H0, evidence_digest=from_file["evidence_digest"]))


def test_tool_calls_coded_in_memory_decode_to_what_they_were():
    # What a diagnosis does to an in-memory table before anything reads it: null lists,
    # null calls, null names and args, sliced and several chunks; only the slice is coded.
    plain = ROLLOUT_SCHEMA.field("tool_calls").type
    calls = pa.array(
        [None, [], [{"name": None, "args": "a"}, None, {"name": "x", "args": None}],
         [{"name": "y", "args": "b"}] * 3],
        plain,
    )
    big = random_rollouts(300, steps=3).column("tool_calls")
    for column in (pa.chunked_array([calls, calls.slice(1, 2), calls.slice(2)], plain),
                   big.slice(120, 50), big.slice(299, 1), big.slice(300, 0)):
        coded = io.encode_tool_calls(pa.table({"tool_calls": column})).column("tool_calls")
        assert coded.type == io.ENCODED_TOOL_CALLS
        assert coded.cast(plain).to_pylist() == column.to_pylist()
        # Only the calls the slice spans are coded, not its chunk's whole backing array.
        spanned = sum(c.offsets[-1].as_py() - c.offsets[0].as_py() for c in column.chunks)
        assert sum(len(c.values) for c in coded.chunks) == spanned
