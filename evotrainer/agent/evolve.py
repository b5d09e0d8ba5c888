"""`evolve`: the outer loop — reconcile, propose, approve, reconcile — for N rounds.

Approval follows the project's autonomy: with `mode: auto` reconcile approves proposals
itself while `max_total_steps` allows; with `human_gated` the loop stops and says what to
approve, unless the human approved this run's proposals up front (`--approve`, still
within `max_total_steps`). An escalation (too many failed versions in a row) always goes
back to a human, as the method's gates do. The whole loop holds the workspace lock, so no
other reconcile interleaves with it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from evotrainer.agent.planners.base import PlannerResult
from evotrainer.agent.propose import get_planner, propose
from evotrainer.backends import Backends
from evotrainer.backends.base import Backend
from evotrainer.control.reconcile import Reconciler, VersionPlan, load_context, within_budget
from evotrainer.control.versions import approve
from evotrainer.store.lineage import LineageRow, lineage_rows
from evotrainer.store.lock import workspace_lock
from evotrainer.store.workspace import Workspace

APPROVER = "evotrainer evolve --approve"


@dataclass
class Round:
    number: int
    result: PlannerResult
    approved: list[str] = field(default_factory=list)
    outcomes: list[LineageRow] = field(default_factory=list)  # the proposals after reconcile
    stop: str | None = None  # why the loop ends after this round

    @property
    def proposed(self) -> list[str]:
        return [p.name for p in self.result.proposals if p.name]


def evolve(
    ws: Workspace,
    rounds: int,
    *,
    planner: str | None = None,
    approve_all: bool = False,
    max_proposals: int = 1,
    backends: Backends | Mapping[str, Backend] | None = None,
    log: Callable[[str], None] = print,
    on_proposed: Callable[[Round], None] | None = None,
    on_round: Callable[[Round], None] | None = None,
    on_wait: Callable[[list[VersionPlan]], None] | None = None,
    poll_s: float = 2.0,
) -> list[Round]:
    """`on_proposed` sees each round once its proposals are written and approved (before they
    train), `on_round` once they have trained and been gated."""
    if planner is not None:
        get_planner(planner)  # an unknown name is refused before anything trains
    mode = (ws.project.get("autonomy") or {}).get("mode", "human_gated")
    done: list[Round] = []
    command = " ".join(["evotrainer", *sys.argv[1:]]) if sys.argv[1:] else "evotrainer evolve"
    with workspace_lock(ws.state_dir / "lock", command):
        reconciler = Reconciler(ws, log=log, backends=backends)
        backends = reconciler.backends
        reconciler.run(wait=True, poll_s=poll_s, on_wait=on_wait)
        for number in range(1, rounds + 1):
            current = Round(number, propose(ws, planner, max_proposals))
            done.append(current)
            current.stop = _approve(ws, current, mode, approve_all, backends)
            if on_proposed:
                on_proposed(current)
            if current.approved:
                reconciler.run(wait=True, poll_s=poll_s, on_wait=on_wait)
                rows = {r.name: r for r in lineage_rows(ws)}
                current.outcomes = [rows[n] for n in current.approved if n in rows]
            if on_round:
                on_round(current)
            if current.stop:
                break
    return done


def _approve(
    ws: Workspace, current: Round, mode: str, approve_all: bool, backends: Backends
) -> str | None:
    """Approve what autonomy allows; return why the loop must stop, if it must."""
    names = current.proposed
    if not names:
        return "the planner proposed nothing (see its notes)"
    escalated = [p.name for p in current.result.proposals if p.proposal.get("escalation")]
    if escalated:
        return (f"escalation: review {', '.join(escalated)} by hand "
                f"(evotrainer approve {escalated[0]})")
    waiting = []
    for name in names:
        ctx = load_context(ws, backends)
        if not within_budget(ctx, ctx.states[name]):
            waiting.append(name)
        elif mode == "auto":
            current.approved.append(name)  # reconcile approves it ("evotrainer autonomy")
        elif approve_all:
            approve(ws, name, by=APPROVER)
            current.approved.append(name)
        else:
            waiting.append(name)
    if not waiting:
        return None
    if mode == "auto" or approve_all:
        return (f"autonomy.max_total_steps would be exceeded by {', '.join(waiting)}: "
                f"approve by hand (evotrainer approve {waiting[0]}) or raise the budget")
    return (f"autonomy is human_gated: review and approve {', '.join(waiting)} "
            f"(evotrainer approve {waiting[0]}), or rerun with --approve")
