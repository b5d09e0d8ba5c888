"""Harness revisions over recorded history: backtest, adopt, diff.

A harness revision is adopted only after its backtest: every recorded version is
re-diagnosed from its stored rollouts (the run record's `artifact_dir`) with the candidate
and with the revision it would replace, and re-gated with each (the same `decision.decide`
that reconcile runs, over the same recorded score tables). What changes — alerts, verdicts — is
what adopting it would change; the candidate's own `backtest_cases` must all pass.

A procedure revision (the gate's alpha, min_delta and procedure fields, its rules, alert
thresholds) changes decisions without changing a metric: each version whose verdict flips
carries `flip`, the numbers each revision decided on (Δ, CI, p, the rule that held, alpha,
min_delta) and one sentence saying what moved, so `harness diff` shows the decision beside
the text change. Early stops are replayed above this layer (agent/stop_replay.py): the
rules read what a running job's live look reads, which the controller defines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evotrainer.diagnosis.diagnose import QueryRows, diagnose, diagnosis_document
from evotrainer.diagnosis.harness import HarnessRevision, resolve_harness
from evotrainer.errors import EvoError
from evotrainer.evidence.io import read_rollouts, read_steps
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.gate.decision import decide, recorded_scores
from evotrainer.stats import GateProcedure
from evotrainer.store.builtin import harness_file
from evotrainer.store.lineage import tree_order
from evotrainer.store.workspace import PROJECT_FILE, VersionState, Workspace

if TYPE_CHECKING:
    import pyarrow as pa


def recorded_versions(ws: Workspace, states: dict[str, VersionState]) -> list[str]:
    """Versions with a succeeded run whose artifacts are still on disk, in tree order."""
    out = []
    for name in tree_order(states):
        run = states[name].run
        if run and run.succeeded and run.artifact_dir and (ws.root / run.artifact_dir).is_dir():
            out.append(name)
    return out


class _Evidence:
    """A version's recorded rollouts and steps, read on first use and kept for the next
    diagnosis of the same version, with the digest the first diagnosis computed and the
    rows of the queries it ran."""

    def __init__(self, ws: Workspace, state: VersionState) -> None:
        self.files = RunArtifacts(ws.run_dir(state.name, state.records["run"]))
        self.tables: tuple[pa.Table, pa.Table | None] | None = None
        self.digest: str | None = None
        self.queries: QueryRows = {}

    def read(self) -> tuple[pa.Table, pa.Table | None]:
        if self.tables is None:
            steps = self.files.steps
            self.tables = (read_rollouts(self.files.rollouts_dir),
                           read_steps(steps) if steps.is_file() else None)
        return self.tables


def _diagnosis(
    ws: Workspace, states: dict[str, VersionState], state: VersionState, harness: HarnessRevision,
    parent_comparison: dict | None = None, evidence: _Evidence | None = None,
) -> dict:
    """The diagnosis of `state`'s recorded evidence under `harness`: reconcile's under the same
    revision, else one an earlier backtest kept, else diagnosed now (with the comparison with
    the parent, where the caller holds it under the same procedure, and the evidence where
    the caller read it)."""
    if _recorded(state, harness):  # reconcile already diagnosed it with exactly this revision
        return state.records["diagnosis"]
    memo = _memo(ws, states, state, harness)
    try:  # this revision's diagnosis of this very evidence, from an earlier backtest
        return json.loads(memo.read_bytes())
    except (OSError, ValueError):
        pass
    evidence = evidence or _Evidence(ws, state)  # run_dir checks it is the run's own folder
    # The parent's and the version's recorded scores, as reconcile diagnoses: the
    # version-layer metrics and the gate then read the same comparison here as there.
    compared = parent_comparison is not None
    result = diagnose(
        *evidence.read(),
        harness,
        recorded_scores(ws, state.parent)
        if not compared and _collected(states, state.parent) else None,
        scores=None if compared else recorded_scores(ws, state.name),
        evidence_digest=evidence.digest,
        parent_comparison=parent_comparison,
        queries=evidence.queries,
    )
    evidence.digest = result["evidence_digest"]
    document = diagnosis_document(result, state.name)
    _remember(memo, document)
    return document


def _recorded(state: VersionState, harness: HarnessRevision) -> bool:
    recorded = state.diagnosis
    return bool(recorded and recorded.harness_digest == harness.digest)


def _memo(ws: Workspace, states: dict[str, VersionState], state: VersionState,
          harness: HarnessRevision) -> Path:
    """Where an earlier backtest kept this revision's diagnosis of this evidence."""
    return ws.state_dir / "cache" / "backtest" / f"{_memo_key(states, state, harness)}.json"


