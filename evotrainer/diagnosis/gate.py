"""The promotion gate: a version against its parent on the per-task score tables, plus the
harness's gate rules over the diagnosis. The verdict is written with the numbers that
decided it, so a reviewer reads `decision.yaml` and sees why."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa

from evotrainer import API_VERSION
from evotrainer.contract.recipe import evaluation_sampling
from evotrainer.diagnosis.diagnose import evaluate_unless_null, gate_verdict, parent_comparison
from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.errors import EvoError
from evotrainer.evidence.io import read_scores
from evotrainer.store.clock import now_iso
from evotrainer.store.git import branch_name
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


def decide(
    ws: Workspace, states: dict[str, VersionState], state: VersionState, harness: HarnessRevision
) -> dict:
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
    if not comparison or (diagnosis.get("harness") or {}).get("digest") != harness.digest:
        # Diagnosed without the parent's scores, or by another revision (another alpha).
        comparison = parent_comparison(
            recorded_scores(ws, parent.name), recorded_scores(ws, state.name), harness
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
        f"Δ avg@k {comparison['delta']:+.4f} 95% CI [{comparison['ci_low']:+.4f}, "
        f"{comparison['ci_high']:+.4f}], p={comparison['p_bootstrap']:.4f} "
        f"over {comparison['n_tasks']} tasks"
    )
    verdict = gate["verdict"]
    if verdict == "block":
        verdict = "prune"
        reason = f"blocked by critical alert(s) {', '.join(critical)} whatever the score; {numbers}"
    else:
        reason = f"{numbers} (gate rule {gate['rule'] or 'none'})"
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
