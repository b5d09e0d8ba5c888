"""`math`: competition-style problems with a final answer checked by a verifier.

Rows: `problem`, `answer`, optional `id`, `data_source`, `solution` (the warm-start target).
The answer is taken from the last `\\boxed{...}` of the response, or else from a final line
such as `Answer: 42` / `The final answer is 42` / `#### 42`, and compared with the reference
by `math-verify` (equivalent forms, sets and intervals, units in `\\text{}`, percent and degree
signs stripped).

Components: `correctness` (1 when the answer is equivalent), `format` (0 only for a real format
failure: no answer in a response that ended by itself), `truncated` (1 when the response was
cut off - its answer, if any, was never finished - kept apart from wrong answers and from
format failures, so truncation never reads as "the model cannot format").
"""

from __future__ import annotations

import random
import re
import threading
from typing import Any, ClassVar

from evotrainer.domains.base import Demonstration, Score, Task
from evotrainer.domains.data import DatasetDomain, require_text, stable_id

DEFAULT_TEMPLATE = (
    "Solve the following problem. Reason step by step, then put the final answer in "
    "\\boxed{}.\n\n{problem}"
)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "Answer: 42", "The final answer is 42.", "**Final Answer:** $42$", "#### 42" (last line only).
_FINAL_LINE = re.compile(
    r"answer(?:\s+is\b|\s*[:：])[*_\s:]*(?P<ans>.+)$|^\s*####\s*(?P<hash>.+)$", re.IGNORECASE
)
# Decorations that change nothing about the value: percent, degrees, thin spaces, dollars.
_NOISE = re.compile(r"\\%|%|\^\s*\{?\\circ\}?|\\[,!;: ]|\\\$")


def extract_answer(response: str) -> tuple[str | None, str, bool]:
    """(answer, form, cut_off): the last complete `\\boxed{}` ("boxed"), else a final-line
    answer ("final_line"), else None (""). `cut_off` is True when a `\\boxed{` after the last
    complete one never closes, i.e. the answer itself was cut off."""
    answer, cut_off, pos = None, False, 0
    while match := _BOXED.search(response, pos):
        content, end = _balanced(response, match.end())
        if content is None:
            cut_off = True
            break
        answer, pos = content.strip(), end
    if answer is not None:
        return answer, "boxed", cut_off
    lines = [line for line in response.strip().splitlines() if line.strip()]
    if lines and not cut_off and (match := _FINAL_LINE.search(lines[-1])):
        text = (match.group("ans") or match.group("hash")).strip()
        text = text.strip("*_ ").rstrip(".").strip()
        if text.startswith("$") and text.endswith("$"):
            text = text.strip("$").strip()
        if text:
            return text, "final_line", False
    return None, "", cut_off


def _balanced(text: str, start: int) -> tuple[str | None, int]:
    """The text up to the brace closing the one opened just before `start`, and the index
    after it; (None, len) when it never closes."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i], i + 1
    return None, len(text)


def answers_match(predicted: str, reference: str) -> bool:
    """Whether `predicted` is mathematically equivalent to `reference` (math-verify)."""
    from math_verify import parse, verify  # sympy-heavy: imported when first scoring

    # math-verify times out with SIGALRM, which only the main thread may use.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse("\\boxed{" + _NOISE.sub("", reference) + "}", parsing_timeout=timeout)
    pred = parse("\\boxed{" + _NOISE.sub("", predicted) + "}", parsing_timeout=timeout)
    if not gold or not pred:
        return _NOISE.sub("", predicted).strip() == _NOISE.sub("", reference).strip()
    return bool(verify(gold, pred, timeout_seconds=timeout))


def score_math(
    response: str, reference: str, *, truncated: bool | None = None
) -> tuple[Score, dict[str, Any]]:
    """Score one response against a reference answer: a plain function (no torch), shared by
    the embedded engine and the verl reward module.

    `truncated`: whether generation hit the length limit, when the caller knows (the engine's
    finish_reason); None infers it from the text alone (an unfinished `\\boxed{`).
    Returns the Score and details for the rollout record: `failure` (None, "wrong_answer",
    "no_answer" - the format failure - or "truncated"), `answer`, `form`."""
    answer, form, cut_off = extract_answer(response)
    was_truncated = cut_off if truncated is None else truncated
    details: dict[str, Any] = {"answer": answer, "form": form or None}
    if was_truncated:
        failure, correct, well_formed = "truncated", 0.0, 1.0
    elif answer is None:
        failure, correct, well_formed = "no_answer", 0.0, 0.0
    else:
        correct = float(answers_match(answer, reference))
        failure, well_formed = (None if correct else "wrong_answer"), 1.0
    components = {"correctness": correct, "format": well_formed, "truncated": float(was_truncated)}
    return Score(components, correct), {**details, "failure": failure}


class MathDomain(DatasetDomain):
    name = "math"
    components = ("correctness", "format", "truncated")
    default_params: dict[str, Any] = {"prompt_template": DEFAULT_TEMPLATE}
    sample_file = "math_sample.jsonl"

    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {
            "prompt_template": {
                "type": "string",
                "pattern": r"\{problem\}",
                "description": "a string containing {problem}, e.g. "
                '"Solve: {problem}\\nPut the answer in \\\\boxed{}."',
            },
        },
        "additionalProperties": False,
    }

    def make_task(self, row: dict[str, Any], source: str, where: str, field: str) -> Task:
        problem = require_text(row, "problem", where, field)
        answer = require_text(row, "answer", where, field).strip()
        meta = {"solution": row["solution"]} if row.get("solution") else {}
        return Task(
            task_id=stable_id("math", row, problem),
            # replace, not format: templates are full of LaTeX braces.
            prompt=self.params["prompt_template"].replace("{problem}", problem),
            answer=answer,
            data_source=str(row.get("data_source") or source),
            meta=meta,
        )

    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        solution = task.meta.get("solution") or f"The answer is $\\boxed{{{task.answer}}}$."
        return [(solution, True)]

    def judge(
        self, task: Task, response: str, truncated: bool | None = None
    ) -> tuple[Score, dict[str, Any]]:
        """The Score plus details for the rollout record's `extra` (`failure`, `answer`)."""
        return score_math(response, task.answer, truncated=truncated)
