"""The promotion gate: a version against its parent on the per-task score tables, plus the
harness's gate rules over the diagnosis. The verdict is written with the numbers that
decided it, so a reviewer reads `decision.yaml` and sees why.

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
from dataclasses import replace
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
from evotrainer.stats import GateProcedure, confidence_label
from evotrainer.store.cel import evaluate_unless_null, holds
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


def metric_values(diagnosis: dict | None) -> dict:
    """{name: value} from a diagnosis record's {name: {value, layer, trend}}."""
    metrics = (diagnosis or {}).get("metrics") or {}
    return {name: (m.get("value") if isinstance(m, dict) else m) for name, m in metrics.items()}


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


def gate_verdict(
    harness: HarnessRevision,
    diagnosis: dict,
    comparison: dict | None = None,
    parent_metrics: dict[str, float | None] | None = None,
) -> dict:
    """Apply the gate: the first rule whose `when` holds decides; none holding means
    inconclusive. A rule that reads a null value does not hold."""
    comparison = comparison or diagnosis.get("comparison") or {}
    alerts = diagnosis["alerts"]
    variables = {
        **diagnosis["metrics"],
        "delta": comparison.get("delta"),
        "ci_low": comparison.get("ci_low"),
        "ci_high": comparison.get("ci_high"),
        "p_value": comparison.get("p_bootstrap"),
        "p_wilcoxon": comparison.get("p_wilcoxon"),
        # Each data_source's own comparison: a pooled gain may carry a loss on one source.
        "strata": [_stratum(row) for row in comparison.get("strata") or []],
        "parent": dict(parent_metrics or {}),
        "alpha": harness.alpha,
        "min_delta": harness.min_delta,
        "critical_alerts": sum(a["severity"] == "critical" for a in alerts),
        # Critical behavior alerts (leak, abandonment) say the score itself cannot be
        # trusted; critical signal alerts (dead groups) say what to fix next.
        "critical_behavior_alerts": sum(
            a["severity"] == "critical" and a.get("layer") == "behavior" for a in alerts
        ),
        "warning_alerts": sum(a["severity"] == "warning" for a in alerts),
        "alerts": [a["name"] for a in alerts],
        "params": harness.params,
    }
    for rule in harness.gate_rules:
        if holds(rule.when, variables, where=harness.source, field=f"gate rule {rule.name}"):
            return {"verdict": rule.verdict, "rule": rule.name, "variables": _plain(variables)}
    return {"verdict": "inconclusive", "rule": None, "variables": _plain(variables)}


def _stratum(row: dict[str, Any]) -> dict[str, Any]:
    """One row of a comparison's `strata` as a gate rule reads it (`p_value` is the stratum's
    bootstrap p, as the pooled `p_value` is the comparison's)."""
    return {"data_source": row["data_source"], "n_tasks": row["n_tasks"],
            "delta": row["delta"], "ci_low": row["ci_low"], "ci_high": row["ci_high"],
            "p_value": row["p_bootstrap"]}


