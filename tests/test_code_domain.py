"""The code domain: program extraction, sandboxed judging, shaped reward, format vs wrong."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from evotrainer.domains.code import CodeDomain, extract_program, outputs_match, score_code
from evotrainer.errors import EvoError
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.sandbox.process import Limits

TESTS = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "2 2\n", "output": "4\n"},
    {"input": "-1 1\n", "output": "0\n"},
    {"input": "5 0\n", "output": "5\n"},
]
# The wall clock sits far above the CPU limit: on a loaded machine one CPU second can take
# many wall seconds, and these tests must see the CPU limit, not the deadline.
CPU_BOUND = Limits(cpu_seconds=1, wall_seconds=60)


def block(source: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{source}\n```\n"


@pytest.mark.parametrize(
    ("response", "program", "cut_off"),
    [
        (block("print(1)"), "print(1)\n", False),
        (block("print(1)", tag=""), "print(1)\n", False),
        (block("print(1)", tag="py"), "print(1)\n", False),
        (block("print(1)") + block("print(2)", tag="Python3"), "print(2)\n", False),
        (block("print(1)") + block("int main() {}", tag="cpp"), "print(1)\n", False),
        (block("int main() {}", tag="cpp"), None, False),
        ("no code at all", None, False),
        ("```python\nfor i in range(", "for i in range(", True),
    ],
)
def test_extracts_the_last_python_block(response: str, program: str | None, cut_off: bool) -> None:
    assert extract_program(response) == (program, cut_off)


def test_output_comparison_ignores_surrounding_whitespace_only() -> None:
    assert outputs_match("1 2\n3\n", "1 2   \n3\n\n")
    assert not outputs_match("1 2\n3\n", "1  2\n3\n")
    assert not outputs_match("1\n2\n", "1 2\n")


def test_correct_partial_and_wrong_programs_get_shaped_rewards() -> None:
    right, details = score_code(block("a, b = map(int, input().split())\nprint(a + b)"), TESTS)
    assert right.components == {
        "correctness": 1.0,
        "pass_fraction": 1.0,
        "format": 1.0,
        "truncated": 0.0,
        "tampered": 0.0,
    }
    assert (details["failure"], details["passed"], details["total"]) == (None, 4, 4)
    # Wrong only when b == 0... and a == b: passes two of four cases.
    partial, details = score_code(block("a, b = map(int, input().split())\nprint(a * b)"), TESTS)
    assert partial.correct == 0.0 and partial.components["pass_fraction"] == 0.25
    assert details["failure"] == "wrong_answer"
    assert [c["verdict"] for c in details["cases"]] == [
        "wrong_answer",
        "pass",
        "wrong_answer",
        "wrong_answer",
    ]


def test_format_failure_truncation_and_syntax_error_are_distinct() -> None:
    no_code, d1 = score_code("The answer is to add the numbers.", TESTS)
    cut, d2 = score_code("```python\na, b = map(int, input().split())\nprint(a +", TESTS)
    broken, d3 = score_code(block("print(1 +"), TESTS)
    assert (no_code.components["format"], d1["failure"]) == (0.0, "no_code_block")
    assert (cut.components["format"], cut.components["truncated"], d2["failure"]) == (
        1.0,
        1.0,
        "truncated",
    )
    assert (broken.components["format"], d3["failure"]) == (1.0, "syntax_error")
    # A response the engine knows ended by itself: the unclosed block is judged as code.
    ended, d4 = score_code(
        "```python\na, b = map(int, input().split())\nprint(a + b)\n", TESTS, truncated=False
    )
    assert ended.correct == 1.0 and d4["failure"] is None


def test_hostile_programs_fail_with_their_reason_and_skip_the_rest() -> None:
    looping, details = score_code(block("while True:\n    pass"), TESTS, limits=CPU_BOUND)
    assert looping.correct == 0.0 and details["failure"] == "cpu_limit"
    assert [c["verdict"] for c in details["cases"]] == ["cpu_limit"] + ["skipped"] * 3
    hog = "x = []\nwhile True:\n    x.append(bytearray(10**7))"
    # Its CPU and wall limits sit far above what it takes (0.15 s of CPU on a 2-core dev
    # machine): every page it touches is zeroed on its CPU time, and under a loaded CI
    # machine's memory pressure the kernel's reclaim is charged there too; it once reached
    # the default 2 s limit there first.
    memory_bound = Limits(memory_bytes=256 * 2**20, cpu_seconds=30, wall_seconds=120)
    _, details = score_code(block(hog), TESTS[:1], limits=memory_bound)
    assert details["failure"] == "memory_limit"
    socket_program = "import socket\nsocket.create_connection(('93.184.216.34', 80), timeout=1)"
    _, details = score_code(block(socket_program), TESTS[:1], limits=CPU_BOUND)
    assert details["failure"] == "runtime_error"
    assert "OSError" in details["cases"][0]["detail"]


def test_format_failure_is_distinguishable_from_wrong_answer_in_rollout_records() -> None:
    domain = CodeDomain()
    task = domain.task_at(0)
    responses = {
        "fmt": "I would add them.",
        "wrong": block("print(0)"),
        "cut": "```python\nprint(sum(map(int, input().split(",
        "right": block("a, b = map(int, input().split())\nprint(a + b)"),
    }
    rows = []
    for i, (label, response) in enumerate(responses.items()):
        score = domain.score(task, response, [])
        rows.append(
            {
                "task_id": task.task_id,
                "sample_idx": i,
                "response": response,
                "reward_components": list(score.components.items()),
                "correct": score.correct,
                "extra": json.dumps({"label": label}),
            }
        )
    table = pa.Table.from_pylist(rows, schema=pa.schema([ROLLOUT_SCHEMA.field(n) for n in rows[0]]))
    records = {
        json.loads(r["extra"])["label"]: dict(r["reward_components"]) for r in table.to_pylist()
    }
    assert records["fmt"]["format"] == 0.0 and records["fmt"]["truncated"] == 0.0
    assert records["wrong"]["format"] == 1.0 and records["wrong"]["correctness"] == 0.0
    assert records["cut"]["truncated"] == 1.0 and records["cut"]["format"] == 1.0
    assert records["right"]["correctness"] == 1.0


def test_sample_dataset_reference_solutions_pass_all_their_tests() -> None:
    domain = CodeDomain()
    assert domain.num_tasks() >= 12
    ids = [domain.task_at(i).task_id for i in range(domain.num_tasks())]
    assert len(set(ids)) == len(ids) and ids[0] == "code:c01"
    for i in range(domain.num_tasks()):
        task = domain.task_at(i)
        ((text, _),) = domain.demonstration(task, random.Random(0))
        assert domain.score(task, text, []).correct == 1.0, task.task_id


def test_params_are_validated() -> None:
    for params, field in [
        ({"executor": "podman"}, "domain.params.executor"),
        ({"cpu_seconds": 0}, "domain.params.cpu_seconds"),
        ({"prompt_template": "no slot"}, "domain.params.prompt_template"),
    ]:
        with pytest.raises(EvoError) as err:
            CodeDomain(params)
        assert err.value.field == field
    assert CodeDomain({"memory_mb": 128}).limits.memory_bytes == 128 * 2**20


def test_bad_tests_in_a_row_name_the_row(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the job's working directory: its data root
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"problem": "p", "tests": [{"input": "1"}]}) + "\n")
    with pytest.raises(EvoError) as err:
        CodeDomain(data={"train": str(path)}).num_tasks()
    assert err.value.where == f"{path}:row 1" and "bad tests" in err.value.message


def test_domain_takes_the_callers_truncation_and_reports_details() -> None:
    domain = CodeDomain()
    task = domain.task_at(0)
    cut = domain.score(task, "First I will read the input and", [], truncated=True)
    assert (cut.components["format"], cut.components["truncated"]) == (1.0, 1.0)
    _, details = domain.judge(task, block("print(0)"))
    assert details["failure"] == "wrong_answer" and details["total"] == len(details["cases"])


def test_scores_through_the_verl_reward_module(tmp_path) -> None:
    from evotrainer.backends.verl_reward import compute_score

    config = tmp_path / "reward.json"
    config.write_text(
        json.dumps(
            {
                "domain": {"name": "code", "params": {}},
                "reward": {"components": [{"name": "pass_fraction", "weight": 1.0}]},
            }
        )
    )
    task = CodeDomain().task_at(0)
    info = {"task_id": task.task_id, "meta": json.dumps(task.meta), "index": 0}
    response = block("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)")
    result = compute_score(task.data_source, response, task.answer, info, config_path=str(config))
    assert (result["score"], result["acc"]) == (0.5, 0.0)
    assert result["task_id"] == "code:c01"
