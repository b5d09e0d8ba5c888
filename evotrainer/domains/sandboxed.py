"""The base of the domains that score a model-written program by running it in the sandbox
(`code`: stdin/stdout cases; `humaneval`: a function against its unit tests).

What they share: the parameters (prompt template, CPU, wall, memory and output limits) and
their schema, the sandbox, the warm start from a
reference solution, the fenced-block extraction, and the components they report:
- `correctness`: every test passed;
- `pass_fraction`: the share of tests that passed (the shaped correctness reward);
- `format`: 0 only for a real format failure (no code block in a response that ended by
  itself); `truncated`: 1 when the response was cut off;
- `tampered`: 1 when the scoring saw the code try to fake its result: an exit or a signal
  while a test waited on it, a forged, malformed or missing report (see each domain). It is
  recorded for the harness's integrity metric and adds to the reward only when a recipe
  weights it.
"""

from __future__ import annotations

import random
import re
from typing import Any

from evotrainer.domains.base import Demonstration, Task
from evotrainer.domains.data import DatasetDomain
from evotrainer.errors import EvoError
from evotrainer.sandbox.process import Limits, Sandbox, default_sandbox

COMPONENTS = ("correctness", "pass_fraction", "format", "truncated", "tampered")

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*$", re.MULTILINE)
_PYTHON_TAGS = frozenset({"", "python", "py", "python3", "py3"})
# Outcomes after which the remaining tests are not run: they would hit the same limit.
LIMIT_STATUSES = frozenset({"timeout", "cpu_limit", "memory_limit", "output_limit"})


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


def _positive(example: float) -> dict[str, Any]:
    return {"type": "number", "exclusiveMinimum": 0, "description": f"e.g. {example}"}


# `executor` and `docker_image`, for the domains that can run programs in Docker.
EXECUTOR_PARAMS: dict[str, Any] = {
    "executor": {"enum": ["local", "docker"],
                 "description": "local, or docker (the docker SDK, a daemon and docker_image)"},
    "docker_image": {"type": "string"},
}


def sandboxed_params_schema(
    slot: str, example: str, **more: dict[str, Any]
) -> dict[str, Any]:
    """The params schema of a sandboxed-code domain whose prompt template must contain `slot`
    (`example` shows one), with `more` parameters of its own."""
    return {
        "type": "object",
        "properties": {
            "prompt_template": {"type": "string", "pattern": re.escape(slot),
                                "description": f"a string containing {slot}, e.g. {example!r}"},
            "cpu_seconds": _positive(2.0),
            "wall_seconds": _positive(6.0),
            "memory_mb": _positive(512),
            "output_kb": _positive(1024),
            **more,
        },
        "additionalProperties": False,
    }


class SandboxedCodeDomain(DatasetDomain):
    """A dataset domain whose answers are programs run in the sandbox. Subclasses set their
    parameters' schema (`sandboxed_params_schema`), the row field holding the reference
    solution, and `judge`."""

    components = COMPONENTS
    # The row field a warm-start demonstration comes from (stored as meta["solution"]).
    solution_field = "solution"
    default_params: dict[str, Any] = {
        "prompt_template": "",
        "cpu_seconds": 2.0,
        "wall_seconds": 6.0,
        "memory_mb": 512,
        "output_kb": 1024,
    }

    @property
    def limits(self) -> Limits:
        """The sandbox limits every test of a response runs under."""
        p = self.params
        return Limits(
            cpu_seconds=float(p["cpu_seconds"]),
            wall_seconds=float(p["wall_seconds"]),
            memory_bytes=int(p["memory_mb"] * 2**20),
            output_bytes=int(p["output_kb"] * 1024),
        )

    def sandbox(self) -> Sandbox:
        """Where programs run: the local sandbox (a domain with an executor choice overrides)."""
        return default_sandbox()

    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        solution = task.meta.get("solution")
        if not solution:
            raise EvoError(
                f"task {task.task_id} has no {self.solution_field} to warm start from",
                field="model.warm_start",
                hint=f"add {self.solution_field} to every row, or set warm_start steps: 0",
            )
        return [(f"```python\n{self.solution_program(task, solution).rstrip()}\n```", True)]

    def solution_program(self, task: Task, solution: str) -> str:
        """The whole program a reference solution stands for."""
        return solution