def _plain(variables: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in variables.items() if k != "params"}


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
    procedure = procedure or harness.procedure
    diagnosis = state.records["diagnosis"]
    metrics = metric_values(diagnosis)
    decision = decision_header(state, harness)
    if state.parent is None:
        return {
            **decision,
            "verdict": "baseline",
            "reason": "root of the lineage: the reference its children are compared with",
            "blocked_by": [],
            "comparison": None,
            "decided_at": now_iso(),
        }
    parent = states[state.parent]
    comparison = diagnosis.get("comparison")
    family = None
    replaces = replaced_frontier(ws, states, state)
    if replaces is not None and "frontier" not in procedure.compare_with:
        procedure = replace(procedure, compare_with=(*procedure.compare_with, "frontier"))
    procedure = counterfactual.with_control(procedure, state.spec)
    if procedure.compare_with != ("parent",):
        family = _family(ws, states, state, harness, procedure, diagnosis, replaces)
        comparison = family["parent"]["comparison"]
        if "frontier" not in family:
            replaces = None  # main's frontier has no scores (an untrained root): the parent decides
    elif procedure != harness.procedure:
        # The diagnosis compared under the harness's procedure: this one tests differently.
        comparison = procedure.compare(recorded_scores(ws, parent.name),
                                       recorded_scores(ws, state.name))
    elif not comparison or (diagnosis.get("harness") or {}).get("digest") != harness.digest:
        # Diagnosed without the parent's scores, or by another revision (another alpha).
        comparison = harness.procedure.compare(
            recorded_scores(ws, parent.name), recorded_scores(ws, state.name)
        )
    gate = gate_verdict(
        harness,
        {"metrics": metrics, "alerts": diagnosis["alerts"]},
        comparison,
        metric_values(parent.records.get("diagnosis")),
    )
    critical = [a["name"] for a in diagnosis["alerts"]
                if a.get("severity") == "critical" and a.get("layer") == "behavior"]
    numbers = (
        f"Δ avg@k {comparison['delta']:+.4f} {confidence_label(comparison)} "
        f"[{comparison['ci_low']:+.4f}, "
        f"{comparison['ci_high']:+.4f}], p={comparison['p_bootstrap']:.4f} "
        f"over {comparison['n_tasks']} tasks"
    )
    verdict = gate["verdict"]
    against_main = None
    if replaces is not None and family is not None:
        # Decided against what main would lose; the parent's comparison is recorded beside.
        member = family["frontier"]
        against_main = {"version": replaces, "verdict": member["verdict"],
                        "rule": member["rule"], "comparison": member["comparison"]}
        verdict = member["verdict"]
    if verdict == "block":
        verdict = "prune"
        reason = f"blocked by critical alert(s) {', '.join(critical)} whatever the score; {numbers}"
    else:
        reason = f"{numbers} (gate rule {gate['rule'] or 'none'})"
    if against_main is not None:
        other = against_main["comparison"]
        reason = (f"against main's frontier {replaces} (its parent {parent.name} is not on "
                  f"main): Δ avg@k {other['delta']:+.4f} {confidence_label(other)} "
                  f"[{other['ci_low']:+.4f}, {other['ci_high']:+.4f}], p="
                  f"{other['p_bootstrap']:.4f} (gate rule {against_main['rule'] or 'none'}); "
                  f"against its parent {parent.name}: {reason}")
    if family is not None:
        reason += (f"; corrected ({procedure.correction}) for "
                   f"{counterfactual.comparisons(state.spec, len(family))} comparisons")
        # A promotion must hold against every reference: a version that beats its parent
        # but not the frontier (its parent was itself no better) is not promoted. Decided
        # against main's frontier, the parent's comparison is recorded, not required.
        holdout = next((r for r, m in family.items()
                        if r != "parent" and m["verdict"] != "promote"
                        and not (against_main is not None and r == "frontier")), None)
        if verdict == "promote" and holdout is not None:
            member = family[holdout]
            verdict = ("prune" if member["verdict"] in ("prune", "revert", "block")
                       else "inconclusive")
            other = member["comparison"]
            reason += (f"; not promoted: against the {holdout} {member['version']} Δ "
                       f"{other['delta']:+.4f} {confidence_label(other)} [{other['ci_low']:+.4f}, "
                       f"{other['ci_high']:+.4f}] (gate rule {member['rule'] or 'none'})")
    protocols = {"version": evaluation_protocol(ws, states, state.name),
                 "parent": evaluation_protocol(ws, states, parent.name)}
    protocol_changed = protocols["version"] != protocols["parent"]
    if protocol_changed:
        # Said, not enforced: the Δ mixes what training changed with what the evaluation
        # changed (the same policy scores differently under a hotter sampler).
        reason += (
            f"; evaluated unlike its parent ({_protocol_text(protocols['version'])} against "
            f"{_protocol_text(protocols['parent'])}), so the Δ also measures the evaluation "
            "change: set grpo.eval_temperature to score both alike"
        )
    decision.update(
        verdict=verdict,
        reason=reason,
        rule=gate["rule"],
        blocked_by=critical,
        comparison=comparison,
    )
    if protocol_changed:
        decision["evaluation_protocol"] = protocols
    if family is not None:
        decision["family"] = {"correction": procedure.correction, "alpha": procedure.alpha,
                              "members": {r: {k: m[k] for k in ("version", "verdict", "rule",
                                                                  "comparison")}
                                          for r, m in family.items()},
                              **counterfactual.record(state.spec, len(family))}
    if against_main is not None:
        decision["against_main"] = against_main
    parent_diagnosis = parent.records.get("diagnosis")
    outcome = classify(
        against_main["comparison"] if against_main is not None else comparison,
        blocked_by=critical, min_delta=harness.min_delta,
        pathology=pathology_status(state.spec.get("proposal"), diagnosis,
                                   ws.resolved_recipe(state.name, states)),
    )
    if outcome is not None:
        decision["outcome"] = outcome.as_dict()
        if against_main is not None:
            decision["outcome"]["reason"] = (
                f"against main's frontier {replaces}: {outcome.reason}; against its parent "
                f"{parent.name} (not on main): Δ {comparison['delta']:+.4f}, CI "
                f"[{comparison['ci_low']:+.4f}, {comparison['ci_high']:+.4f}]")
    gap = unexplained_outcome(state.name, comparison, diagnosis, parent_diagnosis)
    if gap is not None:
        decision["gaps"] = [gap.as_dict()]
    criterion = ((state.spec.get("intervention") or {}).get("hypothesis") or {}).get("criterion")
    if criterion:
        decision["criterion"] = {
            "expression": criterion,
            "held": _criterion_holds(criterion, gate["variables"]),
        }
    decision["decided_at"] = now_iso()
    return decision


def _protocol_text(protocol: dict) -> str:
    return f"temperature {protocol['temperature']}, top-p {protocol['top_p']}"


def _criterion_holds(expression: str, variables: dict) -> bool | None:
    """The version's falsifiable criterion; None when it reads a metric that is null (or an
    expression that no longer evaluates: the criterion was checked when it was proposed)."""
    try:
        held = evaluate_unless_null(expression, variables)
    except EvoError:
        return None
    return None if held is None else held is True
