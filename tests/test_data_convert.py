"""Dataset converters on tiny samples written in each source format
(tests/data/paper_formats): the rows they give, that the math and code domains load them,
and that each code sample's reference solution passes its converted tests in the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evotrainer.cli import app
from evotrainer.domains import make_domain
from evotrainer.domains.code import score_code
from evotrainer.domains.data.convert import convert_file, write_rows
from evotrainer.errors import EvoError

SAMPLES = Path(__file__).parent / "data" / "paper_formats"


def test_aime_and_cnmo_rows_become_math_rows_with_their_benchmark_as_stratum():
    aime = convert_file("aime", SAMPLES / "aime24.jsonl")
    assert aime.domain == "math" and not aime.skipped
    assert aime.rows[0] == {
        "problem": "Find the remainder when $2^{10}$ is divided by $1000$.",
        "answer": "24",  # a number in the source: text here
        "data_source": "aime24",
        "id": "2024-I-1",
        "solution": "$2^{10} = 1024$, so the remainder is $\\boxed{24}$.",
    }
    assert aime.rows[1]["answer"] == "024" and "solution" not in aime.rows[2]
    cnmo = convert_file("aime", SAMPLES / "cnmo24.jsonl", data_source="cnmo24")
    assert [r["answer"] for r in cnmo.rows] == ["\\sqrt{2}", "55"]
    assert {r["data_source"] for r in cnmo.rows} == {"cnmo24"}


def test_code_formats_keep_stdin_tests_and_skip_call_based_rows():
    taco = convert_file("taco", SAMPLES / "taco.jsonl")
    assert taco.domain == "code"
    assert taco.skipped == {"call-based tests (fn_name), not stdin/stdout": 1}
    assert taco.rows[0]["tests"] == [{"input": "3\n", "output": "9\n"},
                                     {"input": "-4\n", "output": "16\n"}]
    # APPS/TACO lists of lines become text, one line each.
    assert taco.rows[1]["tests"][0] == {"input": "a b c\n", "output": "c b a\n"}
    assert [r["data_source"] for r in taco.rows] == ["taco/easy", "taco/medium"]
    lcb = convert_file("livecodebench", SAMPLES / "livecodebench.jsonl", data_source="lcb")
    assert [r["id"] for r in lcb.rows] == ["abc300_a", "abc301_b"]
    assert [r["data_source"] for r in lcb.rows] == ["lcb/atcoder/easy", "lcb/atcoder/medium"]
    assert lcb.rows[0]["tests"] == [{"input": "1 2\n", "output": "3\n"},
                                    {"input": "10 -3\n", "output": "7\n"}]  # public + private
    # The compressed private tests are never unpickled: the public ones stay, and it is said.
    assert lcb.rows[1]["tests"] == [{"input": "3 9 2\n", "output": "9\n"}]
    assert lcb.notes == {"private tests compressed as a pickle, not read: public tests only": 1}
    assert lcb.skipped == {"functional (call-based) tests, not stdin/stdout": 1}
    contests = convert_file("code_contests", SAMPLES / "code_contests.jsonl")
    assert [len(r["tests"]) for r in contests.rows] == [3, 1]
    assert [r["difficulty"] for r in contests.rows] == ["a", "b"]  # Codeforces' letters
    assert contests.rows[0]["solution"] == "print(2 * int(input()))"  # the PYTHON3 one
    assert "solution" not in contests.rows[1]


# Reference programs of the sample rows that ship none.
PROGRAMS = {
    "abc300_a": "print(sum(map(int, input().split())))",
    "abc301_b": "print(max(map(int, input().split())))",
    "1_B. Echo": "print(input())",
}


@pytest.mark.parametrize("fmt", ["taco", "livecodebench", "code_contests"])
def test_converted_code_tests_pass_the_reference_solution_in_the_sandbox(fmt):
    for row in convert_file(fmt, SAMPLES / f"{fmt}.jsonl").rows:
        program = row.get("solution") or PROGRAMS[row["id"]]
        score, details = score_code(f"```python\n{program}\n```", json.dumps(row["tests"]))
        assert score.correct == 1.0, details
        wrong, _ = score_code("```python\nprint(0)\n```", json.dumps(row["tests"]))
        assert wrong.correct == 0.0


def test_converted_files_load_as_the_domains_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data paths resolve inside the working directory
    write_rows(convert_file("aime", SAMPLES / "aime24.jsonl").rows, Path("data/train.jsonl"))
    write_rows(convert_file("aime", SAMPLES / "cnmo24.jsonl").rows, Path("data/val.jsonl"))
    math = make_domain({"name": "math", "data": {"train": "data/train.jsonl",
                                                 "val": "data/val.jsonl"}})
    train, val = math.split(3, 2)
    assert {t.data_source for t in val} == {"cnmo24"}
    assert sorted(t.task_id for t in train) == ["math:2024-I-1", "math:2024-I-2", "math:2024-II-3"]
    write_rows(convert_file("taco", SAMPLES / "taco.jsonl").rows, Path("data/code.jsonl"))
    code = make_domain({"name": "code", "data": {"train": "data/code.jsonl"}})
    assert code.num_tasks() == 2


def test_a_malformed_row_stops_the_conversion_at_its_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "input_output": "{not json"}) + "\n")
    with pytest.raises(EvoError) as err:
        convert_file("taco", bad)
    assert err.value.where == f"{bad}:row 1" and "input_output is not JSON" in err.value.message
    twice = tmp_path / "twice.jsonl"
    twice.write_text(json.dumps({"id": 1, "problem": "p", "answer": "1"}) + "\n"
                     + json.dumps({"id": 1, "problem": "q", "answer": "2"}) + "\n")
    with pytest.raises(EvoError) as err:
        convert_file("aime", twice)
    assert err.value.where == f"{twice}:row 2" and "repeats row 1" in err.value.message


def test_the_cli_writes_the_rows_and_says_what_it_skipped(tmp_path):
    out = tmp_path / "lcb.jsonl"
    result = CliRunner().invoke(app, ["data", "convert", "livecodebench",
                                      str(SAMPLES / "livecodebench.jsonl"), str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["rows"] == 2 and summary["skipped"] == {
        "functional (call-based) tests, not stdin/stdout": 1}
    assert summary["data_sources"] == {"livecodebench/atcoder/easy": 1,
                                       "livecodebench/atcoder/medium": 1}
    assert len(out.read_text().splitlines()) == 2


DEEP = "[" * 100_000


@pytest.mark.parametrize(("fmt", "line"), [
    ("aime", DEEP),
    ("taco", json.dumps({"question": "q", "input_output": DEEP})),
])
def test_json_nested_past_the_stack_is_one_error_line(cli, tmp_path, fmt, line):
    """A line (or a JSON-text field) of `[` nested 100,000 deep: the decoder would recurse
    past the interpreter's stack; the user gets one line naming the file and row."""
    src = tmp_path / "deep.jsonl"
    src.write_text(line + "\n")
    result = cli("data", "convert", fmt, str(src), str(tmp_path / "out.jsonl"))
    assert result.code == 1 and "Traceback" not in result.err + result.out
    lines = result.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nested too deeply" in lines[0]
    assert str(src) in lines[0]
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("repo", ["../outside", "./outside", "owner/..", "/abs/outside",
                                  "owner\\..\\x/name", "owner/name/extra", "owner/."])
