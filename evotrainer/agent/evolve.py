"""`evolve`: the outer loop — reconcile, propose, approve, reconcile — for N rounds.

Approval follows the project's autonomy: with `mode: auto` reconcile approves proposals
itself while `max_total_steps` allows; with `human_gated` the loop stops and says what to
approve, unless the human approved this run's proposals up front (`--approve`, still
within `max_total_steps`). An escalation (too many failed versions in a row) always goes
back to a human, as the method's gates do. The whole loop holds the workspace lock, so no
other reconcile interleaves with it.

Harness revisions the planner proposes follow the same approval: under `mode: auto` or
`--approve` the loop adopts one the way a reviewer would — only when its backtest flips no
recorded verdict (its cases are the recorded verdicts; `adopt_harness` re-runs them) — as its
own commit (Action: adopt-harness), before the round's versions train, so the revision
diagnoses them; otherwise the loop stops and says what to adopt. A revision whose backtest
fails stays on main for a human and the loop goes on without it. When the planner proposed
no version beside the revision it drafted, reconcile diagnoses the recorded versions again
under the adopted revision and the planner runs once more: the revision sees what the
recorded diagnoses could not, so the round does not stop with nothing to try.
`harness_evolution=False` (`--no-harness-evolution`) keeps the harness in force as it is.

After a promotion of a version that applied no library skill (a settings change, an LLM
planner's proposal), the loop proposes it as a skill on `skill/<name>` for review
(agent/skill_creation.py); a refusal is logged, never fatal. A rerun for evidence (its
parent on more seeds, planners/evidence.py) changes nothing to generalise and is skipped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from evotrainer.agent.planners.base import PlannerResult
from evotrainer.agent.propose import get_planner, propose
from evotrainer.agent.skill_creation import propose_skill
from evotrainer.backends import Backends
from evotrainer.backends.base import Backend
from evotrainer.control.reconcile import Reconciler, VersionPlan, load_context, within_budget
from evotrainer.control.versions import approve
from evotrainer.errors import EvoError
from evotrainer.gate.harness_backtest import adopt_harness
from evotrainer.store.lineage import LineageRow, lineage_rows
from evotrainer.store.lock import workspace_lock
from evotrainer.store.workspace import Workspace

APPROVER = "evotrainer evolve --approve"


@dataclass
class Round:
    number: int
    result: PlannerResult
    approved: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)  # harness revisions put in force
    skills_proposed: list[str] = field(default_factory=list)  # skill/<name> branches
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
    harness_evolution: bool = True,
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
        # Promotions recorded before the loop are a human's to turn into skills; the loop
        # offers the ones it sees happen (a hand-made version it trained included).
        offered = _promoted(ws)
        reconciler.run(wait=True, poll_s=poll_s, on_wait=on_wait)
        for number in range(1, rounds + 1):
            current = Round(number, propose(ws, planner, max_proposals,
                                            harness_evolution=harness_evolution))
            done.append(current)
            adoption = _adopt(ws, current, mode == "auto" or approve_all, log)
            if current.adopted and not current.proposed:
                # Reconcile diagnoses the recorded versions again under the adopted revision.
                reconciler.run(wait=True, poll_s=poll_s, on_wait=on_wait)
                _plan_again(ws, current, planner, max_proposals, log)
            current.stop = _approve(ws, current, mode, approve_all, backends)
            if adoption:
                current.stop = f"{current.stop}; {adoption}" if current.stop else adoption
            if on_proposed:
                on_proposed(current)
            if current.approved:
                reconciler.run(wait=True, poll_s=poll_s, on_wait=on_wait)
                rows = {r.name: r for r in lineage_rows(ws)}
                current.outcomes = [rows[n] for n in current.approved if n in rows]
                current.skills_proposed = _propose_skills(ws, offered, log)
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


def _adopt(ws: Workspace, current: Round, allowed: bool, log: Callable[[str], None]
           ) -> str | None:
    """Adopt the round's harness revisions when autonomy allows; return what a human must
    adopt when it does not."""
    names = [h.name for h in current.result.harness]
    if not names:
        return None
    if not allowed:
        return (f"review harness revision {', '.join(names)} and adopt it "
                f"(evotrainer harness adopt {names[0]}), or rerun with --approve")
    for name in names:
        try:
            report = adopt_harness(ws, name)  # re-runs the backtest; refuses a flipped case
        except EvoError as err:
            log(f"harness {name} not adopted: {err.message}; it stays on main for review")
            continue
        current.adopted.append(name)
        log(f"adopted harness {name}: backtest cases {len(report['cases'])}/"
            f"{len(report['cases'])} pass, versions that change: "
            f"{', '.join(report['changed']) or 'none'}")
    return None


def _plan_again(ws: Workspace, current: Round, planner: str | None, max_proposals: int,
                log: Callable[[str], None]) -> None:
    """Plan once more, on the evidence diagnosed again under the revision just adopted (no
    second revision this round); the round keeps that revision and both plannings' notes."""
    log(f"nothing proposed beside harness {current.adopted[-1]}: planning again on the "
        "evidence diagnosed under it")
    again = propose(ws, planner, max_proposals, harness_evolution=False)
    current.result = PlannerResult(
        proposals=again.proposals, harness=current.result.harness,
        notes=current.result.notes + again.notes, tokens=current.result.tokens + again.tokens,
    )


def _promoted(ws: Workspace) -> set[str]:
    return {n for n, s in ws.versions().items()
            if (s.records.get("decision") or {}).get("verdict") == "promote"}


def _propose_skills(ws: Workspace, offered: set[str], log: Callable[[str], None]
                    ) -> list[str]:
    """Propose each version promoted since the loop began (and not yet offered) that applied
    no library skill as a new skill; one the library already describes, or that cannot be a
    skill (no alert motivated it), is logged and skipped: the loop goes on."""
    states = ws.versions()
    branches = []
    for name in sorted(_promoted(ws) - offered):
        offered.add(name)
        if ((states[name].spec or {}).get("intervention") or {}).get("skills"):
            continue  # its evidence goes on the library skills it applied (reconcile)
        rerun = (states[name].spec or {}).get("proposal") or {}
        if rerun.get("move") == "evidence":
            # More seeds of its parent: no intervention of its own to generalise.
            log(f"no skill proposed from {name}: it reruns {rerun.get('evidence_for')} on "
                "more seeds for evidence, an intervention of none")
            continue
        try:
            branches.append(propose_skill(ws, name)["branch"])
        except EvoError as err:
            log(f"no skill proposed from {name}: {err.message}")
    return branches
