import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from evotrainer.commands import ingest as ingest_cmd
from evotrainer.evidence.io import read_rollouts
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.evidence.verl import ingest_dump, read_metrics_log


def _write(path: Path, records: list, tail: str = "") -> None:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n" + tail)


def _v1_rows(step: int) -> list[dict]:
    rows = []
    for g, uid in enumerate(["aaaa1111", "bbbb2222"]):
        for s in range(3):
            rows.append(
                {
                    "input": f"prompt {g}",
                    "output": "x" * s,
                    "gts": "42",
                    "score": float(s == 1),
                    "step": step,
                    "uid": f"{uid}_{s}_0",
                }
            )
    return rows


def test_v1_dump_groups_by_uid_and_keeps_base_columns(tmp_path):
    _write(tmp_path / "1.jsonl", _v1_rows(1))
    _write(tmp_path / "2.jsonl", _v1_rows(2))
    result = ingest_dump(tmp_path, version="v1", split="train")
    table = result.rollouts
    assert table.schema == ROLLOUT_SCHEMA
    assert table.num_rows == 12 and not result.skipped and result.files == 2
    rows = table.to_pylist()
    assert {r["group_id"] for r in rows} == {"aaaa1111", "bbbb2222"}
    assert [r["sample_idx"] for r in rows[:3]] == [0, 1, 2]
    assert [r["reward"] for r in rows[:3]] == [0.0, 1.0, 0.0]
    assert rows[0]["prompt"] == "prompt 0" and rows[1]["response"] == "x"
    assert json.loads(rows[0]["extra"]) == {"gts": "42", "uid": "aaaa1111_0_0"}
    assert rows[0]["correct"] is None and rows[0]["turns"] is None
    assert {r["step"] for r in rows} == {1, 2}
    assert rows[0]["task_id"] == rows[1]["task_id"] != rows[3]["task_id"]


def test_legacy_dump_groups_identical_inputs_and_maps_known_keys(tmp_path):
    rows = []
    for i, prompt in enumerate(["a", "b", "a", "b"]):
        rows.append(
            {
                "input": prompt,
                "output": "o",
                "gts": "g",
                "score": 0.5 * i,
                "step": 3,
                "acc": i % 2 == 0,
                "num_turns": 4 + i,
                "response_length": 10 * i,
                "truncated": i == 3,
                "finish_reason": "length" if i == 3 else "stop",
                "tool_calls": [{"name": "bash", "args": {"cmd": "ls"}}]
                if i < 2
                else ["git log -3"],
                "format_reward": 0.25,
                "judge_note": "fine",
                "data_source": "gsm8k",
            }
        )
    _write(tmp_path / "3.jsonl", rows)
    table = ingest_dump(tmp_path, version="v0", split="val").rollouts
    out = table.to_pylist()
    assert out[0]["group_id"] == out[2]["group_id"] != out[1]["group_id"]
    assert [r["sample_idx"] for r in out] == [0, 0, 1, 1]
    assert [r["correct"] for r in out] == [1.0, 0.0, 1.0, 0.0]
    assert [r["turns"] for r in out] == [4, 5, 6, 7]
    assert [r["response_tokens"] for r in out] == [0, 10, 20, 30]
    assert [r["truncated"] for r in out] == [False, False, False, True]
    assert out[3]["finish_reason"] == "length" and out[3]["split"] == "val"
    assert out[0]["tool_calls"] == [{"name": "bash", "args": '{"cmd": "ls"}'}]
    assert out[2]["tool_calls"] == [{"name": "git", "args": "log -3"}]
    assert dict(out[0]["reward_components"]) == {"format_reward": 0.25}
    assert json.loads(out[0]["extra"]) == {"gts": "g", "judge_note": "fine"}
    assert out[0]["data_source"] == "gsm8k"


def test_corrupt_and_cut_off_lines_are_counted_not_fatal(tmp_path):
    rows = _v1_rows(1)
    records = [rows[0], "{not json", rows[1], "[1, 2]", rows[2]]
    _write(tmp_path / "1.jsonl", records, tail='{"input": "cut')
    result = ingest_dump(tmp_path, version="v1", split="train")
    assert result.rollouts.num_rows == 3
    assert [(Path(s.file).name, s.line) for s in result.skipped] == [
        ("1.jsonl", 2),
        ("1.jsonl", 4),
        ("1.jsonl", 6),
    ]
    assert "1.jsonl:2" in result.skipped_summary()


