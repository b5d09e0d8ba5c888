"""Dump lines the fast parser (orjson) refuses or that Arrow cannot type as they come: each is
ingested with its values, or skipped and reported by file and line, never a crash."""

import json
import math
from pathlib import Path

from evotrainer.evidence.verl import ingest_dump, parse_jsonl, read_new


def _line(**keys: object) -> str:
    """One dump line as verl writes it (Python's json.dumps: NaN for a nan score)."""
    return json.dumps({"input": "p", "output": "o", "score": 1.0, "step": 1, **keys})


def _ingest(tmp_path: Path, lines: list[str], *, name: str = "1.jsonl"):
    (tmp_path / name).write_bytes(("\n".join(lines) + "\n").encode())
    return ingest_dump(tmp_path, version="v", split="val")


def test_nan_and_infinity_lines_are_read_as_json_loads_reads_them(tmp_path):
    lines = [_line(), _line(score=math.nan, acc=math.inf, f1=math.nan), _line(f1=0.5)]
    assert "NaN" in lines[1] and "Infinity" in lines[1]
    result = _ingest(tmp_path, lines)
    rows = result.rollouts.to_pylist()
    assert not result.skipped and len(rows) == 3
    assert rows[0]["reward"] == 1.0 and math.isnan(rows[1]["reward"])
    assert rows[1]["correct"] == math.inf
    assert math.isnan(dict(rows[1]["reward_components"])["f1"])
    assert rows[2]["reward_components"] == [("f1", 0.5)]
    assert rows[0]["reward_components"] == []


def test_a_lone_surrogate_escape_is_kept_as_the_replacement_character(tmp_path):
    lines = [_line(output="x\ud800y", note={"k\udc00": ["\ud800"]}), _line(note={"k": ["ok"]})]
    assert "\\ud800" in lines[0]  # json.dumps escapes it: valid JSON text, invalid Unicode
    result = _ingest(tmp_path, lines)
    rows = result.rollouts.to_pylist()
    assert not result.skipped
    assert rows[0]["response"] == "x\ufffdy"
    # One struct column across lines: each line's object holds every key seen (null if absent).
    assert json.loads(rows[0]["extra"]) == {"note": {"k\ufffd": ["\ufffd"], "k": None}}
    assert json.loads(rows[1]["extra"]) == {"note": {"k\ufffd": None, "k": ["ok"]}}


def test_an_emoji_written_as_a_surrogate_pair_stays_whole(tmp_path):
    rows = _ingest(tmp_path, [_line(output="\U0001f600")]).rollouts.to_pylist()
    assert rows[0]["response"] == "\U0001f600"


def test_integers_beyond_64_bits_are_doubles_and_beyond_any_double_exact_text(tmp_path):
    lines = [
        _line(big=2**70, u64=2**64 - 1, huge=10**400),
        _line(big=2, u64=1, huge=1),
        # The same on a line only json.loads reads (NaN): the same values.
        _line(big=2**70, u64=2**64 - 1, huge=10**400, acc=math.nan),
    ]
    result = _ingest(tmp_path, lines)
    rows = result.rollouts.to_pylist()
    assert not result.skipped
    components = [dict(r["reward_components"]) for r in rows]
    assert components[0] == {"big": float(2**70), "u64": float(2**64 - 1)}
    assert components[1] == {"big": 2.0, "u64": 1.0}
    assert components[2] == components[0]
    assert [json.loads(r["extra"])["huge"] for r in rows] == [str(10**400), "1", str(10**400)]


def test_a_corrupt_line_in_the_middle_is_skipped_and_reported_with_its_line(tmp_path):
    lines = [_line(k=1), '{"input": "p", "outp', _line(k=2), _line(k=3)]
    result = _ingest(tmp_path, lines, name="7.jsonl")
    rows = result.rollouts.to_pylist()
    assert [dict(r["reward_components"])["k"] for r in rows] == [1.0, 2.0, 3.0]
    assert [(Path(s.file).name, s.line) for s in result.skipped] == [("7.jsonl", 2)]
    assert result.skipped[0].reason.startswith("Unterminated string")
    assert "7.jsonl:2" in result.skipped_summary()


