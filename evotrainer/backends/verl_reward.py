"""The reward function verl calls for EvoTrainer jobs (copied beside the job's data at submit).

verl 0.9.1 calls `compute_score(data_source=, solution_str=, ground_truth=, extra_info=,
**reward_kwargs)` in its reward workers; our render passes `config_path`, a JSON file holding
the recipe's `domain` and `reward.components`. Every key of the returned dict lands in
verl's `reward_extra_info`, which `_dump_generations` writes into the dumps (legacy train and
validation dumps, V1 validation dumps; V1 train dumps carry a uid instead, and collect joins
their tasks back from the prepared data). So the dumps carry:

- `acc` and each raw reward component;
- `task_id` and `data_source`: how the score table pairs samples with tasks and sources (no
  verl dump has a task id of its own);
- `index`: the dataset row the sample was drawn for. verl draws a row once per step and
  repeats it n times, so within a step's dump it is verl's own GRPO group, exact in whatever
  order `trainer.balance_batch` left the rows (a legacy dump has no uid);
- for a multi-turn domain, `tool_calls` (JSON: [{name, args}]) and `num_turns`: what verl
  lets a reward see of an episode. The calls are parsed from the transcript as verl's own
  `hermes` tool parser reads them (`<tool_call>{"name", "arguments"}</tool_call>`), and
  scored with, as the embedded engine scores its recorded calls; `num_turns` is verl's count
  (its reward manager puts it in extra_info).

Strings are fine there: verl's validation metrics skip string values (which is also why
`index` is returned as text, not averaged into a metric).

It needs `evotrainer` importable in the workers (Ray Jobs ship it as a `py_modules` entry;
a local job puts it on PYTHONPATH).
"""

from __future__ import annotations

import json
import numbers
import re
from functools import cache
from pathlib import Path
from typing import Any

from evotrainer.domains import Domain, Task, make_domain

# verl's HermesToolParser: the default `multi_turn.format` of its tool agent loop.
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@cache
def _load(config_path: str) -> tuple[Domain, tuple[tuple[str, float], ...]]:
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    weights = tuple(
        (c["name"], float(c.get("weight", 1.0))) for c in config["reward"]["components"]
    )
    return make_domain(config["domain"]), weights


def hermes_tool_calls(transcript: str) -> list[dict[str, str]]:
    """The tool calls in a verl multi-turn transcript, as {name, args}. A tool of one
    argument records that argument's value as `args` (the command of `shell`, the number of
    `compare`, as the domains record their own calls), one of none "", others their
    arguments as JSON; a call verl could not parse either is `invalid`, its text as args."""
    calls = []
    for body in _HERMES_CALL.findall(transcript):
        try:
            call = json.loads(body)
            name, arguments = str(call["name"]), call.get("arguments") or {}
        except (json.JSONDecodeError, KeyError, TypeError):
            calls.append({"name": "invalid", "args": body.strip()})
            continue
        if not arguments:
            args = ""
        elif isinstance(arguments, dict) and len(arguments) == 1:
            (value,) = arguments.values()
            args = value if isinstance(value, str) else json.dumps(value)
        else:
            args = json.dumps(arguments, sort_keys=True)
        calls.append({"name": name, "args": args})
    return calls


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
    calls = hermes_tool_calls(solution_str) if domain.tools else []
    scored = domain.score(task, solution_str, calls)
    reward = sum(weight * scored.components[name] for name, weight in weights)
    out = {
        "score": float(reward),
        "acc": float(scored.correct),
        **scored.components,
        "task_id": task.task_id,
        "data_source": data_source,
    }
    # The row's place in the dataset, for exact groups on ingest; ours always carries it, a
    # dataset written elsewhere may not.
    if "index" in info:
        out["index"] = str(info["index"])
    if domain.tools:
        out["tool_calls"] = json.dumps(calls)
        turns = info.get("num_turns")  # a numpy integer from verl's batch
        if isinstance(turns, numbers.Integral) and not isinstance(turns, bool):
            out["num_turns"] = int(turns)
    return out