def _memo_key(
    states: dict[str, VersionState], state: VersionState, harness: HarnessRevision
) -> str:
    """What a backtest diagnosis depends on: the revision, the version's branch (its run
    record, hence its artifacts' digests, and its scores), its parent's branch (the parent
    scores) and the diagnosis code itself."""
    parent = states.get(state.parent) if state.parent else None
    parts = (harness.digest, state.name, state.sha, parent.sha if parent else "", _code_digest())
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()


@cache
def _code_digest() -> str:
    """The digest of the code a diagnosis runs (the diagnosis and evidence packages, the
    statistics of its parent comparison and the CEL evaluation of its alerts): a changed
    analyzer, reader, statistic or evaluation makes every remembered backtest diagnosis a
    miss."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted([*root.glob("diagnosis/*.py"), *root.glob("diagnosis/*.yaml"),
                        *root.glob("evidence/*.py"), *root.glob("stats/*.py"),
                        root / "store" / "cel.py"]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _remember(path: Path, document: dict) -> None:
    """Keep a backtest diagnosis for the next backtest of the same evidence; only what JSON
    keeps exactly (a diagnosis is numbers, names and lists)."""
    try:
        text = json.dumps(document, sort_keys=True)
        if json.loads(text) != document:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        # Named for this process: a child stopped while writing leaves a file its parent
        # knows and removes (agent/diff_work.py).
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         prefix=f"{os.getpid()}-", suffix=".tmp") as out:
            out.write(text)
        os.replace(out.name, path)
    except (OSError, TypeError, ValueError):
        pass  # a memo that cannot be written is only slower


def _diagnose_all(
    ws: Workspace,
    states: dict[str, VersionState],
    names: list[str],
    old: HarnessRevision,
    new: HarnessRevision,
    progress: Progress | None,
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Each version's diagnosis under `old` and under `new`, one version after another: run
    on threads, two versions at once hung in a git read (each diagnosis has threads and
    child processes of its own)."""
    old_diag: dict[str, dict] = {}
    new_diag: dict[str, dict] = {}
    for done, name in enumerate(names):
        if progress is not None:
            progress(name, done, len(names))
        old_diag[name], new_diag[name] = diagnose_version(ws, states, name, old, new)
    if progress is not None and names:
        progress(names[-1], len(names), len(names))
    return old_diag, new_diag


def diagnose_version(ws: Workspace, states: dict[str, VersionState], name: str,
                     old: HarnessRevision, new: HarnessRevision) -> tuple[dict, dict]:
    """`name`'s diagnosis under `old` and under `new` (once where they are one revision),
    its evidence read once for both. Where both test under one gate procedure, `new` reads
    the comparison with the parent `old`'s holds: the same procedure over the same recorded
    score tables."""
    evidence = _Evidence(ws, states[name])
    old_diag = _diagnosis(ws, states, states[name], old, evidence=evidence)
    if new.digest == old.digest:
        return old_diag, old_diag
    compared = old_diag.get("comparison") if new.procedure == old.procedure else None
    return old_diag, _diagnosis(ws, states, states[name], new, compared, evidence)


def diagnoses_kept(ws: Workspace, states: dict[str, VersionState], names: list[str],
                   harnesses: list[HarnessRevision]) -> bool:
    """Whether every diagnosis of `names` under `harnesses` is recorded or kept from an
    earlier backtest."""
    return all(_recorded(states[name], harness) or
               _memo(ws, states, states[name], harness).is_file()
               for name in names for harness in harnesses)


