"""The `score` planner: the control arm. Hill-climbing on Avg@k alone.

It reads the lineage's verdicts and Avg@k deltas and nothing else — no diagnosis, no alerts,
no skills, no backtests — and proposes one recipe move at a time from the frontier:

1. An untrained root without children is trained as is (the same first step as `rules`,
   so both arms start from the same reference).
2. Otherwise, one move over the score-only search space (steps, lr, temperature, group size,
   length budget). The move that produced the frontier is repeated first (hill-climbing
   momentum); then the other moves in a fixed order, never a move already tried from the
   frontier.

Paired with the `score-only` harness revision (no alerts, a gate on the CI alone) it is the
plain score-driven loop the method claims rollout-level diagnosis beats: `bench/autonomy.py`
runs both under the same step budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evotrainer.agent.planners.base import PlannerResult, Proposal, View, overrides_key


@dataclass(frozen=True)
class Move:
    """One step in the search space: a name and the settings it gives a recipe (and whether
    the frontier's policy is recorded, so the move may continue it)."""

    name: str
    describe: str
    settings: Callable[[dict[str, Any], bool], list[str]]


def _grpo(recipe: dict[str, Any], key: str) -> Any:
    return recipe["grpo"][key]


def _more_steps(recipe: dict[str, Any], continues: bool) -> list[str]:
    """Twice the training: the frontier's steps again on top of its recorded policy, or
    twice its steps from the base when there is none to continue."""
    steps = _grpo(recipe, "steps")
    return ['model.init="parent"', f"grpo.steps={steps}"] if continues \
        else [f"grpo.steps={2 * steps}"]


MOVES: tuple[Move, ...] = (
    Move("steps_up", "twice the GRPO steps", _more_steps),
    Move("lr_up", "twice the learning rate",
         lambda r, _: [f"grpo.lr={2 * _grpo(r, 'lr'):.3g}"]),
    Move("lr_down", "half the learning rate",
         lambda r, _: [f"grpo.lr={_grpo(r, 'lr') / 2:.3g}"]),
    Move("temperature_up", "a hotter sampling temperature (+0.3)",
         lambda r, _: [f"grpo.temperature={round(_grpo(r, 'temperature') + 0.3, 2)}"]),
    Move("group_up", "twice the group size",
         lambda r, _: [f"grpo.group_size={2 * _grpo(r, 'group_size')}"]),
    Move("length_up", "twice the response length budget",
         lambda r, _: [f"grpo.max_response_tokens={2 * _grpo(r, 'max_response_tokens')}"]),
    Move("temperature_down", "a colder sampling temperature (-0.3)",
         lambda r, _: [f"grpo.temperature={max(0.1, round(_grpo(r, 'temperature') - 0.3, 2))}"]),
)
MOVES_BY_NAME = {m.name: m for m in MOVES}


class ScorePlanner:
    name = "score"

    def propose(self, view: View, max_proposals: int) -> PlannerResult:
        result = PlannerResult()
        frontier = view.frontier()
        state = view.states[frontier]
        meta = {"planner": "score", "tokens": 0, "frontier": frontier}
        score = _avg(view, frontier)
        at = f"{frontier} (Avg@k {score:.3f})" if score is not None else frontier
        if state.spec.get("train") is False and not view.children(frontier):
            steps = view.ws.resolved_recipe(frontier, view.states)["grpo"]["steps"]
            result.proposals.append(Proposal(
                frontier,
                f"Score-only: {frontier} is untrained; train its recipe as is ({steps} GRPO "
                "steps) to get a score to climb from.",
                hypothesis=f"If the recipe is trained, then Avg@k rises over {frontier}.",
                criterion="delta >= 0.0",
                proposal={**meta, "move": "train"},
            ))
            return result
        recipe = view.ws.resolved_recipe(frontier, view.states)
        tried = view.tried_overrides(frontier)
        continues = view.has_policy(frontier)
        for move in self._order(view, frontier):
            if len(result.proposals) >= max_proposals:
                break
            settings = move.settings(recipe, continues)
            overrides = overrides_key(settings)
            if overrides in tried:
                continue
            tried.add(overrides)
            result.proposals.append(Proposal(
                frontier,
                f"Score-only hill-climbing from the frontier {at}: try {move.describe} "
                f"({', '.join(settings)}).",
                settings=settings,
                hypothesis=f"If {frontier} trains with {move.describe}, then Avg@k rises.",
                criterion="delta >= 0.0",
                proposal={**meta, "move": move.name},
            ))
        if not result.proposals:
            result.notes.append(f"every score-only move from {frontier} was tried")
        return result

    def _order(self, view: View, frontier: str) -> list[Move]:
        """The move that made the frontier first (momentum), then the rest in order."""
        spec = view.states[frontier].spec or {}
        last = MOVES_BY_NAME.get((spec.get("proposal") or {}).get("move"))
        return [last, *(m for m in MOVES if m is not last)] if last else list(MOVES)


def _avg(view: View, name: str) -> float | None:
    """The version's final validation Avg@k as its run recorded it: the only number this
    planner reads."""
    run = view.states[name].records.get("run") or {}
    value = (run.get("result") or {}).get("val_avg")
    return value if isinstance(value, (int, float)) else None
