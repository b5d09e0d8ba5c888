"""Evidence before moving on: an inconclusive gain gets a second seed before a new factor.

A version the gate left inconclusive with its interval straddling zero and a positive point
estimate — "insufficient evidence", or "mixed evidence" (its pathology gone) — is a gain not
yet shown, not a refutation. Moving to a new factor then stacks an untested change on an
unmeasured one; the paper's trainer would rather make the ambiguous outcome decide. So the
rules planner first proposes the same version with one more seed: a child of it that sets
`seeds` to its seeds plus the next one, everything else inherited, so the child repeats its
training and the gate pools the seeds (stats.compare_tables resamples tasks, then seeds
within each task). The child's parent is not on main, so the gate decides it against main's
frontier (gate.replaced_frontier): the pooled evidence for the fix against what main holds.

A longer evaluation is the other way to more evidence; the engine evaluates only at the end
of training, so it costs a training run too, and a seed measures more (the seed spread the
method warns of, not only the sampling noise of one policy). The planner names the choice and
the reason in the rationale, and proposes it only when:

- the version's interval (against main's frontier when the gate decided it so, else against
  its parent) holds zero and its point estimate is positive and at least half the interval's
  half-width: a negative estimate inside the noise leans towards no gain, and a small one
  would stay inside an interval a second seed narrows by about √2, so another seed would
  more likely confirm the doubt than turn it;
- the version trains from the base (a continuation of its parent's policy cannot be rerun on
  another seed: its parent has no policy for that seed), and is not itself such a rerun (one
  round of evidence per version: then the planner moves on, whatever it showed);
- no child of it already gathers that evidence, and `autonomy.max_total_steps` leaves room
  for the rerun's steps (every seed trains).
"""

from __future__ import annotations

import json
from typing import Any

from evotrainer.agent.planners.base import Proposal, View
from evotrainer.gate.outcomes import INSUFFICIENT, MIXED
from evotrainer.store.checkpoints import init_mode

EVIDENCE = "evidence"  # proposal.move of a rerun that gathers evidence
# The point estimate, as a share of the interval's half-width, from which one more seed may
# decide: pooling a second seed narrows the interval by about √2 where the seed spread
# dominates, so an estimate under half the half-width would most likely stay inside it.
POWER = 0.5


def deciding_comparison(view: View, name: str) -> tuple[str, dict[str, Any]] | None:
    """(the version it was decided against, that comparison): main's frontier where the gate
    decided against it (`against_main`), else the parent."""
    decision = view.states[name].records.get("decision") or {}
    main = decision.get("against_main") or {}
    if main.get("comparison"):
        return main["version"], main["comparison"]
    if decision.get("comparison"):
        return view.states[name].parent or "", decision["comparison"]
    return None


def steps_spent(view: View) -> int:
    """Training steps of every recorded run (every seed and attempt): the budget's unit."""
    return sum(s.run.steps_spent for s in view.states.values() if s.run is not None)


def ambiguous(view: View, name: str) -> str | None:
    """Why `name`'s outcome calls for more evidence (None when it does not)."""
    if view.verdict(name) != "inconclusive" or name in view.pruned:
        return None
    if view.outcome(name) not in (INSUFFICIENT, MIXED):
        return None
    decided = deciding_comparison(view, name)
    if decided is None:
        return None
    against, comparison = decided
    low, high, delta = comparison["ci_low"], comparison["ci_high"], comparison["delta"]
    if not (low <= 0.0 <= high) or delta <= 0.0:
        return None
    if delta < POWER * (high - low) / 2:
        return None  # a second seed narrows the interval by about √2: it cannot turn this
    kind = view.outcome(name).replace("_", " ")
    return (f"{name} is inconclusive against {against} with a positive point estimate "
            f"(Δ {delta:+.4f}, CI [{low:+.4f}, {high:+.4f}]; {kind})")


def proposals(view: View, base: str, frontier: str, notes: list[str]) -> list[Proposal]:
    """The evidence reruns the planner may propose from `base` (the frontier, or the
    mixed-evidence version it builds on) and the frontier's other decided children, latest
    first; what was considered and declined goes to `notes`."""
    candidates = [base] if base != frontier else []
    candidates += [c for c in reversed(view.decided_order())
                   if view.states[c].parent == frontier and c != base]
    out = []
    for name in candidates:
        why = ambiguous(view, name)
        if why is None:
            continue
        proposal = _rerun(view, name, why, notes)
        if proposal is not None:
            out.append(proposal)
    return out


def _rerun(view: View, name: str, why: str, notes: list[str]) -> Proposal | None:
    state = view.states[name]
    meta = state.spec.get("proposal") or {}
    if meta.get("move") == EVIDENCE:
        notes.append(f"no more evidence for {name}: it is itself a rerun for evidence on "
                     f"{meta.get('evidence_for')}; moving on")
        return None
    if any((view.states[c].spec.get("proposal") or {}).get("evidence_for") == name
           for c in view.children(name)):
        return None  # its rerun is proposed or decided already
    recipe = view.ws.resolved_recipe(name, view.states)
    if init_mode(recipe) == "parent":
        notes.append(f"no second seed for {name}: it continues its parent's policy, which "
                     "has no policy for another seed")
        return None
    seeds = list(recipe.get("seeds") or [0])
    pooled = [*seeds, max(seeds) + 1]
    cost = int(recipe["grpo"]["steps"]) * len(pooled)
    budget = view.autonomy.get("max_total_steps")
    spent = steps_spent(view)
    if budget is not None and spent + cost > int(budget):
        notes.append(f"no second seed for {name}: {cost} steps would pass "
                     f"autonomy.max_total_steps ({spent} of {budget} spent)")
        return None
    rationale = (
        f"Evidence before moving on: {why}. A gain not yet shown is not refuted, and a new "
        f"factor on top of it would leave both unmeasured, so {name} is trained again on "
        f"seeds {pooled} (every other setting its own) and the gate pools the seeds. A second "
        "seed rather than a longer evaluation: the engine evaluates at the end of training, "
        "so either costs a run, and a seed also measures the seed spread, which one "
        f"evaluation of one policy cannot. Cost: {cost} steps.")
    return Proposal(
        name, rationale, settings=[f"seeds={json.dumps(pooled)}"],
        hypothesis=f"If {name} is trained on seeds {pooled}, then its gain holds with the "
        "seeds pooled and the interval leaves zero, because the point estimate was positive "
        "and only the noise kept it inconclusive.",
        criterion="delta >= 0.0",
        proposal={"planner": "rules", "tokens": 0, "frontier": view.frontier(),
                  "move": EVIDENCE, "evidence_for": name, "evidence": "second_seed",
                  "seeds": pooled, "steps": cost})