def _collected(states: dict[str, VersionState], name: str | None) -> bool:
    """Whether `name` has a collected run, hence recorded scores."""
    run = states[name].run if name in states else None
    return run is not None and run.succeeded


def _regate(
    ws: Workspace, states: dict[str, VersionState], diagnoses: dict[str, dict],
    harness: HarnessRevision,
) -> dict[str, dict]:
    """Decisions of every diagnosed version as if `harness` had diagnosed the lineage."""
    replaced = {
        name: dataclasses.replace(
            state, records={**state.records, "diagnosis": diagnoses.get(name)}
        )
        for name, state in states.items()
    }
    decisions = {}
    for name in diagnoses:
        state = replaced[name]
        parent = state.parent
        if parent is not None and diagnoses.get(parent) is None:
            continue  # the parent's evidence is gone: nothing to compare with
        decisions[name] = decide(ws, replaced, state, harness)
    return decisions


def _alerts(diagnosis: dict | None) -> list[str]:
    return sorted(f"{a['name']}:{a['severity']}" for a in (diagnosis or {}).get("alerts") or [])


# What a decision's numbers are read from: its comparison with the parent.
_COMPARED = ("delta", "ci_low", "ci_high", "p_bootstrap", "p_wilcoxon", "n_tasks")


def decided_on(decision: dict, harness: HarnessRevision) -> dict[str, Any]:
    """The numbers a gate decision rests on, and the procedure it was taken under."""
    comparison = decision.get("comparison") or {}
    return {"verdict": decision["verdict"], "rule": decision.get("rule"),
            "blocked_by": list(decision.get("blocked_by") or []),
            **{k: comparison.get(k) for k in _COMPARED},
            "alpha": harness.alpha, "min_delta": harness.min_delta}


def flip(before: dict, after: dict, old: HarnessRevision, new: HarnessRevision
         ) -> dict[str, Any]:
    """A decision that changes between two revisions, with the numbers on each side and what
    moved, in one sentence."""
    a, b = decided_on(before, old), decided_on(after, new)
    # Compared as shown: a p-value recomputed in its last digits has not moved.
    moved = [f"{key} {_num(key, a[key])} → {_num(key, b[key])}"
             for key in (*_COMPARED, "alpha", "min_delta", "blocked_by")
             if _num(key, a[key]) != _num(key, b[key])]
    why = (f"{a['verdict']} (rule {a['rule'] or 'none'}) → {b['verdict']} "
           f"(rule {b['rule'] or 'none'}) on Δ {_num('delta', b['delta'])}, CI "
           f"[{_num('ci_low', b['ci_low'])}, {_num('ci_high', b['ci_high'])}], "
           f"p={_num('p_bootstrap', b['p_bootstrap'])}: "
           + ("; ".join(moved) if moved else "the same numbers, another rule"))
    return {"before": a, "after": b, "moved": moved, "why": why}


def _num(key: str, value: Any) -> str:
    """Differences signed (Δ, CI bounds, min_delta), levels and p-values not."""
    if value is None or value == []:
        return "—"
    if isinstance(value, float):
        signed = key in ("delta", "ci_low", "ci_high", "min_delta")
        return f"{value:+.4f}" if signed else f"{value:.4f}"
    return str(value)


def case_passes(expect: str, decision: dict | None) -> bool:
    if decision is None:
        return False
    if expect == "block":  # the gate records a block as a prune with its blocking alerts
        return decision["verdict"] == "prune" and bool(decision.get("blocked_by"))
    return decision["verdict"] == expect


# (the version in hand: the next one not yet done, or the last; versions done; total)
Progress = Callable[[str, int, int], None]


