"""Tool calls in verl's `hermes` format (`<tool_call>{"name", "arguments"}</tool_call>`, the
default `multi_turn.format` of its tool agent loop), read from decoded text.

Its own module, with nothing but the standard library: verl's reward workers import it
(backends/verl_reward.py), and the ingest reads V1 train dumps, which keep no reward extra,
with it.
"""

from __future__ import annotations

import json
import re

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


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
