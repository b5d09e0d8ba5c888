"""`code`: competitive programming with stdin/stdout test cases, run in a sandbox.

Rows: `problem`, `tests` (a list of `{"input": ..., "output": ...}`), optional `id`,
`data_source`, `solution` (a reference program, the warm-start target) and `difficulty`.
A task's `answer` is the JSON text of its tests, so scoring is a function of the response and
the answer alone (the verl reward module rebuilds the task from `ground_truth`).

The program is the last fenced block tagged python/py/python3 or untagged. It runs against
every case in the sandbox (see `evotrainer.domains.sandbox`); output matches when the lines agree
after trimming each line and dropping trailing blank lines.

Components: `correctness` (all cases pass), `pass_fraction` (passed / total, the shaped
correctness reward), `format` (0 only for a real format failure: no code block in a response
that ended by itself), `truncated` (1 when the response was cut off inside its code block) -
the format gate and the truncation budget are measured apart, never as wrong answers.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from evotrainer.domains.base import Demonstration, Score, Task
from evotrainer.domains.data import DatasetDomain, require_text, stable_id
from evotrainer.domains.sandbox import (
    OFFLINE_IMAGE,
    DockerSandbox,
    Limits,
    LocalSandbox,
    Sandbox,
)
from evotrainer.errors import EvoError

DEFAULT_TEMPLATE = (
    "Write a Python 3 program that reads from standard input and writes to standard "
    "output.\n\n{problem}\n\nGive the complete program in one ```python code block."
)

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*$", re.MULTILINE)
_PYTHON_TAGS = frozenset({"", "python", "py", "python3", "py3"})
# Run outcomes after which the remaining cases are not run: they would hit the same limit.
_LIMIT_STATUSES = frozenset({"timeout", "cpu_limit", "memory_limit", "output_limit"})


def extract_program(response: str) -> tuple[str | None, bool]:
    """(program, cut_off): the last complete python (or untagged) fenced block; `cut_off` is
    True when the response ends inside an opened block, which then is the program."""
    fences = list(_FENCE.finditer(response))
    program = None
    # An odd last fence opens a block that never closes (handled below), hence strict=False.
    for opening, closing in zip(fences[::2], fences[1::2], strict=False):
        if opening.group(1).lower() in _PYTHON_TAGS:
            program = response[opening.end() + 1 : closing.start()]
    if len(fences) % 2 and fences[-1].group(1).lower() in _PYTHON_TAGS:
        return response[fences[-1].end() + 1 :], True
    return program, False


def outputs_match(expected: str, actual: str) -> bool:
    """Line by line, each line trimmed, leading and trailing blank lines ignored."""
    return [s.strip() for s in expected.strip().splitlines()] == [
        s.strip() for s in actual.strip().splitlines()
    ]


def parse_tests(answer: str | list[dict[str, str]]) -> list[dict[str, str]]:
    """Test cases from a task answer (JSON text) or a list; ValueError when malformed."""
    tests = json.loads(answer) if isinstance(answer, str) else answer
    if not isinstance(tests, list) or not tests:
        raise ValueError("tests must be a non-empty list")
    for case in tests:
        if not (
            isinstance(case, dict)
            and isinstance(case.get("input"), str)
            and isinstance(case.get("output"), str)
        ):
            raise ValueError('each test must be {"input": str, "output": str}')
    return tests


def score_code(
    response: str,
    tests: str | list[dict[str, str]],
    *,
    sandbox: Sandbox | None = None,
    limits: Limits | None = None,
    truncated: bool | None = None,
) -> tuple[Score, dict[str, Any]]:
    """Score one response against test cases: a plain function (no torch), shared by the
    embedded engine and the verl reward module.

    `truncated`: whether generation hit the length limit, when the caller knows; None infers
    it from the text (an unclosed code block). Returns the Score and details for the rollout
    record: `failure` (None; "no_code_block", the format failure; "truncated"; "syntax_error";
    or the first failing case's verdict: "wrong_answer", "runtime_error", "timeout",
    "cpu_limit", "memory_limit", "output_limit", "sandbox_error"), `passed`, `total`, `cases`
    (verdict and detail per case; "skipped" after a resource limit) and `isolation`."""
    cases = parse_tests(tests)
    program, cut_off = extract_program(response)
    was_truncated = cut_off if truncated is None else truncated
    details: dict[str, Any] = {"passed": 0, "total": len(cases), "cases": []}

    def verdict(failure: str | None, passed: int, well_formed: float) -> tuple[Score, dict]:
        correct = float(failure is None)
        components = {
            "correctness": correct,
            "pass_fraction": passed / len(cases),
            "format": well_formed,
            "truncated": float(was_truncated),
        }
        return Score(components, correct), {**details, "passed": passed, "failure": failure}

    if was_truncated:
        return verdict("truncated", 0, 1.0)
    if program is None or not program.strip():
        return verdict("no_code_block", 0, 0.0)
    try:
        compile(program, "main.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        details["detail"] = f"{type(exc).__name__}: {exc}"[:300]
        return verdict("syntax_error", 0, 1.0)
    sandbox = sandbox or default_sandbox()
    passed, failure = 0, None
    for case in cases:
        if failure in _LIMIT_STATUSES:
            details["cases"].append({"verdict": "skipped"})
            continue
        run = sandbox.run(program, case["input"], limits)
        details["isolation"] = list(run.isolation)
        if run.status == "ok" and outputs_match(case["output"], run.stdout):
            passed += 1
            details["cases"].append({"verdict": "pass"})
            continue
        case_verdict = "wrong_answer" if run.status == "ok" else run.status
        details["cases"].append({"verdict": case_verdict, "detail": run.detail})
        failure = failure or case_verdict
    return verdict(failure, passed, 1.0)


_SANDBOXES: dict[str, Sandbox] = {}


def default_sandbox(executor: str = "local", image: str = OFFLINE_IMAGE) -> Sandbox:
    """One sandbox per executor and process (a Docker client is worth reusing)."""
    key = f"{executor}:{image}"
    if key not in _SANDBOXES:
        _SANDBOXES[key] = DockerSandbox(image) if executor == "docker" else LocalSandbox()
    return _SANDBOXES[key]


class CodeDomain(DatasetDomain):
    name = "code"
    components = ("correctness", "pass_fraction", "format", "truncated")
    default_params: dict[str, Any] = {
        "prompt_template": DEFAULT_TEMPLATE,
        "executor": "local",  # or "docker" (needs the docker SDK and a reachable daemon)
        "docker_image": OFFLINE_IMAGE,
        "cpu_seconds": 2.0,
        "wall_seconds": 6.0,
        "memory_mb": 512,
        "output_kb": 1024,
    }
    sample_file = "code_sample.jsonl"

    def validate_params(self) -> None:
        p = self.params
        if not isinstance(p["prompt_template"], str) or "{problem}" not in p["prompt_template"]:
            raise EvoError(
                "prompt_template must be a string containing {problem}",
                field="domain.params.prompt_template",
                hint='e.g. "{problem}\\nAnswer with a ```python block."',
            )
        if p["executor"] not in ("local", "docker"):
            raise EvoError(
                f"executor must be local or docker, got {p['executor']!r}",
                field="domain.params.executor",
                hint="executor: local",
            )
        if p["executor"] == "docker" and not DockerSandbox.available():
            raise EvoError(
                "executor docker needs the docker SDK and a reachable daemon",
                field="domain.params.executor",
                hint="pip install docker and start the daemon, or use local",
            )
        for key in ("cpu_seconds", "wall_seconds", "memory_mb", "output_kb"):
            if not isinstance(p[key], (int, float)) or isinstance(p[key], bool) or p[key] <= 0:
                raise EvoError(
                    f"{key} must be a positive number, got {p[key]!r}",
                    field=f"domain.params.{key}",
                    hint=f"e.g. {key}: {self.default_params[key]}",
                )
        self.limits = Limits(
            cpu_seconds=float(p["cpu_seconds"]),
            wall_seconds=float(p["wall_seconds"]),
            memory_bytes=int(p["memory_mb"] * 2**20),
            output_bytes=int(p["output_kb"] * 1024),
        )

    def make_task(self, row: dict[str, Any], source: str, where: str, field: str) -> Task:
        problem = require_text(row, "problem", where, field)
        try:
            tests = parse_tests(row.get("tests") or [])
        except (ValueError, TypeError) as exc:
            raise EvoError(
                f"bad tests: {exc}",
                where=where,
                field=field,
                hint='tests: [{"input": "1 2\\n", "output": "3\\n"}, ...]',
            ) from exc
        meta = {key: row[key] for key in ("solution", "difficulty") if row.get(key)}
        return Task(
            task_id=stable_id("code", row, problem),
            prompt=self.params["prompt_template"].replace("{problem}", problem),
            answer=json.dumps(tests, sort_keys=True),
            data_source=str(row.get("data_source") or source),
            meta=meta,
        )

    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        solution = task.meta.get("solution")
        if not solution:
            raise EvoError(
                f"task {task.task_id} has no reference solution to warm start from",
                field="model.warm_start",
                hint="add a `solution` to every row, or set warm_start steps: 0",
            )
        return [(f"```python\n{solution.rstrip()}\n```", True)]

    def judge(
        self, task: Task, response: str, truncated: bool | None = None
    ) -> tuple[Score, dict[str, Any]]:
        """The Score plus details for the rollout record's `extra` (`failure`, per-case
        verdicts, `isolation`)."""
        sandbox = default_sandbox(self.params["executor"], self.params["docker_image"])
        return score_code(
            response, task.answer, sandbox=sandbox, limits=self.limits, truncated=truncated
        )