def test_a_corrupt_line_read_live_is_numbered_from_the_start_of_its_file(tmp_path):
    dump = tmp_path / "3.jsonl"
    dump.write_text(_line(k=1) + "\n" + _line(k=2) + "\n")
    first, offsets = read_new(tmp_path, None, version="v", split="val")
    with dump.open("a") as handle:
        handle.write("{oops\n" + _line(k=3) + "\n")
    later, _ = read_new(tmp_path, offsets, version="v", split="val")
    assert first.rollouts.num_rows == 2 and not first.skipped
    assert [dict(r["reward_components"])["k"] for r in later.rollouts.to_pylist()] == [3.0]
    assert [(Path(s.file).name, s.line) for s in later.skipped] == [("3.jsonl", 3)]


def test_a_key_whose_type_changes_is_json_text_and_int_then_float_a_double(tmp_path):
    lines = [
        _line(meta=1, mix=True, ratio=1),
        _line(meta="x", mix=1, ratio=2.5),
        _line(meta=[1, "a"], mix=None, ratio=None),
        _line(meta={"a": 1}),
    ]
    rows = _ingest(tmp_path, lines).rollouts.to_pylist()
    extras = [json.loads(r["extra"]) for r in rows]
    assert [e.get("meta") for e in extras] == ["1", "x", '[1, "a"]', '{"a": 1}']
    assert [e.get("mix") for e in extras] == ["true", "1", None, None]  # a bool is not a number
    assert [dict(r["reward_components"]).get("ratio") for r in rows] == [1.0, 2.5, None, None]


def test_a_key_first_seen_after_the_first_line_is_kept(tmp_path):
    rows = _ingest(tmp_path, [_line(), _line(late=2.5), _line(note="n")]).rollouts.to_pylist()
    assert [r["reward_components"] for r in rows] == [[], [("late", 2.5)], []]
    assert [json.loads(r["extra"]) for r in rows] == [{"note": None}, {"note": None}, {"note": "n"}]


def test_an_empty_file_and_a_file_of_blank_lines_give_no_rows_and_no_skips(tmp_path):
    (tmp_path / "1.jsonl").write_bytes(b"")
    (tmp_path / "2.jsonl").write_bytes(b"\n  \n\r\n\xc2\xa0\n")  # blank, spaces, CR, NBSP
    (tmp_path / "3.jsonl").write_text(_line(step=3) + "\n")
    result = ingest_dump(tmp_path, version="v", split="val")
    assert result.files == 3 and not result.skipped
    assert result.rollouts.column("step").to_pylist() == [3]
    table, skipped = parse_jsonl(b"", "x.jsonl")
    assert table.num_rows == 0 and table.num_columns == 0 and skipped == []


def test_a_line_that_is_not_an_object_is_skipped_as_such(tmp_path):
    lines = [_line(k=1), "[1, 2]", '"text"', "null", _line(k=2)]
    result = _ingest(tmp_path, lines)
    assert [dict(r["reward_components"])["k"] for r in result.rollouts.to_pylist()] == [1.0, 2.0]
    assert [(s.line, s.reason) for s in result.skipped] == [
        (2, "not a JSON object"),
        (3, "not a JSON object"),
        (4, "not a JSON object"),
    ]


def test_a_line_nested_deeper_than_the_parsers_go_is_skipped_as_such(tmp_path):
    deep = '{"input": "p", "output": "o", "deep": ' + "[" * 5000 + "]" * 5000 + "}"
    result = _ingest(tmp_path, [_line(k=1), deep, _line(k=2)])
    assert [dict(r["reward_components"])["k"] for r in result.rollouts.to_pylist()] == [1.0, 2.0]
    assert [(s.line, s.reason) for s in result.skipped] == [(2, "nested too deeply")]


def test_bytes_that_are_not_utf8_are_read_as_the_replacement_character(tmp_path):
    (tmp_path / "1.jsonl").write_bytes(
        _line(note="a#b").replace("#", "\udcff").encode("utf-8", "surrogateescape") + b"\n"
    )
    rows = ingest_dump(tmp_path, version="v", split="val").rollouts.to_pylist()
    assert json.loads(rows[0]["extra"]) == {"note": "a\ufffdb"}


def test_lines_break_at_newline_only_and_text_that_looks_like_a_date_stays_text():
    data = (_line(output="a\u2028b", task_id="2024-01-02") + "\r\n" + _line()).encode()
    table, skipped = parse_jsonl(data, "x.jsonl", first_line=5)
    assert skipped == [] and table.num_rows == 2
    assert table.column("output").to_pylist() == ["a\u2028b", "o"]
    assert table.column("task_id").to_pylist() == ["2024-01-02", None]