def test_types_that_change_between_lines_fall_back_per_line(tmp_path):
    rows = _v1_rows(1)[:2]
    rows[0]["acc"], rows[1]["acc"] = 1, 0.5
    rows[0]["meta"], rows[1]["meta"] = 3, "text"
    _write(tmp_path / "1.jsonl", rows)
    out = ingest_dump(tmp_path, version="v1", split="train").rollouts.to_pylist()
    assert [r["correct"] for r in out] == [1.0, 0.5]
    assert json.loads(out[1]["extra"])["meta"] == "text"


def test_metrics_log_to_long_steps(tmp_path):
    log = tmp_path / "metrics.jsonl"
    _write(
        log,
        [
            {"step": 1, "data": {"actor/entropy": 0.5, "critic/score/mean": 1, "note": "x"}},
            "garbage",
            {"step": 2, "data": {"actor/entropy": 0.4}},
        ],
    )
    steps, skipped = read_metrics_log(log, version="v1")
    assert steps.num_rows == 3 and len(skipped) == 1 and skipped[0].line == 2
    assert steps.column("metric").to_pylist() == [
        "actor/entropy",
        "critic/score/mean",
        "actor/entropy",
    ]


def test_read_rollouts_accepts_a_verl_dump_and_warns(tmp_path):
    _write(tmp_path / "1.jsonl", _v1_rows(1), tail="{")
    with pytest.warns(UserWarning, match="skipped 1"):
        table = read_rollouts(tmp_path, split="val", version="v9")
    assert table.num_rows == 6 and set(table.column("split").to_pylist()) == {"val"}


