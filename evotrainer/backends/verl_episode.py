"""EvoTrainer's multi-turn domains (toolenv, swe) as verl 0.9.1 tool calls, without verl.

verl's tool agent loop asks the model for OpenAI-style function calls (`hermes` format) and
runs each through a `BaseTool` (verl_tools.py). Here is everything that needs no verl: each
domain's tools as OpenAI function schemas with the domain action each call stands for, the
episode that steps the domain's own environment with those actions (the same environment the
embedded engine steps, so enabled tools, the leak, memoized repositories and the recorded
calls are the engine's), the tool config YAML verl loads, and the per-row `tools_kwargs`
that tell a tool which task its trajectory is on.

An episode records what it ran in the trajectory's `extra_fields` (`EPISODE_FIELD`): verl
hands those to the reward function in `extra_info`, so the reward scores the calls that
really ran, in the domain's own transcript format, not a re-parse of the decoded text.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from evotrainer.domains import Domain, Environment, Task, get_domain, make_domain
from evotrainer.errors import EvoError

EPISODE_FIELD = "evo_episode"
TOOL_CLASS = "evotrainer.backends.verl_tools.EvoDomainTool"
OVER = "The episode is over: answer without calling a tool."


@dataclass(frozen=True)
class ToolSpec:
    """One tool the model may call: its description, its arguments (name → JSON type,
    description) and the domain action a call with those arguments is."""

    description: str
    arguments: dict[str, tuple[str, str]]
    action: Callable[[dict[str, Any]], str]

    def schema(self, name: str) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        arg: {"type": kind, "description": text}
                        for arg, (kind, text) in self.arguments.items()
                    },
                    "required": list(self.arguments),
                },
            },
        }


def _text(arguments: dict[str, Any], key: str) -> str:
    return str(arguments.get(key, ""))


# Each domain's tools. The domain's environment parses the action text exactly as it parses
# the engine's, so a malformed argument becomes the domain's own `invalid` call.
DOMAIN_TOOLS: dict[str, dict[str, ToolSpec]] = {
    "toolenv": {
        "compare": ToolSpec(
            "Compare the hidden number with a guess: the reply is < (the hidden number is "
            "smaller), > (larger) or = (found).",
            {"guess": ("integer", "the number to compare with")},
            lambda a: f"?{_text(a, 'guess')}",
        ),
        "reveal": ToolSpec("Reveal the hidden number.", {}, lambda a: "!"),
        "answer": ToolSpec(
            "Give the final answer; this ends the episode.",
            {"number": ("integer", "the hidden number")},
            lambda a: f"={_text(a, 'number')}",
        ),
    },
    "swe": {
        "shell": ToolSpec(
            "Run a shell command (/bin/sh) in the repository.",
            {"command": ("string", "the command line")},
            lambda a: f"$ {_text(a, 'command')}",
        ),
        "write": ToolSpec(
            "Write a file in the repository.",
            {"path": ("string", "the file's path"), "content": ("string", "its full content")},
            lambda a: f"write {_text(a, 'path')}\n{_text(a, 'content')}",
        ),
        "patch": ToolSpec(
            "Apply a unified diff to the repository with git apply.",
            {"diff": ("string", "the unified diff")},
            lambda a: f"patch\n{_text(a, 'diff')}",
        ),
        "submit": ToolSpec("Submit the repository as it is; this ends the episode.", {},
                           lambda a: "submit"),
    },
}
# SWE-rebench instances are episodes of the same tools.
DOMAIN_TOOLS["swe_rebench"] = DOMAIN_TOOLS["swe"]
# The code interpreter: the final answer is the model's own text after its calls (no tool).
DOMAIN_TOOLS["math_tool"] = {
    "python": ToolSpec(
        "Run a Python 3 program (standard library, sympy, mpmath; no files, no network); "
        "the reply is what it prints, or its error. Each call runs alone: print the result.",
        {"code": ("string", "the whole program")},
        lambda a: f"```python\n{_text(a, 'code')}\n```",
    ),
}


def domain_tools(domain_name: str) -> dict[str, ToolSpec]:
    """The verl tools of a multi-turn domain (EvoError for a domain verl cannot run)."""
    if domain_name not in DOMAIN_TOOLS:
        raise EvoError(
            f"domain {domain_name!r} has no verl tools",
            field="domain.name",
            hint=f"multi-turn domains with verl tools: {', '.join(DOMAIN_TOOLS)}",
        )
    return DOMAIN_TOOLS[domain_name]


def tool_config(domain_config: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    """verl's tool config (`multi_turn.tool_config_path`): one EvoDomainTool per tool of the
    domain, each carrying the domain and environment config. Every tool is listed, disabled
    ones too: as in the engine, the environment answers a disabled tool and records the call
    as `unavailable`, so the attempt stays visible in the tool mix."""
    config = {"type": "native", "domain": domain_config, "environment": environment}
    return {
        "tools": [
            {"class_name": TOOL_CLASS, "config": config, "tool_schema": spec.schema(name)}
            for name, spec in domain_tools(domain_config["name"]).items()
        ]
    }


# Room beyond a domain's own cap on an observation: its wrapping newlines and an
# "[exit status N]" line (swe), or a whole short reply (toolenv's, and OVER).
_REPLY_MARGIN = 64


def max_tool_reply(domain_config: dict[str, Any]) -> int:
    """verl's `multi_turn.max_tool_response_length` for the domain's tools: verl cuts longer
    replies (256 characters by default), so the longest observation the domain writes must
    fit, or the policy would see less on verl than in the engine."""
    params = {**get_domain(domain_config["name"]).default_params,
              **(domain_config.get("params") or {})}
    return int(params.get("max_observation_chars") or 0) + _REPLY_MARGIN


def task_record(task: Task) -> str:
    """A task as text, for a dataset row's `tools_kwargs` (every tool gets the same)."""
    return json.dumps(
        {
            "task_id": task.task_id,
            "prompt": task.prompt,
            "answer": task.answer,
            "data_source": task.data_source,
            "meta": task.meta,
        },
        sort_keys=True,
    )


