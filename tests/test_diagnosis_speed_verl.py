"""verl ingest keeps its answers where it got cheaper: a V1 key is read without its costly
leading pattern, and prompt / response are taken by row in Arrow rather than copied through
DuckDB (a column of another JSON type is still cast to text by DuckDB)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from evotrainer.evidence.verl import ingest_dump

# Keys of every shape near the V1 one: {prompt_uid}_{session}_{index}.
UIDS = [
    "p1_0_0", "a_b_2_0", "_1_2", "x_1_2_", "a\nb_1_2", "g_\u0661_2", "e\u0301x_3_0", "ab_01_0",
    "plain", "x_1_2\n",
]


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_v1_keys_group_and_number_rows_as_the_key_pattern_says(tmp_path: Path):
    _write(tmp_path / "1.jsonl", [
        {"input": f"prompt {k}", "output": f"out {k}", "score": 1.0, "uid": uid}
        for k, uid in enumerate(UIDS)
    ])
    rows = ingest_dump(tmp_path, version="v", split="val").rollouts.to_pylist()
    assert [json.loads(r["extra"])["uid"] for r in rows] == UIDS
    for row, uid in zip(rows, UIDS, strict=True):
        # verl's own key: a non-empty prompt uid (no newline in it), then two ASCII numbers.
        key = re.fullmatch(r"([^\n]+)_([0-9]+)_([0-9]+)", uid)
        if key:
            assert (row["group_id"], row["sample_idx"]) == (key[1], int(key[2])), uid
        else:
            assert (row["group_id"], row["sample_idx"]) == (uid, 0), uid
        assert (row["prompt"], row["response"]) == (f"prompt {UIDS.index(uid)}",
                                                    f"out {UIDS.index(uid)}")


def test_prompt_and_response_of_kept_rows_and_of_other_json_types(tmp_path: Path):
    # A multi-output session keeps its final output: the texts are those of the kept rows.
    _write(tmp_path / "1.jsonl", [
        {"input": "q", "output": f"try {i}", "score": 1.0, "uid": f"p_0_{i}"} for i in range(3)
    ] + [{"input": "r", "output": "only", "score": 0.0, "uid": "p_1_0"}])
    # Numbers and lists are no text: DuckDB writes them as text, as before.
    _write(tmp_path / "2.jsonl", [
        {"input": 10 * k, "output": [k, 1], "score": 0.0, "uid": f"n_{k}_0"} for k in range(2)
    ])
    rows = ingest_dump(tmp_path, version="v", split="val").rollouts.to_pylist()
    assert [(r["prompt"], r["response"]) for r in rows] == [
        ("q", "try 2"), ("r", "only"), ("0", "[0, 1]"), ("10", "[1, 1]"),
    ]
    assert json.loads(rows[0]["extra"])["earlier_outputs"] == ["try 0", "try 1"]
