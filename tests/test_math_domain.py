"""The math domain: answer extraction, verifier edge cases, datasets, truncation vs format."""

from __future__ import annotations

import json
import random

import pytest

from evotrainer.domains.math import MathDomain, answers_match, extract_answer, score_math
from evotrainer.errors import EvoError


@pytest.mark.parametrize(
    ("response", "answer", "form"),
    [
        ("so the total is $\\boxed{56}$.", "56", "boxed"),
        ("first \\boxed{3}, corrected: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "boxed"),
        ("nested \\boxed{\\sqrt{\\frac{a}{b}}} end", "\\sqrt{\\frac{a}{b}}", "boxed"),
        ("\\fbox{7}", "7", "boxed"),
        ("work...\nTherefore, the answer is 5.", "5", "final_line"),
        ("work...\n**Final Answer:** $\\frac{1}{2}$", "\\frac{1}{2}", "final_line"),
        ("work...\n#### 42", "42", "final_line"),
    ],
)
def test_extracts_boxed_and_final_line_answers(response: str, answer: str, form: str) -> None:
    assert extract_answer(response) == (answer, form, False)


def test_no_answer_and_cut_off_answer_are_told_apart() -> None:
    assert extract_answer("I believe it is five") == (None, "", False)
    assert extract_answer("so we get \\boxed{\\frac{1}{") == (None, "", True)


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        ("0.5", "\\frac{1}{2}"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
        ("(x+1)^2", "x^2+2x+1"),
        ("12 \\text{ cm}", "12"),  # units
        ("25", "25\\%"),  # percent sign
        ("90^\\circ", "90"),  # degrees
        ("1{,}000", "1000"),
        ("[1, 2)", "[1,2)"),  # intervals
        ("\\{3, -3\\}", "-3, 3"),  # sets in any order
        ("x = 6", "6"),
        ("\\text{(B)}", "B"),
    ],
)
def test_equivalent_forms_match(predicted: str, reference: str) -> None:
    assert answers_match(predicted, reference)


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        ("(1, 2]", "[1,2)"),  # open/closed ends matter
        ("\\frac{1}{3}", "\\frac{1}{2}"),
        ("\\frac{1}{", "\\frac{1}{2}"),  # malformed LaTeX: no crash, no match
        ("}{)(", "5"),
        ("C", "B"),
    ],
)
def test_different_or_malformed_answers_do_not_match(predicted: str, reference: str) -> None:
    assert not answers_match(predicted, reference)


def test_score_separates_correct_wrong_format_and_truncated() -> None:
    right, details = score_math("so $\\boxed{13}$", "13")
    assert (right.correct, right.components, details["failure"]) == (
        1.0,
        {"correctness": 1.0, "format": 1.0, "truncated": 0.0},
        None,
    )
    wrong, details = score_math("so $\\boxed{12}$", "13")
    assert (wrong.components["format"], details["failure"]) == (1.0, "wrong_answer")
    unformatted, details = score_math("it is thirteen", "13")
    assert (unformatted.components["format"], details["failure"]) == (0.0, "no_answer")
    cut, details = score_math("so the answer is \\boxed{1", "13")
    assert (cut.components, details["failure"]) == (
        {"correctness": 0.0, "format": 1.0, "truncated": 1.0},
        "truncated",
    )
    # The engine knows the finish reason: a length stop is truncation even with an answer.
    _, details = score_math("\\boxed{13} and then more", "13", truncated=True)
    assert details["failure"] == "truncated"


def test_sample_dataset_tasks_are_stable_and_demonstrations_score_correct() -> None:
    domain = MathDomain()
    assert domain.num_tasks() >= 12
    ids = [domain.task_at(i).task_id for i in range(domain.num_tasks())]
    assert ids == [MathDomain().task_at(i).task_id for i in range(domain.num_tasks())]
    assert len(set(ids)) == len(ids)
    for i in range(domain.num_tasks()):
        task = domain.task_at(i)
        ((text, trained),) = domain.demonstration(task, random.Random(0))
        assert trained and domain.score(task, text, []).correct == 1.0
        assert task.data_source.startswith("math/")


def test_prompt_template_from_params() -> None:
    domain = MathDomain({"prompt_template": "Q: {problem}\nA: \\boxed{}"})
    task = domain.task_at(0)
    assert task.prompt.startswith("Q: ") and task.prompt.endswith("A: \\boxed{}")
    with pytest.raises(EvoError) as err:
        MathDomain({"prompt_template": "no placeholder"})
    assert err.value.field == "domain.params.prompt_template"


def test_user_train_and_val_files(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the job's working directory: its data root
    train = tmp_path / "train.jsonl"
    train.write_text(
        "\n".join(
            json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) for i in range(6)
        )
    )
    val = tmp_path / "bench.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist(
            [
                {"id": "q1", "problem": "What is 10 - 3?", "answer": "7", "data_source": "bench/a"},
                {"id": "q2", "problem": "What is 2^5?", "answer": "32", "data_source": "bench/b"},
            ]
        ),
        val,
    )
    domain = MathDomain(data={"train": str(train), "val": str(val)})
    tr, va = domain.split(4, 2)
    assert len(tr) == 4 and {t.task_id for t in va} == {"math:q1", "math:q2"}
    assert {t.data_source for t in tr} == {"math/train"}
    with pytest.raises(EvoError) as err:
        domain.split(7, 2)
    assert err.value.field == "domain.train_size"


def test_bad_dataset_errors_name_the_file_and_field(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the job's working directory: its data root
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "no answer"}\n')
    with pytest.raises(EvoError) as err:
        MathDomain(data={"train": str(broken)}).num_tasks()
    assert err.value.where == f"{broken}:row 2" and err.value.field == "domain.data.train"
    with pytest.raises(EvoError) as err:
        MathDomain(data={"train": str(tmp_path / "missing.jsonl")}).num_tasks()
    assert "does not exist" in err.value.message
    with pytest.raises(EvoError):
        MathDomain(data={"tran": "x.jsonl"})


def test_domain_takes_the_callers_truncation_and_reports_details() -> None:
    domain = MathDomain()
    task = domain.task_at(0)
    cut = domain.score(task, "Let me think about the divisors of", [], truncated=True)
    assert cut.components == {"correctness": 0.0, "format": 1.0, "truncated": 1.0}
    stopped = domain.score(task, "Let me think about the divisors of", [])
    assert stopped.components["format"] == 0.0
    _, details = domain.judge(task, "$\\boxed{56}$")
    assert details == {"answer": "56", "form": "boxed", "failure": None}


def test_scores_through_the_verl_reward_module(tmp_path) -> None:
    from evotrainer.backends.verl_reward import compute_score

    config = tmp_path / "reward.json"
    config.write_text(
        json.dumps(
            {
                "domain": {"name": "math", "params": {}},
                "reward": {
                    "components": [
                        {"name": "correctness", "weight": 1.0},
                        {"name": "format", "weight": 0.1},
                    ]
                },
            }
        )
    )
    task = MathDomain().task_at(2)
    info = {"task_id": task.task_id, "meta": json.dumps(task.meta)}
    result = compute_score(
        task.data_source, "so \\boxed{1/6}", task.answer, info, config_path=str(config)
    )
    assert (result["score"], result["acc"], result["task_id"]) == (1.1, 1.0, "math:m03")
    result = compute_score(task.data_source, "no idea", task.answer, info, config_path=str(config))
    assert (result["score"], result["format"]) == (0.0, 0.0)
