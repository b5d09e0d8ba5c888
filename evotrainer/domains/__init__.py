"""The domain registry: names → lazy import strings, so listing domains or validating a recipe
never imports a domain that is not used (or not written yet).

`make_domain` with the recipe's `reward.judges` wraps the domain in a `JudgedDomain`: the
same tasks and scores, plus one `judge:<name>` component per judge (domains/judge.py). The
engine, the backtests and verl's reward function all build their scorer here, so a judge
scores the same way in each.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from evotrainer.domains.base import Demonstration, Domain, Environment, EnvStep, Score, Task
from evotrainer.domains.judge import Judge, ServedEndpoint, VerdictCache, make_judges
from evotrainer.errors import EvoError

# What a scorer is given for one finished episode: task, response, tool calls, truncated.
Scored = tuple[Task, str, list[dict[str, str]], bool | None]

REGISTRY: dict[str, str] = {
    "arith": "evotrainer.domains.arith:ArithDomain",
    "toolenv": "evotrainer.domains.toolenv:ToolEnvDomain",
    "math": "evotrainer.domains.math:MathDomain",
    "math_tool": "evotrainer.domains.math_tool:MathToolDomain",
    "code": "evotrainer.domains.code:CodeDomain",
    "humaneval": "evotrainer.domains.humaneval:HumanEvalDomain",
    "ifeval": "evotrainer.domains.ifeval:IFEvalDomain",
    "swe": "evotrainer.domains.swe:SweDomain",
    "swe_rebench": "evotrainer.domains.swe_rebench:SweRebenchDomain",
}


def get_domain(name: str) -> type[Domain]:
    """The domain class registered under `name` (EvoError naming `domain.name` otherwise)."""
    if name not in REGISTRY:
        raise EvoError(
            f"unknown domain {name!r}",
            field="domain.name",
            hint=f"choose one of: {', '.join(sorted(REGISTRY))}",
        )
    module_name, _, attr = REGISTRY[name].partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EvoError(
            f"domain {name!r} is registered but cannot be loaded ({exc})",
            field="domain.name",
            hint=f"{REGISTRY[name]} is not available in this installation; use another domain",
        ) from exc


def make_domain(
    domain_cfg: dict[str, Any],
    judges: Sequence[Mapping[str, Any]] | None = None,
    *,
    cache_dir: Path | None = None,
    endpoints: Mapping[str, ServedEndpoint] | None = None,
) -> Domain:
    """Instantiate the recipe's `domain` section: its `name`, `params` and, for dataset
    domains, `data` (train/val paths, relative to the job's working directory). With
    `judges` (the recipe's `reward.judges`) the domain comes wrapped in a `JudgedDomain`;
    `cache_dir` holds their replies, `endpoints` the servers started for `serve:` judges.
    Nothing is contacted here: a recipe check builds its domain this way too."""
    name = domain_cfg.get("name", "")
    domain = get_domain(name)
    data = {k: v for k, v in (domain_cfg.get("data") or {}).items() if v}
    if not data:
        built = domain(domain_cfg.get("params") or {})
    elif "data" not in inspect.signature(domain).parameters:
        raise EvoError(f"domain {name!r} generates its own tasks and reads no data files",
                       field="domain.data", hint="remove domain.data, or use a dataset "
                       "domain (math, code, humaneval)")
    else:
        built = domain(domain_cfg.get("params") or {}, data=data)
    checked = make_judges(judges, endpoints)
    return JudgedDomain(built, checked, VerdictCache(cache_dir)) if checked else built


class JudgedDomain(Domain):
    """A domain whose scores carry one more component per judge, `judge:<name>`: the
    judge's verdict on the response, in [0, 1]. Tasks, demonstrations and environments are
    the inner domain's; anything else is looked up on it too."""

    def __init__(self, inner: Domain, judges: list[Judge], cache: VerdictCache) -> None:
        # The inner domain checked its own parameters; nothing to check again.
        self.inner, self.judges, self.cache = inner, judges, cache
        self.name, self.tools, self.turn_end = inner.name, inner.tools, inner.turn_end
        self.params, self.default_params = inner.params, inner.default_params
        self.params_schema = inner.params_schema
        self.component_params_schema = inner.component_params_schema  # judges take none
        self.default_environment = inner.default_environment
        self.components = (*inner.components, *(j.component for j in judges))

    def __getattr__(self, attr: str) -> Any:  # a domain's own helpers (math's `judge`, ...)
        inner = self.__dict__.get("inner")  # absent while copy or pickle rebuild the object
        if inner is None:
            raise AttributeError(attr)
        return getattr(inner, attr)

    def validate_params(self) -> None:
        self.inner.validate_params()

    def num_tasks(self) -> int:
        return self.inner.num_tasks()

    def task_at(self, index: int) -> Task:
        return self.inner.task_at(index)

    def split(self, train_size: int, val_size: int, split_seed: int = 0
              ) -> tuple[list[Task], list[Task]]:
        return self.inner.split(train_size, val_size, split_seed)

    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        return self.inner.demonstration(task, rng)

    def environment(self, task: Task, config: dict[str, Any]) -> Environment:
        return self.inner.environment(task, config)

    def score(self, task: Task, response: str, tool_calls: list[dict[str, str]],
              truncated: bool | None = None) -> Score:
        return self.score_many([(task, response, tool_calls, truncated)])[0]

    def score_many(self, items: Sequence[Scored]) -> list[Score]:
        """Every item scored by the domain, then by each judge with its requests for the whole
        batch in flight together."""
        scores = [self.inner.score(*item) for item in items]
        verdicts = self.judge_values([j.component for j in self.judges], items)
        return [
            Score({**s.components, **{c: v[i] for c, v in verdicts.items()}}, s.correct)
            for i, s in enumerate(scores)
        ]

    def judge_values(self, components: Sequence[str], items: Sequence[Scored]
                     ) -> dict[str, list[float]]:
        """The named `judge:<name>` components of each item, without the domain's own
        scoring (a backtest that re-scores with a judge runs no tests)."""
        by_component = {j.component: j for j in self.judges}
        pairs = [(task, response) for task, response, *_ in items]
        return {c: by_component[c].verdicts(pairs, self.cache) for c in components}

    def judge_records(self) -> list[dict[str, Any]]:
        return [j.record() for j in self.judges]

    def close(self) -> None:
        for judge in self.judges:
            judge.close()


def score_all(domain: Domain, items: Sequence[Scored]) -> list[Score]:
    """Scores of a batch of finished episodes: a judged domain asks its judges for the batch
    at once, any other domain scores one by one."""
    if isinstance(domain, JudgedDomain):
        return domain.score_many(items)
    return [domain.score(*item) for item in items]


def judge_records(domain: Domain) -> list[dict[str, Any]]:
    """The identity of each judge a domain scores with (model, endpoint or what was served,
    template digest, parse) and what it did (requests, cache hits, retries, unparsed
    replies): the run record's `judges`. Empty for a domain without judges."""
    return domain.judge_records() if isinstance(domain, JudgedDomain) else []


__all__ = [
    "REGISTRY",
    "Domain",
    "EnvStep",
    "Environment",
    "JudgedDomain",
    "Score",
    "Scored",
    "ServedEndpoint",
    "Task",
    "get_domain",
    "judge_records",
    "make_domain",
    "score_all",
]
