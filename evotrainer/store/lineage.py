"""The lineage: every version with its parent, state, score and verdict, from git alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from evotrainer.store.clock import now_iso
from evotrainer.store.git import PRUNED_TAG_PREFIX
from evotrainer.store.recipe import copy_tree
from evotrainer.store.workspace import VersionState, Workspace


@dataclass(frozen=True)
class Spend:
    """What a version has cost: training steps, wall-clock and GPU hours of its runs (every
    attempt; a running job's until now) and the planner's tokens for its proposal. The
    autonomy budgets count these units (max_total_steps, max_gpu_hours, max_llm_tokens)."""

    steps: int = 0
    wall_hours: float = 0.0
    gpu_hours: float = 0.0
    planner_tokens: int = 0

    def __bool__(self) -> bool:
        return any((self.steps, self.wall_hours, self.gpu_hours, self.planner_tokens))

    def text(self) -> str:
        """`120 steps, 0.42 h, 0.84 GPU-h, 3100 tokens` (the units it spent)."""
        parts = [f"{self.steps} steps"] if self.steps else []
        if self.wall_hours:
            parts.append(f"{self.wall_hours:.3g} h")
        if self.gpu_hours:
            parts.append(f"{self.gpu_hours:.3g} GPU-h")
        if self.planner_tokens:
            parts.append(f"{self.planner_tokens} tokens")
        return ", ".join(parts)


def proposal_tokens(state: VersionState) -> tuple[int, int]:
    """(input, output) tokens the planner spent proposing the version (0, 0 for none)."""
    proposal = (state.spec or {}).get("proposal")
    tokens = (proposal.get("tokens") if isinstance(proposal, dict) else None) or {}
    if not isinstance(tokens, dict):
        return 0, 0
    return _count(tokens.get("input")), _count(tokens.get("output"))


def _count(value: object) -> int:
    # A spec `validate` refuses is still listed: a count of the wrong type counts nothing.
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def spend_of(state: VersionState, now: str | None = None) -> Spend:
    """The version's spend as its records say, a running job's hours until `now`."""
    run = state.run
    now = now or now_iso()
    return Spend(
        steps=run.steps_spent if run else 0,
        wall_hours=run.wall_hours_spent(now) if run else 0.0,
        gpu_hours=run.gpu_hours_spent(now) if run else 0.0,
        planner_tokens=sum(proposal_tokens(state)),
    )


@dataclass
class LineageRow:
    name: str
    parent: str | None
    # proposed | approved | stale (approved, then changed) | Pending | Running | Failed |
    # Succeeded | <verdict>
    status: str
    score: float | None  # final val avg@k
    # The gate's interval and difference against `against` (the parent, or main's frontier
    # where the gate decided against it), and that version's mean
    ci: tuple[float, float] | None
    delta: float | None
    verdict: str | None
    alerts: list[str]
    pruned: bool
    on_main: bool
    # an early stop: {rule, alert, step, steps, ...} of the Stopped run (its verdict: prune)
    stopped: dict | None = None
    spend: Spend = field(default_factory=Spend)
    against: str | None = None
    against_mean: float | None = None
    confidence: float | None = None  # the interval's, as recorded (higher under a correction)

    def as_dict(self) -> dict:
        """The row as `dataclasses.asdict` gives it (the spend a mapping, every list and
        mapping a copy), built field by field: asdict's deep copy of each value cost a
        lineage of thousands a tenth of a second."""
        return {**vars(self), "ci": None if self.ci is None else tuple(self.ci),
                "alerts": list(self.alerts), "stopped": copy_tree(self.stopped),
                "spend": dict(vars(self.spend))}


def status_of(state: VersionState, approval: str | None = None) -> str:
    """`approval` is `Workspace.approval_status` (only an approval that holds counts)."""
    if state.unverified:  # records this reader cannot check are shown as nothing
        return "unverified"
    decision, run = state.decision, state.run
    if decision is not None and decision.verdict:
        return decision.verdict
    if run is not None:
        return run.state
    approval = approval or ("approved" if state.approved else "unapproved")
    return {"approved": "approved", "stale": "stale"}.get(approval, "proposed")


def merged_into_main(ws: Workspace) -> set[str]:
    """Versions whose branch tip main contains (one git call for all of them); none while
    main does not exist. The one definition of "on main": planners, reconcile, retention and
    the report all read it from here."""
    if ws.git.rev("refs/heads/main") is None:
        return set()
    return ws.git.merged_versions("refs/heads/main")


def main_frontier(states: dict[str, VersionState], on_main: set[str]) -> str | None:
    """The policy main stands for: its latest promotion, else its baseline (a root on main
    with a verdict); None while main holds neither. `on_main` is `merged_into_main`."""
    merged = on_main & states.keys()
    promoted = [(states[n].decision.decided_at, n) for n in merged
                if verdict_of(states[n]) == "promote"]
    if promoted:
        return max(promoted)[1]
    return min((n for n in merged if states[n].parent is None and verdict_of(states[n])),
               default=None)


def verdict_of(state: VersionState) -> str | None:
    decision = state.decision
    return (decision.verdict or None) if decision else None  # "": a record without one


def lineage_rows(ws: Workspace, states: dict[str, VersionState] | None = None) -> list[LineageRow]:
    states = states if states is not None else ws.versions()
    pruned = set(ws.git.tags(PRUNED_TAG_PREFIX))
    on_main = merged_into_main(ws)
    now = now_iso()  # one clock reading: every running job's hours until the same moment
    rows = []
    for name in tree_order(states):
        state = states[name]
        decision, run, diagnosis = state.decision, state.run, state.diagnosis
        against, comparison = decision.deciding_comparison if decision else (None, {})
        score = comparison.get("mean_b", run.result.get("val_avg") if run else None)
        ci = (comparison["ci_low"], comparison["ci_high"]) if "ci_low" in comparison else None
        rows.append(LineageRow(
            name=name, parent=state.parent,
            status=status_of(state, ws.approval_status(state, states) if state.spec else None),
            score=score, ci=ci,
            delta=comparison.get("delta"), verdict=decision.verdict if decision else None,
            alerts=[a.get("name", "?") for a in diagnosis.alerts] if diagnosis else [],
            pruned=name in pruned,
            on_main=name in on_main,
            stopped=run.stopped if run else None,
            spend=spend_of(state, now),
            against=against or (state.parent if comparison else None),
            against_mean=comparison.get("mean_a"),
            confidence=comparison.get("confidence"),
        ))
    return rows


def stop_progress(stop: dict) -> str:
    """`step 8 of 200` from an early stop."""
    return f"step {stop.get('step')} of {stop.get('steps', '?')}"


def stopped_text(stop: dict | None) -> str:
    """How a stopped run is shown: `stopped early by alert leak at step 8 of 200`."""
    if not stop:
        return "stopped early"
    by = f"alert {stop['alert']}" if stop.get("alert") else f"rule {stop.get('rule')}"
    return f"stopped early by {by} at {stop_progress(stop)}"


def tree_order(states: dict[str, VersionState]) -> list[str]:
    """Depth-first from the roots, children in name order; orphans (broken parents) last."""
    children: dict[str | None, list[str]] = {}
    for name, state in states.items():
        parent = state.parent if state.parent in states else None
        children.setdefault(parent, []).append(name)
    order: list[str] = []
    stack = sorted(children.get(None, []), key=_natural, reverse=True)
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        order.append(name)
        stack.extend(sorted(children.get(name, []), key=_natural, reverse=True))
    return order + sorted(set(states) - seen, key=_natural)


def _natural(name: str) -> tuple:
    """v2 before v10."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1, name)