def tools_kwargs(domain_name: str, task: Task) -> dict[str, Any]:
    """`extra_info.tools_kwargs` of a dataset row: verl hands it to the trajectory's tools."""
    record = task_record(task)
    return {name: {"create_kwargs": {"task": record}} for name in domain_tools(domain_name)}


@cache
def shared_domain(config_json: str) -> Domain:
    """One domain per config in a process: every tool of a worker shares it (and its
    memoized repositories)."""
    return make_domain(json.loads(config_json))


class Episode:
    """One trajectory's environment, stepped by tool calls. `record()` is what the reward
    function scores: the calls the environment recorded, the transcript in the domain's own
    format (what the engine would have produced for the same actions) and the actions taken."""

    def __init__(self, domain: Domain, task: Task, environment: dict[str, Any]) -> None:
        self.domain, self.task = domain, task
        self.env: Environment = domain.environment(task, environment)
        self.tool_calls: list[dict[str, str]] = []
        self.transcript = ""
        self.actions = 0
        self.done = False
        # verl may run one turn's calls together (multi_turn.max_parallel_calls > 1): one at a
        # time here, in the order they arrive, as the engine steps its environment.
        self.lock = threading.Lock()

    def call(self, tool: str, arguments: dict[str, Any]) -> str:
        """Run one tool call; the observation the model sees."""
        with self.lock:
            if self.done:
                return OVER
            action = domain_tools(self.domain.name)[tool].action(arguments)
            step = self.env.step(action)
            self.actions += 1
            self.transcript += action + (self.domain.turn_end or "") + step.observation
            if step.tool_call is not None:
                self.tool_calls.append(dict(step.tool_call))
            self.done = step.done
            return step.observation

    def record(self) -> dict[str, Any]:
        with self.lock:
            return {
                "tool_calls": list(self.tool_calls),
                "transcript": self.transcript,
                "turns": self.actions,
                "done": self.done,
            }

    def close(self) -> None:
        closer = getattr(self.env, "close", None)
        if closer is not None:
            closer()


def task_from_record(record: str) -> Task:
    data = json.loads(record)
    return Task(data["task_id"], data["prompt"], data["answer"], data["data_source"],
                data.get("meta") or {})
