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
- for a multi-turn domain, `tool_calls` (JSON: [{name, args}]) and `num_turns`. When the
  domain's own verl tools ran the episode (verl_tools.py), the calls are the ones its
  environment recorded and the response scored is the episode's transcript in the domain's
  format (`evo_episode`, which verl hands over from the trajectory's extra_fields), exactly
  what the embedded engine scores (math_tool: the decoded text, whose final answer follows
  the calls); with other tools they are parsed from the decoded text as
  verl's own `hermes` parser reads them (`<tool_call>{"name", "arguments"}</tool_call>`).
  `num_turns` is verl's count (its reward manager puts it in extra_info);
- with the Dual-Level filter (`group_filter.name: dual_level`), on training rows,
  `evo_excluded` (1.0 or 0.0) and `evo_exclusion` (the level-1 rule, or ""): the reference
  env marks such a trajectory with a −999 reward that ROLL masks out of the loss; here the
  score stays the true one (verl's score metrics average it) and the mark says which
  trajectories level 1 takes out, for the sampler and the dumps.

Strings are fine there: verl's validation metrics skip string values (which is also why
`index` is returned as text, not averaged into a metric).

It needs `evotrainer` importable in the workers (Ray Jobs ship it as a `py_modules` entry;
a local job puts it on PYTHONPATH).
"""

from __future__ import annotations

import json
import numbers
from functools import cache
from pathlib import Path
from typing import Any

from evotrainer.backends.verl_episode import EPISODE_FIELD
from evotrainer.contract.filters import GroupFilter, Trajectory, make_filter
from evotrainer.domains import Domain, Task, make_domain
from evotrainer.evidence.hermes import hermes_tool_calls


@cache
def _load(config_path: str) -> tuple[Domain, tuple[tuple[str, float], ...], GroupFilter]:
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    weights = tuple(
        (c["name"], float(c.get("weight", 1.0))) for c in config["reward"]["components"]
    )
    # LLM judges score judge:<name> components through the same domain code as the engine;
    # verl's reward workers share one reply cache beside the config.
    domain = make_domain(config["domain"], config["reward"].get("judges"),
                         cache_dir=Path(config_path).parent / "judge-cache")
    return domain, weights, make_filter(config.get("group_filter"))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    config_path: str = "",
    **_: Any,
) -> dict[str, Any]:
    domain, weights, group_filter = _load(config_path)
    info = extra_info or {}
    task = Task(
        task_id=str(info["task_id"]),
        prompt=str(info.get("question", "")),
        answer=str(ground_truth),
        data_source=data_source,
        meta=json.loads(info.get("meta") or "{}"),
    )
    episode = info.get(EPISODE_FIELD) if domain.tools else None
    response, calls, actions = solution_str, [], None
    if episode:
        response, calls = str(episode["transcript"]), list(episode["tool_calls"])
        actions = int(episode["turns"])
        if getattr(domain, "answer_in_text", False):
            # The answer is the model's text after its calls (math_tool), which only the
            # decoded response holds; the calls stay the ones the environment recorded.
            response = solution_str
    elif domain.tools:
        calls = hermes_tool_calls(solution_str)
        actions = len(calls)
    scored = domain.score(task, response, calls)
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
    if group_filter.name == "dual_level" and info.get("split") == "train":
        # Turns as the engine counts them (one per action); verl's own num_turns also counts
        # the prompt and each tool reply. The length is unknown here, but a domain that
        # scores a `truncated` component (code, math: a response cut inside its answer) says
        # so, which gives single-turn domains level 1 (truncation) as well as level 2.
        cut = scored.components.get("truncated")
        reason = group_filter.exclude(
            Trajectory(
                scored.correct,
                actions,
                calls if domain.tools else None,
                None if cut is None else bool(cut),
            )
        )
        out["evo_excluded"] = float(reason is not None)
        out["evo_exclusion"] = reason or ""
    return out
