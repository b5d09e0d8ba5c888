"""`arith`: multi-digit integer arithmetic, single turn, exact-match correctness.

Prompt `37+58=`, response `95` then end-of-sequence. Defaults (two-digit addition and
subtraction) are hard enough that a 300-step warm start of the tiny model reaches partial
accuracy, which leaves GRPO a reward signal to climb.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from evotrainer.domains.base import Demonstration, Domain, Score, Task

OPS = {
    "+": ("add", lambda a, b: a + b),
    "-": ("sub", lambda a, b: a - b),
    "*": ("mul", lambda a, b: a * b),
}
_NUMBER = re.compile(r"-?\d+")


class ArithDomain(Domain):
    name = "arith"
    components = ("correctness", "format", "partial")
    default_params: dict[str, Any] = {"digits": 1, "ops": ["+", "-", "*"]}

    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {
            "digits": {"type": "integer", "minimum": 1, "maximum": 4,
                       "description": "operand width in digits, e.g. digits: 2"},
            "ops": {"type": "array", "items": {"enum": list(OPS)}, "minItems": 1,
                    "description": 'the operators tasks use, e.g. ops: ["+", "-"]'},
        },
        "additionalProperties": False,
    }

    @property
    def _base(self) -> int:
        return 10 ** self.params["digits"]

    def num_tasks(self) -> int:
        return len(self.params["ops"]) * self._base**2

    def task_at(self, index: int) -> Task:
        op_index, rest = divmod(index, self._base**2)
        a, b = divmod(rest, self._base)
        op = self.params["ops"][op_index]
        source, fn = OPS[op]
        return Task(
            task_id=f"arith:{a}{op}{b}",
            prompt=f"{a}{op}{b}=",
            answer=str(fn(a, b)),
            data_source=f"arith/{source}",
        )

    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        return [(task.answer, True)]

    def score(
        self,
        task: Task,
        response: str,
        tool_calls: list[dict[str, str]],
        truncated: bool | None = None,
    ) -> Score:
        text = response.strip()
        well_formed = _NUMBER.fullmatch(text) is not None
        correct = float(text == task.answer)
        partial = 0.0
        if well_formed:
            target = int(task.answer)
            partial = max(0.0, 1.0 - abs(int(text) - target) / max(1, abs(target)))
        return Score(
            {"correctness": correct, "format": float(well_formed), "partial": partial}, correct
        )
