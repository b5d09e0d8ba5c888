"""What a domain provides to the engine: tasks, demonstrations, scoring and (optionally) an
environment for multi-turn episodes.

Domains are plain Python (no torch): the recipe validator imports them to check component and
tool names, and the backtest tool re-scores stored rollouts with them.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from evotrainer.domains.params import check_params
from evotrainer.errors import EvoError


@dataclass(frozen=True)
class Task:
    """One problem. `task_id` is derived from the task's content, so it is stable across
    steps, seeds and versions and two versions' score tables pair by it."""

    task_id: str
    prompt: str
    answer: str
    data_source: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvStep:
    """The environment's reply to one action: text appended to the trajectory (masked out of
    the loss), whether the episode is over, and the tool call the action made (if any)."""

    observation: str
    done: bool
    tool_call: dict[str, str] | None = None


class Environment(Protocol):
    def step(self, action: str) -> EnvStep: ...


@dataclass(frozen=True)
class Score:
    """Raw reward components (every component the domain knows) and correctness in [0, 1]."""

    components: dict[str, float]
    correct: float


# A demonstration is a list of (text, trained) segments: environment text is not trained.
Demonstration = list[tuple[str, bool]]


class Domain(ABC):
    """A task family. Subclasses set the class attributes and implement the four methods."""

    name: str = ""
    # Reward components `score` returns; the recipe's `reward.components` pick and weight them.
    components: tuple[str, ...] = ("correctness",)
    # Tools an environment offers (empty for single-turn domains).
    tools: tuple[str, ...] = ()
    # Multi-turn domains end each action with this character; None means single-turn.
    turn_end: str | None = None
    default_params: dict[str, Any] = {}
    # The JSON Schema fragment `domain.params` is checked against: every parameter's type and
    # bounds, no unknown key. What one parameter allows given another (a cross-field rule)
    # is `validate_params`'s.
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {}, "additionalProperties": False
    }
    # The reward components that take `params`, each with the JSON Schema fragment its
    # `reward.components[i].params` is checked against; any other component takes none.
    component_params_schema: ClassVar[dict[str, dict[str, Any]]] = {}
    # Environment defaults merged under the recipe's `environment` (multi-turn domains only).
    default_environment: dict[str, Any] | None = None

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        params = dict(params or {})
        check_params(params, self.params_schema, "domain.params")
        self.params = {**self.default_params, **params}
        self.validate_params()

    def validate_params(self) -> None:
        """Raise EvoError naming `domain.params.<key>` for a value its schema allows but the
        other parameters rule out (none by default)."""
        return None

    @abstractmethod
    def num_tasks(self) -> int:
        """How many distinct tasks the current parameters define."""

    @abstractmethod
    def task_at(self, index: int) -> Task:
        """Task number `index` in [0, num_tasks()) (a fixed order, never materialised whole)."""

    def split(
        self, train_size: int, val_size: int, split_seed: int = 0
    ) -> tuple[list[Task], list[Task]]:
        """A seeded, disjoint train/val split. The split seed is fixed (not the training seed)
        so every seed and version validates on the same tasks."""
        total = self.num_tasks()
        if train_size + val_size > total:
            raise EvoError(
                f"domain {self.name!r} has only {total} distinct tasks with these "
                f"parameters, but train_size + val_size = {train_size + val_size}",
                field="domain.train_size",
                hint="lower domain.train_size / domain.val_size or widen domain.params",
            )
        picked = random.Random(split_seed).sample(range(total), train_size + val_size)
        val = [self.task_at(i) for i in picked[:val_size]]
        train = [self.task_at(i) for i in picked[val_size:]]
        return train, val

    @abstractmethod
    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        """A supervised target for the warm start (the response after the prompt)."""

    @abstractmethod
    def score(
        self,
        task: Task,
        response: str,
        tool_calls: list[dict[str, str]],
        truncated: bool | None = None,
    ) -> Score:
        """Score a finished response (for multi-turn domains: the whole transcript after the
        prompt, observations included). `truncated`: generation hit the length limit, so a
        missing answer is a cut-off, not a format failure."""

    def environment(self, task: Task, config: dict[str, Any]) -> Environment:
        raise NotImplementedError(f"domain {self.name!r} is single-turn")
