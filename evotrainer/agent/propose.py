"""Choose a planner by name and write what it proposes: the one entry point of the agent."""

from __future__ import annotations

from evotrainer.agent.planners.base import PLANNERS, Planner, PlannerResult, View, write_proposals
from evotrainer.errors import EvoError
from evotrainer.store.workspace import Workspace


def get_planner(name: str) -> Planner:
    if name == "rules":
        from evotrainer.agent.planners.rules import RulesPlanner

        return RulesPlanner()
    if name == "score":
        from evotrainer.agent.planners.score import ScorePlanner

        return ScorePlanner()
    if name == "anthropic":
        from evotrainer.agent.planners.anthropic import AnthropicPlanner

        return AnthropicPlanner()
    raise EvoError(f"unknown planner {name!r}", field="--planner",
                   hint=f"one of {', '.join(PLANNERS)}")


def propose(ws: Workspace, planner: str | None = None, max_proposals: int = 1) -> PlannerResult:
    """Run a planner over fresh views of the workspace and write what it proposes."""
    name = planner or (ws.project.get("planner") or {}).get("name", "rules")
    result = get_planner(name).propose(View.load(ws), max_proposals)
    write_proposals(ws, result)
    return result
