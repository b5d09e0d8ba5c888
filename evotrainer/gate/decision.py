"""The promotion gate: a version against its parent on the per-task score tables, judged by
the harness's gate rules over the diagnosis (rules.py). The verdict is written with the
numbers that decided it, so a reviewer reads `decision.yaml` and sees why.

Beside the verdict the decision records the version's outcome (outcomes.py: improvement,
regression, mixed evidence, insufficient evidence) and, when the score moved significantly
with nothing outside the score layer to explain it, the diagnostic gap (diagnosis/gaps.py). The gate
procedure (stats.GateProcedure) may compare the version with the frontier and the root as
well as its parent: a promotion must then hold against each of them, every interval and
p-value corrected for the family.

A version whose parent is not on main (it builds on an inconclusive version, say) would
replace main's frontier if promoted, so the gate compares it with that frontier too, whatever
the procedure asks: the verdict is decided against what main would lose, the comparison with
the parent is recorded beside it (the family's correction covers both), and the outcome
names both (`against_main` in the record)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from evotrainer import API_VERSION
from evotrainer.contract.recipe import evaluation_sampling
from evotrainer.diagnosis.gaps import unexplained_outcome
from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.errors import EvoError
from evotrainer.evidence.io import read_scores
from evotrainer.gate import counterfactual
from evotrainer.gate.outcomes import classify, pathology_status
from evotrainer.gate.rules import criterion_holds, gate_verdict, metric_values
from evotrainer.stats import GateProcedure, confidence_label
from evotrainer.store.clock import now_iso
from evotrainer.store.git import branch_name
from evotrainer.store.lineage import main_frontier, merged_into_main, verdict_of
from evotrainer.store.records import MERGING
from evotrainer.store.workspace import VersionState, Workspace, run_path


def recorded_scores(ws: Workspace, version: str) -> pa.Table:
    """The per-task score table committed on the version's branch."""
    if ws.git.rev(f"refs/heads/{branch_name(version)}") is None:
        raise EvoError(f"no version {version!r} (no branch {branch_name(version)})",
                       hint="`evotrainer lineage` lists the versions")
    raw = ws.git.read(branch_name(version), run_path(version, "scores.csv"))
    if raw is None:
        raise EvoError(
            f"{version} has no recorded scores",
            where=branch_name(version),
            hint="reconcile it first: the gate compares score tables",
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scores.csv"
        path.write_bytes(raw)
        return read_scores(path)


def evaluation_protocol(ws: Workspace, states: dict[str, VersionState], name: str) -> dict:
    """How a version's validation samples were drawn (its resolved recipe's evaluation
    temperature and top-p): scores are comparable only under the same protocol."""
    temperature, top_p = evaluation_sampling(ws.resolved_recipe(name, states).get("grpo") or {})
    return {"temperature": temperature, "top_p": top_p}


def decision_header(state: VersionState, harness: HarnessRevision) -> dict:
    """What every decision record starts with: whose, against which parent, by which harness."""
    return {
        "apiVersion": API_VERSION,
        "kind": "Decision",
        "version": state.name,
        "parent": state.parent,
        "harness": {"name": harness.name, "digest": harness.digest},
    }


def references(
    ws: Workspace, states: dict[str, VersionState], state: VersionState, wanted: tuple[str, ...],
    frontier: str | None = None,
) -> dict[str, str]:
    """{role: version} for the comparison family: the parent always, then the frontier (main's
    latest promotion), the root of the version's chain and a treatment's control
    (gate/counterfactual.py) when asked for and distinct from the parent and from the version
    itself (a duplicate would count twice in the correction).
    `frontier`: the one the caller already found (`replaced_frontier`)."""
    chain = [s.name for s in ws.chain(state.name, states)]
    found = {"parent": state.parent}
    candidates = {
        "frontier": lambda: frontier or main_frontier(states, merged_into_main(ws)),
        "root": lambda: chain[0],
        counterfactual.CONTROL: lambda: counterfactual.control_of(state.spec),
    }
    for role in wanted:
        if role == "parent":
            continue
        name = candidates[role]()
        if name and name != state.name and name not in found.values():
            found[role] = name
    return found


def replaced_frontier(
    ws: Workspace, states: dict[str, VersionState], state: VersionState
) -> str | None:
    """What main would lose when `state`'s parent never merged into it (None when the parent
    did): the nearest ancestor whose recorded verdict merged it (a promotion, or the
    baseline). Promoting `state` hands main its whole unmerged chain, so that ancestor, not
    the parent, is what the gain must beat. Read from the records alone, not from main's
    state now, so a later re-gate (a harness backtest, a re-diagnosis) decides as the first
    gate did even after the line has landed."""
    if state.parent is None or verdict_of(states[state.parent]) in MERGING:
        return None
    for ancestor in reversed(ws.chain(state.parent, states)[:-1]):
        if verdict_of(ancestor) in MERGING:
            return ancestor.name
    return None


def _family(
    ws: Workspace,
    states: dict[str, VersionState],
    state: VersionState,
    harness: HarnessRevision,
    procedure: GateProcedure,
    diagnosis: dict,
    frontier: str | None = None,
) -> dict[str, dict]:
    """{role: {version, comparison, verdict, rule}} for every member of the comparison family,
    each interval at alpha / m and each p-value adjusted (Holm or Bonferroni): the family
    holds at `alpha` as a whole."""
    scores = {}
    for role, name in references(ws, states, state, procedure.compare_with, frontier).items():
        try:
            scores[role] = (name, recorded_scores(ws, name))
        except EvoError:
            if role in ("parent", counterfactual.CONTROL):
                raise  # a treatment is decided only once its control is scored
            continue  # a reference never scored (an untrained root) is not in the family
    m = counterfactual.comparisons(state.spec, len(scores))
    alpha = procedure.alpha / m
    candidate = recorded_scores(ws, state.name)
    family = {role: {"version": name, "comparison": procedure.compare(table, candidate, alpha)}
              for role, (name, table) in scores.items()}
    roles = list(family)
    adjusted = counterfactual.adjusted([family[r]["comparison"]["p_bootstrap"] for r in roles],
                                       procedure.correction, m)
    for role, p in zip(roles, adjusted, strict=True):
        member = family[role]
        member["comparison"]["p_unadjusted"] = member["comparison"]["p_bootstrap"]
        member["comparison"]["p_bootstrap"] = p
        gate = gate_verdict(harness, {"metrics": metric_values(diagnosis),
                                      "alerts": diagnosis["alerts"]},
                            member["comparison"],
                            metric_values(states[member["version"]].records.get("diagnosis")))
        member.update(verdict=gate["verdict"], rule=gate["rule"])
    return family


@dataclass(frozen=True)
class Compared:
    """What a version's gate compares: its parent's comparison (the numbers its gate rules
    read), the whole family when the procedure compares with more than the parent, and main's
    frontier (`replaces`) when the version is decided against it."""

    procedure: GateProcedure
    comparison: dict
    family: dict[str, dict] | None = None
    replaces: str | None = None
    spec: Mapping[str, Any] | None = None  # the version's, for its counterfactual family

    @property
    def comparisons(self) -> int:
        """How many comparisons the family's correction counts (gate/counterfactual.py)."""
        return counterfactual.comparisons(self.spec, len(self.family or {}))

    @property
    def against_main(self) -> dict | None:
        """The comparison with main's frontier that decides, None when the parent decides."""
        if self.replaces is None or self.family is None:
            return None
        member = self.family["frontier"]
        return {"version": self.replaces, "verdict": member["verdict"],
                "rule": member["rule"], "comparison": member["comparison"]}

    def family_record(self) -> dict | None:
        """The family as `decision.yaml` records it; None when only the parent is compared."""
        if self.family is None:
            return None
        return {"correction": self.procedure.correction, "alpha": self.procedure.alpha,
                "members": {r: {k: m[k] for k in ("version", "verdict", "rule", "comparison")}
                            for r, m in self.family.items()},
                **counterfactual.record(self.spec, len(self.family))}


def _compare(
    ws: Workspace,
    states: dict[str, VersionState],
    state: VersionState,
    harness: HarnessRevision,
    procedure: GateProcedure,
) -> Compared:
    """The comparisons `state`'s gate decides from: with main's frontier too when its parent
    is not on main, as a family when the procedure asks for more than the parent, and
    recomputed when the diagnosis compared otherwise (another procedure, another revision)."""
    diagnosis = state.records["diagnosis"]
    replaces = replaced_frontier(ws, states, state)
    if replaces is not None and "frontier" not in procedure.compare_with:
        procedure = replace(procedure, compare_with=(*procedure.compare_with, "frontier"))
    procedure = counterfactual.with_control(procedure, state.spec)
    if procedure.compare_with != ("parent",):
        family = _family(ws, states, state, harness, procedure, diagnosis, replaces)
        if "frontier" not in family:
            replaces = None  # main's frontier has no scores (an untrained root): the parent decides
        return Compared(procedure, family["parent"]["comparison"], family, replaces,
                        state.spec)
    comparison = diagnosis.get("comparison")
    if procedure != harness.procedure:
        # The diagnosis compared under the harness's procedure: this one tests differently.
        comparison = procedure.compare(recorded_scores(ws, state.parent),
                                       recorded_scores(ws, state.name))
    elif not comparison or (diagnosis.get("harness") or {}).get("digest") != harness.digest:
        # Diagnosed without the parent's scores, or by another revision (another alpha).
        comparison = harness.procedure.compare(
            recorded_scores(ws, state.parent), recorded_scores(ws, state.name)
        )
    return Compared(procedure, comparison)


def decide(
    ws: Workspace,
    states: dict[str, VersionState],
    state: VersionState,
    harness: HarnessRevision,
    procedure: GateProcedure | None = None,
) -> dict:
    """The decision record of `state`. `procedure` (by default the harness's own) says how
    to test; the method's default at the harness's alpha (a paired percentile bootstrap
    against the parent, stratified by data_source) decides exactly as the gate always has."""
    diagnosis = state.records["diagnosis"]
    if state.parent is None:
        return {
            **decision_header(state, harness),
            "verdict": "baseline",
            "reason": "root of the lineage: the reference its children are compared with",
            "blocked_by": [],
            "comparison": None,
            "decided_at": now_iso(),
        }
    parent = states[state.parent]
    compared = _compare(ws, states, state, harness, procedure or harness.procedure)
    gate = gate_verdict(
        harness,
        {"metrics": metric_values(diagnosis), "alerts": diagnosis["alerts"]},
        compared.comparison,
        metric_values(parent.records.get("diagnosis")),
    )
    critical = [a["name"] for a in diagnosis["alerts"]
                if a.get("severity") == "critical" and a.get("layer") == "behavior"]
    verdict, reason = _named_verdict(gate, critical, compared, parent.name)
    protocols = _changed_protocols(ws, states, state)
    if protocols is not None:
        # Said, not enforced: the Δ mixes what training changed with what the evaluation
        # changed (the same policy scores differently under a hotter sampler).
        reason += (
            f"; evaluated unlike its parent ({_protocol_text(protocols['version'])} against "
            f"{_protocol_text(protocols['parent'])}), so the Δ also measures the evaluation "
            "change: set grpo.eval_temperature to score both alike"
        )
    gap = unexplained_outcome(state.name, compared.comparison, diagnosis,
                              parent.records.get("diagnosis"))
    decision = {
        **decision_header(state, harness),
        "verdict": verdict,
        "reason": reason,
        "rule": gate["rule"],
        "blocked_by": critical,
        "comparison": compared.comparison,
    }
    recorded_when_found = {
        "evaluation_protocol": protocols,
        "family": compared.family_record(),
        "against_main": compared.against_main,
        "outcome": _named_outcome(ws, states, state, compared, critical, harness.min_delta),
        "gaps": None if gap is None else [gap.as_dict()],
        "criterion": _criterion(state, gate["variables"]),
    }
    decision.update((k, v) for k, v in recorded_when_found.items() if v is not None)
    decision["decided_at"] = now_iso()
    return decision


def _named_verdict(
    gate: dict, critical: list[str], compared: Compared, parent: str
) -> tuple[str, str]:
    """The verdict and its reason: the gate's on the parent's comparison, or on main's
    frontier's where that decides (the parent's recorded beside it); a block prunes; within a
    family a promotion must hold against every other reference."""
    comparison, against_main = compared.comparison, compared.against_main
    verdict = gate["verdict"] if against_main is None else against_main["verdict"]
    numbers = (f"Δ avg@k {_interval(comparison)}, p={comparison['p_bootstrap']:.4f} "
               f"over {comparison['n_tasks']} tasks")
    if verdict == "block":
        verdict = "prune"
        reason = f"blocked by critical alert(s) {', '.join(critical)} whatever the score; {numbers}"
    else:
        reason = f"{numbers} (gate rule {gate['rule'] or 'none'})"
    if against_main is not None:
        other = against_main["comparison"]
        reason = (f"against main's frontier {compared.replaces} (its parent {parent} is not on "
                  f"main): Δ avg@k {_interval(other)}, p={other['p_bootstrap']:.4f} "
                  f"(gate rule {against_main['rule'] or 'none'}); "
                  f"against its parent {parent}: {reason}")
    if compared.family is None:
        return verdict, reason
    reason += (f"; corrected ({compared.procedure.correction}) for {compared.comparisons} "
               "comparisons")
    return _held_out(compared, verdict, reason)


def _held_out(compared: Compared, verdict: str, reason: str) -> tuple[str, str]:
    """A promotion must hold against every reference: a version that beats its parent but not
    the frontier (its parent was itself no better) is not promoted. Decided against main's
    frontier, the parent's comparison is recorded, not required."""
    family = compared.family or {}
    holdout = next((r for r, m in family.items()
                    if r != "parent" and m["verdict"] != "promote"
                    and not (compared.replaces is not None and r == "frontier")), None)
    if verdict != "promote" or holdout is None:
        return verdict, reason
    member = family[holdout]
    verdict = "prune" if member["verdict"] in ("prune", "revert", "block") else "inconclusive"
    reason += (f"; not promoted: against the {holdout} {member['version']} "
               f"Δ {_interval(member['comparison'])} (gate rule {member['rule'] or 'none'})")
    return verdict, reason


def _named_outcome(
    ws: Workspace,
    states: dict[str, VersionState],
    state: VersionState,
    compared: Compared,
    critical: list[str],
    min_delta: float,
) -> dict | None:
    """The outcome recorded beside the verdict (outcomes.py), classified on the comparison
    that decided; decided against main's frontier, its reason names the parent's too."""
    against_main = compared.against_main
    outcome = classify(
        against_main["comparison"] if against_main is not None else compared.comparison,
        blocked_by=critical, min_delta=min_delta,
        pathology=pathology_status(state.spec.get("proposal"), state.records["diagnosis"],
                                   ws.resolved_recipe(state.name, states)),
    )
    if outcome is None:
        return None
    named = outcome.as_dict()
    if against_main is not None:
        comparison = compared.comparison
        named["reason"] = (
            f"against main's frontier {compared.replaces}: {outcome.reason}; against its parent "
            f"{state.parent} (not on main): Δ {comparison['delta']:+.4f}, CI "
            f"[{comparison['ci_low']:+.4f}, {comparison['ci_high']:+.4f}]")
    return named


def _changed_protocols(
    ws: Workspace, states: dict[str, VersionState], state: VersionState
) -> dict | None:
    """{version, parent}: how each one's validation samples were drawn, when they differ;
    None when the version was evaluated as its parent was."""
    protocols = {"version": evaluation_protocol(ws, states, state.name),
                 "parent": evaluation_protocol(ws, states, states[state.parent].name)}
    return protocols if protocols["version"] != protocols["parent"] else None


def _interval(comparison: dict) -> str:
    return (f"{comparison['delta']:+.4f} {confidence_label(comparison)} "
            f"[{comparison['ci_low']:+.4f}, {comparison['ci_high']:+.4f}]")


def _protocol_text(protocol: dict) -> str:
    return f"temperature {protocol['temperature']}, top-p {protocol['top_p']}"


def _criterion(state: VersionState, variables: dict) -> dict | None:
    """The version's falsifiable criterion (its hypothesis's), and whether it held."""
    criterion = ((state.spec.get("intervention") or {}).get("hypothesis") or {}).get("criterion")
    if not criterion:
        return None
    return {"expression": criterion, "held": criterion_holds(criterion, variables)}