def backtest_harness(
    ws: Workspace,
    candidate: str | HarnessRevision,
    against: str | HarnessRevision | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Re-diagnose and re-gate every recorded version with `candidate` and `against` (default:
    the revision in force). Returns rows per version, the changed ones, and the cases.

    A diagnosis reconcile recorded under the same revision digest is reused, and so is one an
    earlier backtest computed from the same evidence (.evotrainer/cache/backtest).
    `progress` hears which version is in hand as each one's diagnoses are done."""
    new = candidate if isinstance(candidate, HarnessRevision) else resolve_harness(
        candidate, ws.root)
    old = against if isinstance(against, HarnessRevision) else resolve_harness(
        against or ws.harness_in_force(), ws.root)
    states = ws.versions()
    # Records a keyless reader cannot check are evidence of nothing: no re-gate from them.
    ws.refuse_unverified(states, f"the backtest of {new.name}")
    names = recorded_versions(ws, states)
    old_diag, new_diag = _diagnose_all(ws, states, names, old, new, progress)
    old_dec = _regate(ws, states, old_diag, old)
    new_dec = _regate(ws, states, new_diag, new)
    rows = []
    for name in names:
        before, after = old_dec.get(name), new_dec.get(name)
        recorded = states[name].decision
        row = {
            "version": name,
            "recorded": recorded.verdict if recorded else None,
            "alerts_before": _alerts(old_diag[name]),
            "alerts_after": _alerts(new_diag[name]),
            "verdict_before": before["verdict"] if before else None,
            "verdict_after": after["verdict"] if after else None,
            "metrics_added": sorted(
                set(new_diag[name].get("metrics") or {})
                - set(old_diag[name].get("metrics") or {})
            ),
        }
        row["new_metric_values"] = {
            m: (new_diag[name]["metrics"][m] or {}).get("value") for m in row["metrics_added"]
        }
        # A keyed metric's per-key values: what a trigger reading `keyed` sees under `new`.
        keyed = new_diag[name].get("keyed") or {}
        row["new_keyed_values"] = {m: keyed[m] for m in row["metrics_added"] if m in keyed}
        row["flip"] = flip(before, after, old, new) if (
            before and after and before["verdict"] != after["verdict"]) else None
        row["changed"] = (
            row["alerts_before"] != row["alerts_after"]
            or row["verdict_before"] != row["verdict_after"]
        )
        rows.append(row)
    cases = []
    for case in new.backtest_cases:
        decision = new_dec.get(case["version"])
        cases.append({
            **case,
            "verdict": decision["verdict"] if decision else None,
            "passed": case_passes(case["expect"], decision),
            **({} if decision else {"reason": "no recorded run with artifacts to re-gate"}),
        })
    return {
        "candidate": new.name,
        "against": old.name,
        "versions": rows,
        "changed": [r["version"] for r in rows if r["changed"]],
        "cases": cases,
        "passed": all(c["passed"] for c in cases),
    }


# ------------------------------------------------------------------------------- adopt

_HARNESS_LINE = re.compile(r"^harness:.*$", re.MULTILINE)


def adopt_harness(ws: Workspace, name: str) -> dict[str, Any]:
    """Put `name` in force: one commit on main setting `harness:` in the project spec
    (trailer Action: adopt-harness). Refused unless the revision is committed on main and
    its backtest cases pass. Returns the backtest."""
    path = harness_file(name)
    if ws.git.read("main", path) is None:
        raise EvoError(f"harness revision {name!r} is not committed on main", where=path,
                       hint=f"review it, then `git add {path} && git commit`; adoption "
                       "points the project at a revision everyone can read")
    current = ws.harness_in_force()
    if current == name:
        raise EvoError(f"harness {name!r} is already in force", where=PROJECT_FILE,
                       field="harness")
    report = backtest_harness(ws, name, current)
    failed = [c for c in report["cases"] if not c["passed"]]
    if failed:
        listed = ", ".join(f"{c['version']} expects {c['expect']}, got {c['verdict']}"
                           for c in failed)
        raise EvoError(f"harness {name!r} fails {len(failed)} backtest case(s): {listed}",
                       where=path, field="backtest_cases",
                       hint=f"see `evotrainer harness backtest {name} --against {current}`; "
                       "nothing was adopted")
    raw = ws.git.read("main", PROJECT_FILE)
    if raw is None:
        raise EvoError("main has no project spec", where=f"main:{PROJECT_FILE}")
    text = raw.decode()
    if _HARNESS_LINE.search(text):
        text = _HARNESS_LINE.sub(f"harness: {name}", text, count=1)
    else:
        text = re.sub(r"^(kind:.*)$", rf"\1\nharness: {name}", text, count=1, flags=re.M)
    changed = ", ".join(report["changed"]) or "none"
    ws.git.commit_files(
        "main",
        {PROJECT_FILE: text.encode()},
        f"Adopt harness {name} (was {current}): backtest cases "
        f"{len(report['cases'])}/{len(report['cases'])} pass; versions that change: {changed}",
        {"Action": "adopt-harness", "Harness": name, "Previous-Harness": current},
    )
    # Whoever holds this Workspace (a reconcile in the same loop) diagnoses with it now.
    ws.reload_project()
    return report


# -------------------------------------------------------------------------------- diff


# Revision fields `diff_harness` reports in their own sections (or that are not settings).
def _by_name(items: tuple) -> dict[str, Any]:
    return {item.name: item for item in items}


def _changed_fields(a: Any, b: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]


def diff_harness(old: HarnessRevision, new: HarnessRevision) -> dict[str, Any]:
    """What a reviewer needs beside `git diff`: metrics, alerts (thresholds), gate rules,
    params and cases added, removed or changed."""
    out: dict[str, Any] = {"from": old.name, "to": new.name}
    for kind, a_items, b_items in (
        ("metrics", old.metrics, new.metrics),
        ("alerts", old.alerts, new.alerts),
        ("gate_rules", old.gate_rules, new.gate_rules),
        ("analyzers", old.analyzers, new.analyzers),
    ):
        a, b = _by_name(a_items), _by_name(b_items)
        out[kind] = {
            "added": sorted(set(b) - set(a)),
            "removed": sorted(set(a) - set(b)),
            "changed": {n: _changed_fields(a[n], b[n]) for n in sorted(set(a) & set(b))
                        if a[n] != b[n]},
        }
    out["thresholds"] = {
        name: {"from": [(lv.severity, lv.when) for lv in a_alert.levels],
               "to": [(lv.severity, lv.when) for lv in b_alert.levels]}
        for name, a_alert in _by_name(old.alerts).items()
        if (b_alert := _by_name(new.alerts).get(name)) and a_alert.levels != b_alert.levels
    }
    # The gate procedure: min_delta and every field of the test (alpha, CI method, resamples,
    # strata, the comparison family and its correction).
    sides = {"min_delta": (old.min_delta, new.min_delta)} | {
        f.name: (getattr(old.procedure, f.name), getattr(new.procedure, f.name))
        for f in dataclasses.fields(GateProcedure)
    }
    out["gate"] = {key: {"from": a, "to": b} for key, (a, b) in sides.items() if a != b}
    a_stop, b_stop = _by_name(old.early_stop), _by_name(new.early_stop)
    out["early_stop"] = {
        "added": sorted(set(b_stop) - set(a_stop)),
        "removed": sorted(set(a_stop) - set(b_stop)),
        "changed": {n: {"from": a_stop[n].when, "to": b_stop[n].when}
                    for n in sorted(set(a_stop) & set(b_stop)) if a_stop[n] != b_stop[n]},
    }
    out["rule_order"] = (
        {"from": [r.name for r in old.gate_rules], "to": [r.name for r in new.gate_rules]}
        if [r.name for r in old.gate_rules] != [r.name for r in new.gate_rules] else None
    )
    out["params"] = {
        k: {"from": old.params.get(k), "to": new.params.get(k)}
        for k in sorted(set(old.params) | set(new.params))
        if old.params.get(k) != new.params.get(k)
    }
    old_cases = {(c["version"], c["expect"]) for c in old.backtest_cases}
    new_cases = {(c["version"], c["expect"]) for c in new.backtest_cases}
    out["backtest_cases"] = {"added": sorted(new_cases - old_cases),
                             "removed": sorted(old_cases - new_cases)}
    return out
