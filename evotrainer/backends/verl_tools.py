"""The verl 0.9.1 `BaseTool` that runs a tool call of an EvoTrainer multi-turn domain.

verl's tool config names this class for every tool of the domain (verl_episode.tool_config);
verl imports it by that dotted name in its agent-loop workers, so evotrainer must be
importable there (as it must be for the reward function). This module imports verl; the
render and everything else use verl_episode, which does not.

verl 0.9.1's tool agent loop calls create → execute → release for every single call, so a
tool instance cannot hold a trajectory's state. The trajectory's `agent_data` (verl's
AgentData, handed to `execute`) can: the episode lives on it as an attribute, and its record
goes into `agent_data.extra_fields`, which verl passes to the reward function's `extra_info`.
An episode that never submits (the turn or length limit) is not closed here: its local
repository is freed with it, and a Docker container removes itself after
`container_lifetime_s`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from evotrainer.backends.verl_episode import EPISODE_FIELD, Episode, shared_domain, task_from_record

_EPISODE_ATTR = "_evotrainer_episode"


class EvoDomainTool(BaseTool):
    """One tool of a domain (its name from the schema); all of a trajectory's tools step the
    one episode kept on its agent_data."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema) -> None:
        super().__init__(config, tool_schema)
        self.domain = shared_domain(json.dumps(config["domain"], sort_keys=True))
        self.environment = dict(config.get("environment") or {})

    def episode(self, agent_data: Any) -> Episode:
        episode = getattr(agent_data, _EPISODE_ATTR, None)
        if episode is None:
            kwargs = agent_data.tools_kwargs[self.name]["create_kwargs"]
            episode = Episode(self.domain, task_from_record(kwargs["task"]), self.environment)
            setattr(agent_data, _EPISODE_ATTR, episode)
        return episode

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        agent_data = kwargs["agent_data"]
        episode = self.episode(agent_data)
        # A swe action runs for seconds in the sandbox: off the agent loop's event loop, which
        # every other trajectory of this worker shares.
        observation = await asyncio.to_thread(episode.call, self.name, parameters)
        agent_data.extra_fields[EPISODE_FIELD] = episode.record()
        if episode.done:
            episode.close()  # a swe container goes at submit, as in the engine
        return ToolResponse(text=observation), 0.0, {}
