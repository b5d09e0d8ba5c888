"""Choose a planner by name and write what it proposes: the one entry point of the agent."""

from __future__ import annotations

from evotrainer.agent.planners.base import PLANNERS, Planner, PlannerResult, View, write_proposals
from evotrainer.errors import EvoError
from evotrainer.store.workspace import Workspace


def get_planner(name: str, *, harness_evolution: bool = True) -> Planner:
    """`harness_evolution=False`: the planner proposes policy versions only (the rules
    planner still notes the gaps it sees, so a run says what a revision would have answered)."""
    if name == "rules":
        from evotrainer.agent.planners.rules import RulesPlanner

        return RulesPlanner(harness_evolution=harness_evolution)
    if name == "score":
        from evotrainer.agent.planners.score import ScorePlanner

        return ScorePlanner()
    if name == "anthropic":
        from evotrainer.agent.planners.anthropic import AnthropicPlanner

        return AnthropicPlanner()
    raise EvoError(f"unknown planner {name!r}", field="--planner",
                   hint=f"one of {', '.join(PLANNERS)}")


def propose(ws: Workspace, planner: str | None = None, max_proposals: int = 1, *,
            harness_evolution: bool = True) -> PlannerResult:
    """Run a planner over fresh views of the workspace and write what it proposes. With
    `harness_evolution` off no harness revision is written, whichever planner drafted one."""
    name = planner or (ws.project.get("planner") or {}).get("name", "rules")
    result = get_planner(name, harness_evolution=harness_evolution).propose(
        View.load(ws), max_proposals)
    if not harness_evolution and result.harness:
        result.notes += [f"harness evolution is off: revision {h.name} not written"
                         for h in result.harness]
        result.harness = []
    write_proposals(ws, result)
    return result