def test_swe_rebench_repo_must_be_owner_and_name(cli, tmp_path, repo):
    """`repo: "../outside"` would name `mirrors/../outside`, a folder outside --repos, as the
    mirror; every such name is refused at its row, even when that folder exists."""
    from evotrainer.domains.data import sample_path

    raw = json.loads(sample_path("swe_rebench_sample.jsonl").read_text().splitlines()[0])
    mirrors, outside = tmp_path / "mirrors", tmp_path / "outside"
    mirrors.mkdir()
    (mirrors / "owner").mkdir()
    bundle = sample_path("swe_rebench_repos") / "tinystats__tinystats.bundle"
    for where in (outside, mirrors / "owner" / "name", mirrors / "owner" / "."):
        where.mkdir(exist_ok=True)
        (where / "repo.bundle").write_bytes(bundle.read_bytes())
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({**raw, "repo": repo}) + "\n")
    with pytest.raises(EvoError) as err:
        convert_file("swe_rebench", src, repos=mirrors)
    assert err.value.where == f"{src}:row 1" and "is not owner/name" in err.value.message
    result = cli("data", "convert", "swe_rebench", str(src), str(tmp_path / "out.jsonl"),
                 "--repos", str(mirrors))
    lines = result.err.splitlines()
    assert result.code == 1 and len(lines) == 1 and "is not owner/name" in lines[0]
    assert "Traceback" not in result.err
