"""The reward function verl calls for EvoTrainer jobs (copied beside the job's data at submit).

verl 0.9.1 calls `compute_score(data_source=, solution_str=, ground_truth=, extra_info=,
**reward_kwargs)` in its reward workers; our render passes `config_path`, a JSON file holding
the recipe's `domain` and `reward.components`. Every key of the returned dict lands in
verl's `reward_extra_info`: the validation dumps then carry `acc`, each raw component and the
`task_id` and `data_source`, which is how the score table pairs samples with tasks and
sources (no verl dump has a task id of its own; V1 train dumps carry no extras at all, so
collect joins those back to the prepared data). Strings there are fine: verl's validation
metrics skip string values.

It needs `evotrainer` importable in the workers (Ray Jobs ship it as a `py_modules` entry;
a local job puts it on PYTHONPATH).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from evotrainer.domains import Domain, Task, make_domain


@cache
def _load(config_path: str) -> tuple[Domain, tuple[tuple[str, float], ...]]:
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    weights = tuple(
        (c["name"], float(c.get("weight", 1.0))) for c in config["reward"]["components"]
    )
    return make_domain(config["domain"]), weights


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    config_path: str = "",
    **_: Any,
) -> dict[str, Any]:
    domain, weights = _load(config_path)
    info = extra_info or {}
    task = Task(
        task_id=str(info["task_id"]),
        prompt=str(info.get("question", "")),
        answer=str(ground_truth),
        data_source=data_source,
        meta=json.loads(info.get("meta") or "{}"),
    )
    scored = domain.score(task, solution_str, [])
    reward = sum(weight * scored.components[name] for name, weight in weights)
    return {
        "score": float(reward),
        "acc": float(scored.correct),
        **scored.components,
        "task_id": task.task_id,
        "data_source": data_source,
    }
