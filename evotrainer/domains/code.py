"""`code`: competitive programming with stdin/stdout test cases, run in a sandbox.

Rows: `problem`, `tests` (a list of `{"input": ..., "output": ...}`), optional `id`,
`data_source`, `solution` (a reference program, the warm-start target) and `difficulty`.
A task's `answer` is the JSON text of its tests, so scoring is a function of the response and
the answer alone (the verl reward module rebuilds the task from `ground_truth`).

The program is the last fenced block tagged python/py/python3 or untagged. It runs against
every case in the sandbox (see `evotrainer.sandbox.process`); output matches when the lines agree
after trimming each line and dropping trailing blank lines.

Components (see `evotrainer.domains.sandboxed`): `correctness` (all cases pass),
`pass_fraction` (passed / total), `format`, `truncated` (cut off inside its code block) - the
format gate and the truncation budget are measured apart, never as wrong answers - and
`tampered`: 1 when a case's run died of a signal that no limit or crash explains (a program
signalling itself or its group). A pass cannot be forged here: the channel is the program's
stdout by design, compared on the host with expected output the program never sees, and an
exit status other than 0 fails the case whatever was printed.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from evotrainer.domains.base import Score, Task
from evotrainer.domains.data import require_text, stable_id
from evotrainer.domains.sandboxed import (
    EXECUTOR_PARAMS,
    LIMIT_STATUSES,
    SandboxedCodeDomain,
    extract_program,
    sandboxed_params_schema,
)
from evotrainer.errors import EvoError
from evotrainer.sandbox.process import (
    OFFLINE_IMAGE,
    Limits,
    Sandbox,
    check_executor,
    default_sandbox,
)
from evotrainer.sandbox.runner import UNASKED_SIGNALS

DEFAULT_TEMPLATE = (
    "Write a Python 3 program that reads from standard input and writes to standard "
    "output.\n\n{problem}\n\nGive the complete program in one ```python code block."
)


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
    (verdict and detail per case; "skipped" after a resource limit), `isolation` and
    `tampering` (what made `tampered` 1)."""
    cases = parse_tests(tests)
    program, cut_off = extract_program(response)
    was_truncated = cut_off if truncated is None else truncated
    details: dict[str, Any] = {"passed": 0, "total": len(cases), "cases": [], "tampering": []}

    def verdict(failure: str | None, passed: int, well_formed: float) -> tuple[Score, dict]:
        correct = float(failure is None)
        components = {
            "correctness": correct,
            "pass_fraction": passed / len(cases),
            "format": well_formed,
            "truncated": float(was_truncated),
            "tampered": float(bool(details["tampering"])),
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
        if failure in LIMIT_STATUSES:
            details["cases"].append({"verdict": "skipped"})
            continue
        run = sandbox.run(program, case["input"], limits)
        details["isolation"] = list(run.isolation)
        if run.exit_code is not None and run.exit_code < 0 and -run.exit_code not in (
            UNASKED_SIGNALS
        ):
            details["tampering"].append(f"killed by signal {-run.exit_code}")
        if run.status == "ok" and outputs_match(case["output"], run.stdout):
            passed += 1
            details["cases"].append({"verdict": "pass"})
            continue
        case_verdict = "wrong_answer" if run.status == "ok" else run.status
        details["cases"].append({"verdict": case_verdict, "detail": run.detail})
        failure = failure or case_verdict
    return verdict(failure, passed, 1.0)


class CodeDomain(SandboxedCodeDomain):
    name = "code"
    params_schema: ClassVar[dict[str, Any]] = sandboxed_params_schema(
        "{problem}", "{problem}\nAnswer with a ```python block.", **EXECUTOR_PARAMS
    )
    default_params: dict[str, Any] = {
        **SandboxedCodeDomain.default_params,
        "prompt_template": DEFAULT_TEMPLATE,
        "executor": "local",  # or "docker" (the docker SDK, a daemon and `docker_image`)
        "docker_image": OFFLINE_IMAGE,
    }
    sample_file = "code_sample.jsonl"

    def validate_params(self) -> None:
        check_executor(self.params["executor"], self.params["docker_image"])

    def sandbox(self) -> Sandbox:
        return default_sandbox(self.params["executor"], self.params["docker_image"])

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

    def judge(
        self, task: Task, response: str, truncated: bool | None = None
    ) -> tuple[Score, dict[str, Any]]:
        """The Score plus details for the rollout record's `extra` (`failure`, per-case
        verdicts, `isolation`)."""
        return score_code(
            response, task.answer, sandbox=self.sandbox(), limits=self.limits, truncated=truncated
        )