def test_ingest_cli_writes_parquet_and_reports_skips(tmp_path, monkeypatch):
    dump = tmp_path / "dump"
    dump.mkdir()
    _write(dump / "1.jsonl", _v1_rows(1), tail="{broken")
    log = tmp_path / "m.jsonl"
    _write(log, [{"step": 1, "data": {"actor/entropy": 0.5}}])
    monkeypatch.chdir(tmp_path)
    app = typer.Typer()
    ingest_cmd.register(app)
    result = CliRunner().invoke(
        app,
        [
            "ingest",
            "verl",
            str(dump),
            "--version",
            "v1",
            "--split",
            "train",
            "--metrics",
            str(log),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["rows"] == 6 and len(summary["skipped"]) == 1
    assert pq.read_table(tmp_path / "rollouts" / "train.parquet").num_rows == 6
    assert pq.read_table(tmp_path / "steps.parquet").num_rows == 1


def test_files_mapped_together_keep_their_own_steps_groups_and_sample_numbers(tmp_path):
    # Files with one raw schema are mapped in one query; nothing may leak between them.
    for step in (1, 2, 10):
        rows = [
            {"input": p, "output": f"{step}-{i}", "score": 1.0, "uid": uid}
            for i, (p, uid) in enumerate(
                [("a", "g1_0_0"), ("a", "nouid"), ("b", None), ("a", "nouid"), ("b", "x_y")]
            )
        ]
        _write(tmp_path / f"{step}.jsonl", rows)
    _write(tmp_path / "3.jsonl", [{"input": "a", "output": "3-0", "score": 0.5}])  # no uid
    out = ingest_dump(tmp_path, version="v", split="train").rollouts.to_pylist()
    assert [r["response"] for r in out] == [
        f"{s}-{i}" for s in (1, 2, 3, 10) for i in range(5 if s != 3 else 1)
    ]
    assert [r["step"] for r in out] == [1] * 5 + [2] * 5 + [3] + [10] * 5
    per_file = [r for r in out if r["step"] == 10]
    # uid "g1_0_0" is a V1 key: group g1, sample (session) 0. A uid that is not a V1 key is
    # the group itself, a null uid without a group size groups by prompt text; the sample is
    # the row's rank in its group within its file.
    assert [r["sample_idx"] for r in per_file] == [0, 0, 0, 1, 0]
    assert [r["group_id"] for r in per_file] == [
        "g1",
        "nouid",
        per_file[2]["group_id"],
        "nouid",
        "x_y",
    ]
    assert per_file[2]["group_id"] == per_file[2]["task_id"][1:]
    assert [r["sample_idx"] for r in out if r["step"] == 1] == [0, 0, 0, 1, 0]
    assert out[10]["sample_idx"] == 0 and out[10]["task_id"] == out[0]["task_id"]


def test_legacy_rows_survive_a_batch_whose_v1_keys_have_later_outputs(tmp_path):
    # One file mixes a V1 session with two outputs (its final one kept, the earlier folded)
    # and legacy rows without a V1 key: the legacy rows are each their own final row.
    rows = [
        {"input": "a", "output": "draft", "score": 0.0, "uid": "g1_0_0"},
        {"input": "a", "output": "final", "score": 1.0, "uid": "g1_0_1"},
        {"input": "b", "output": "legacy 1", "score": 1.0, "uid": "plain"},
        {"input": "b", "output": "legacy 2", "score": 0.0},
    ]
    _write(tmp_path / "1.jsonl", rows)
    out = ingest_dump(tmp_path, version="v", split="train").rollouts.to_pylist()
    assert [r["response"] for r in out] == ["final", "legacy 1", "legacy 2"]
    assert json.loads(out[0]["extra"])["earlier_outputs"] == ["draft"]


def test_an_output_index_written_with_leading_zeros_is_the_first_output(tmp_path):
    # `_000` is output 0: no session here has a later output, so no row is folded.
    rows = [
        {"input": "a", "output": f"out {s}", "score": 1.0, "uid": f"g1_{s}_000"}
        for s in range(2)
    ] + [{"input": "b", "output": "legacy", "score": 0.0}]
    _write(tmp_path / "1.jsonl", rows)
    result = ingest_dump(tmp_path, version="v", split="train")
    assert [r["response"] for r in result.rollouts.to_pylist()] == ["out 0", "out 1", "legacy"]
    assert result.earlier_outputs == 0


def test_validation_blocks_of_chat_prompts_are_checked_as_text_prompts_are(tmp_path):
    # Prompts that are JSON lists (chat messages) rather than text: n = 2 consecutive rows
    # each hold one prompt, so they are the groups, and a prompt a file holds in two blocks
    # is numbered as a task of its own.
    a, b = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    rows = [{"input": p, "output": f"o{i}", "score": 1.0} for i, p in enumerate([a, a, b, b, a, a])]
    _write(tmp_path / "1.jsonl", rows)
    result = ingest_dump(tmp_path, version="v", split="val", group_size=2)
    assert any("group = 2 consecutive rows" in d for d in result.derived)
    out = result.rollouts.to_pylist()
    assert len({r["group_id"] for r in out}) == 3
    assert [r["sample_idx"] for r in out] == [0, 1] * 3
    assert out[4]["task_id"] == out[0]["task_id"] + ".1" != out[2]["task_id"]
    # A block holding two prompts: not verl's validation order, so prompt text groups them.
    mixed = [a, b, b, a, a, b]
    _write(tmp_path / "1.jsonl", [{**r, "input": p} for r, p in zip(rows, mixed, strict=True)])
    result = ingest_dump(tmp_path, version="v", split="val", group_size=2)
    assert any("blocks of 2 consecutive rows mix prompts" in d for d in result.derived)
    assert len({r["group_id"] for r in result.rollouts.to_pylist()}) == 2


def test_validation_blocks_are_counted_among_legacy_rows_beside_v1_rows(tmp_path):
    # V1 rows between the legacy rows without a key do not shift the legacy rows' blocks.
    rows = [
        {"input": "a", "output": "a0", "score": 1.0, "uid": None},
        {"input": "v", "output": "v0", "score": 1.0, "uid": "g_0_0"},
        {"input": "a", "output": "a1", "score": 0.0, "uid": None},
        {"input": "b", "output": "b0", "score": 1.0, "uid": None},
        {"input": "v", "output": "v1", "score": 0.0, "uid": "g_1_0"},
        {"input": "b", "output": "b1", "score": 0.0, "uid": None},
    ]
    _write(tmp_path / "1.jsonl", rows)
    result = ingest_dump(tmp_path, version="v", split="val", group_size=2)
    assert not result.ambiguous
    groups = {r["response"]: (r["group_id"], r["sample_idx"]) for r in result.rollouts.to_pylist()}
    assert groups["v0"] == ("g", 0) and groups["v1"] == ("g", 1)
    assert groups["a0"][0] == groups["a1"][0] != groups["b0"][0] == groups["b1"][0]
    assert [groups[k][1] for k in ("a0", "a1", "b0", "b1")] == [0, 1, 0, 1]
