"""Harness revisions of the `rules` planner: the harness evolves when a diagnostic gap fires.

The gaps (diagnosis/gaps.py) are read from the recorded evidence: (a) an outcome no metric
outside the score layer explains, (b) skills firing on the same evidence that no recorded
number ranks, (c) no trigger and a stalled base. The revision adds the catalogue metric
(diagnosis/catalogue.py) that discriminates that gap:

- (a) the one that best separates the version from its parent on the recorded rollouts;
- (b) one whose hypotheses name the competing skills and whose values differ most over the
  versions that tried them;
- (c) one whose alert would fire on the stalled base (a pathology that persists explains a
  stall without moving; on every stalled child when the base is an untrained root with
  nothing measured), first the one whose alert lets a library skill offer a step not yet
  taken (the gap is that nothing selects the next intervention), else the one that moves
  most along the stalled lineage.

Every candidate is measured in one probe revision backtested on every recorded version; the
revision drafted is backtested again, its cases the recorded verdicts. With harness evolution
off (`evotrainer evolve --no-harness-evolution`) the gaps are only noted. One revision of the
harness in force awaits review at a time.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from evotrainer.agent.planners.base import HarnessProposal, PlannerResult, View, fmt, next_name
from evotrainer.diagnosis.catalogue import CatalogueEntry, catalogue
from evotrainer.diagnosis.gaps import (
    INDISTINGUISHABLE,
    NO_NEXT_STEP,
    UNEXPLAINED,
    FiredSkill,
    Gap,
    indistinguishable_hypotheses,
    no_next_step,
    unexplained_outcome,
)
from evotrainer.diagnosis.harness import parse_harness
from evotrainer.errors import EvoError
from evotrainer.gate.harness_backtest import backtest_harness, recorded_versions
from evotrainer.skills.skill import fires, match
from evotrainer.store.builtin import HARNESS_FOLDER, builtin_dir, harness_file
from evotrainer.store.records import NO_GAIN, Verdict
from evotrainer.store.specs import load_yaml


def gaps(
    view: View, base: str, fired: Mapping[str, list[FiredSkill]], actionable: bool
) -> list[Gap]:
    """The diagnostic gaps the recorded evidence shows, in the order the harness answers
    them: (a) the latest unexplained outcome, (b) indistinguishable hypotheses on the
    base's evidence, (c) no next step from a stalled base. `fired`: the skills standing as
    candidates on each piece of evidence; `actionable`: whether any of them offers a next
    step."""
    gaps = []
    for version in reversed(view.decided_order()):
        state = view.states[version]
        decision = state.records.get("decision") or {}
        parent = view.states[state.parent].records.get("diagnosis") if state.parent else None
        gap = unexplained_outcome(version, decision.get("comparison"),
                                  state.records.get("diagnosis") or {}, parent)
        if gap:
            gaps.append(gap)
            break
    for source, skills in fired.items():
        if gap := indistinguishable_hypotheses(source, skills):
            gaps.append(gap)
            break
    decided = [c for c in view.decided_order() if view.states[c].parent == base]
    stalled = decided if all(view.failed(c) for c in decided) else []
    # A persistent pathology whose library fix is already applied stalls a lineage as
    # surely as no trigger at all: neither selects the next intervention.
    if gap := no_next_step(base, actionable, stalled):
        gaps.append(gap)
    return gaps


def revision_for_gaps(
    view: View, base: str, fired: Mapping[str, list[FiredSkill]], actionable: bool,
    result: PlannerResult, *, drafting: bool = True,
) -> HarnessProposal | None:
    """A revision answering the first gap a catalogue metric can discriminate, unless a
    revision of the harness in force already awaits review. With `drafting` off the gaps
    are only noted."""
    found = gaps(view, base, fired, actionable)
    for gap in found:
        result.notes.append(f"gap {gap.kind} on {gap.version}: {gap.reason}")
    if not found:
        return None
    if not drafting:
        result.notes.append("harness evolution is off: no revision proposed for the gap(s)")
        return None
    if awaiting_review(view) is not None:
        return None
    document = in_force_document(view)
    defined = _defined_metrics(view)
    for gap in found:
        picked = _pick_metric(view, gap, base, document, defined)
        if picked is not None:
            return _revision(view, gap, base, document, *picked)
    result.notes.append("no catalogue metric discriminates the gap(s) on the recorded "
                        "rollouts: the harness stays as it is")
    return None


def _pick_metric(
    view: View, gap: Gap, base: str, document: dict, defined: set[str]
) -> tuple[CatalogueEntry, str] | None:
    """The catalogue metric that discriminates `gap`, with why; every candidate measured
    in one probe revision backtested over the recorded versions."""
    candidates = []
    recipe = view.ws.resolved_recipe(base, view.states)
    for entry in catalogue():
        if gap.kind not in entry.gaps or entry.metric["name"] in defined:
            continue
        try:
            parse_harness(_with_metric(document, entry, "probe", recipe))
        except EvoError:
            continue  # needs what this revision lacks (a param, a column)
        candidates.append(entry)
    if gap.kind == INDISTINGUISHABLE:
        named = set(gap.details["skills"]) | set(gap.details["categories"])
        candidates = [e for e in candidates if named & set(e.hypotheses)]
    if not candidates:
        return None
    probe = copy.deepcopy(document)
    probe["name"] = "probe"
    for entry in candidates:
        probe = _with_metric(probe, entry, "probe", recipe)
    report = backtest_harness(view.ws, parse_harness(probe), view.harness)
    values = {r["version"]: r["new_metric_values"] for r in report["versions"]}
    # A keyed metric's per-key values: what a skill's trigger and bindings read (`keyed`).
    keyed = {r["version"]: r.get("new_keyed_values") or {} for r in report["versions"]}
    best: tuple[tuple, CatalogueEntry, str] | None = None
    for entry in candidates:
        score, why = _discrimination(view, gap, base, entry, values, keyed)
        if score is not None and score[-1] > 0 and (best is None or score > best[0]):
            best = (score, entry, why)
    return None if best is None else (best[1], best[2])


def _revision(
    view: View, gap: Gap, base: str, base_document: dict, entry: CatalogueEntry,
    why: str,
) -> HarnessProposal:
    metric = entry.metric["name"]
    name = next_name(view.ws.harness_names(), "h")
    document = _with_metric(base_document, entry, name,
                            view.ws.resolved_recipe(base, view.states))
    document["parent"] = view.harness.name
    document["description"] = (
        f"{view.harness.name} plus {metric}, for the gap {gap.kind} on {gap.version}: "
        f"{gap.reason}. {why}"
    )
    document["backtest_cases"] = recorded_cases(view)
    revision = parse_harness(document, source=harness_file(name))
    backtest = backtest_harness(view.ws, revision, view.harness)
    return HarnessProposal(
        document,
        f"add {metric}: gap {gap.kind} on {gap.version} in {view.harness.name} ({why})",
        backtest,
        gap=gap.as_dict(),
    )


def in_force_document(view: View) -> dict[str, Any]:
    """The revision in force as its file holds it: what a new revision copies and changes."""
    return load_yaml(Path(view.harness.source).read_bytes(), view.harness.source)


def awaiting_review(view: View) -> str | None:
    """The revision of the harness in force that awaits review, if one does: one at a time.
    A built-in revision as shipped (h1) is part of the library, not a pending proposal."""
    for name in view.ws.harness_names():
        try:
            doc = load_yaml(view.ws.harness_path(name).read_bytes(), name)
            parent = doc.get("parent")
        except (OSError, EvoError, AttributeError):
            continue  # an unreadable revision is `validate`'s to report
        shipped = builtin_dir(HARNESS_FOLDER) / f"{name}.yaml"
        as_shipped = (
            shipped.is_file()
            and shipped.read_bytes() == view.ws.harness_path(name).read_bytes()
        )
        if parent == view.harness.name and not as_shipped:
            return name
    return None


def recorded_cases(view: View) -> list[dict[str, str]]:
    """A revision's backtest cases: every recorded verdict (promote or no gain) of a version
    whose evidence is still on disk. A revision that flips one fails it, so it is adopted
    only by a reviewer who agrees with the flip."""
    states = view.states
    return [
        {"version": v, "expect": states[v].records["decision"]["verdict"]}
        for v in recorded_versions(view.ws, states)
        if states[v].parent is not None and (states[v].records.get("decision") or {}).get(
            "verdict") in (Verdict.PROMOTE, *NO_GAIN)
    ]


def _defined_metrics(view: View) -> set[str]:
    """Metric names any revision of the workspace defines: a catalogue metric already there
    is not proposed again."""
    defined = {m.name for m in view.harness.metrics}
    for name in view.ws.harness_names():
        try:
            doc = load_yaml(view.ws.harness_path(name).read_bytes(), name)
            defined |= {m.get("name") for m in doc.get("metrics") or []}
        except (OSError, EvoError, AttributeError):
            continue  # an unreadable revision defines nothing; `validate` reports it
    return defined


def _with_metric(base: dict, entry: CatalogueEntry, name: str, recipe: dict) -> dict:
    """`base` renamed, plus the entry's metric (its params bound to `recipe`) and alert."""
    document = copy.deepcopy(base)
    document["name"] = name
    document["metrics"] = [*document.get("metrics", []), entry.metric_for(recipe)]
    if entry.alert is not None:
        document["alerts"] = [*document.get("alerts", []), copy.deepcopy(entry.alert)]
    return document


def _spread(values: list[float]) -> float:
    """Range relative to the largest magnitude: how far a metric moves over versions."""
    return (max(values) - min(values)) / max(max(abs(v) for v in values), 1e-6)


def _discrimination(
    view: View, gap: Gap, base: str, entry: CatalogueEntry, values: dict[str, dict[str, Any]],
    keyed: dict[str, dict[str, Any]],
) -> tuple[tuple | None, str]:
    """(sort key, last element the discrimination itself; why) of one measured catalogue
    metric for `gap`; (None, "") when the recorded versions do not measure it."""
    metric = entry.metric["name"]

    def measured(versions: list[str]) -> dict[str, float]:
        out = {}
        for v in versions:
            value = (values.get(v) or {}).get(metric)
            if value is not None:
                out[v] = value
        return out

    if gap.kind == UNEXPLAINED:
        # Today's method: the metric that best separates the version from its parent.
        version = gap.version
        parent = view.states[version].parent
        pair = measured([parent, version])
        if len(pair) < 2:
            return None, ""
        separation = abs(pair[version] - pair[parent]) / max(abs(pair[parent]), 1e-6)
        return (separation,), (f"{metric} separates {version} from {parent} "
                               f"({fmt(pair[version])} vs {fmt(pair[parent])})")
    if gap.kind == INDISTINGUISHABLE:
        competing = set(gap.details["skills"])
        named = len((competing | set(gap.details["categories"])) & set(entry.hypotheses))
        if gap.version not in measured([gap.version]):
            return None, ""
        # Where the competing skills were tried, the metric must tell those versions apart;
        # else it must at least move over the recorded versions.
        tried = [v for v in view.states if competing & set(view.applied_skills(v))]
        over = measured(tried) if len(measured(tried)) >= 2 else measured(list(values))
        if len(over) < 2:
            return None, ""
        spread = _spread(list(over.values()))
        return (named, spread), (f"{metric} tests {named} of the competing hypotheses and "
                                 f"moves {spread:.2g} (relative range) over "
                                 f"{', '.join(sorted(over))}")
    if gap.kind == NO_NEXT_STEP:
        stalled = gap.details["stalled"]
        along = measured([*view.chain(base), *stalled])
        if not along:
            return None, ""
        spread = _spread(list(along.values())) if len(along) >= 2 else 0.0
        # A pathology that persists along the lineage moves no metric, yet is what stalls it:
        # a metric whose alert would fire on the stalled base explains the stall and ranks
        # before one that merely moves (then the larger move). An untrained root has no train
        # rollouts to measure: then the alert must fire on every stalled child it measures
        # (each attempt kept the pathology).
        alert = entry.alert
        judged = [base] if base in along else [v for v in stalled if v in along]
        stalls = bool(alert and judged and all(
            fires(alert["when"], {metric: along[v]}, where="catalogue") for v in judged))
        why = (f"{metric} moves {spread:.2g} (relative range) along the stalled lineage "
               f"{', '.join(along)}")
        # Gap (c) is evidence that cannot select the next intervention: among the metrics
        # whose alert explains the stall, one whose alert makes a library skill offer a step
        # not yet taken closes the gap and ranks first; the others leave it open.
        opens = (_next_steps(view, base, [base, *stalled], entry, values, keyed) if stalls
                 else [])
        if stalls:
            shown = ", ".join(f"{v} ({fmt(along[v])})" for v in judged)
            why += f"; its alert {alert['name']} would fire on {shown}"
        if opens:
            why += f"; with its alert {', '.join(opens)} would offer a next step"
        return (stalls, bool(opens), spread if spread > 0 else float(stalls)), why
    return None, ""


def _next_steps(
    view: View, base: str, versions: list[str], entry: CatalogueEntry,
    values: dict[str, dict[str, Any]], keyed: dict[str, dict[str, Any]],
) -> list[str]:
    """The library skills that would fire, with `entry`'s alert added to the diagnosis of a
    version in `versions` where it fires, and change `base`'s recipe: not applied already,
    not refuted on this lineage, not tried from `base`."""
    metric, alert = entry.metric["name"], entry.alert
    if alert is None:
        return []
    recipe = view.ws.resolved_recipe(base, view.states)
    domain = recipe["domain"]["name"]
    closed = set(view.refuted_skills(base)) | {
        s for child in view.children(base) for s in view.applied_skills(child)}
    opens: set[str] = set()
    for version in dict.fromkeys(versions):
        value = (values.get(version) or {}).get(metric)
        diagnosis = view.states[version].records.get("diagnosis")
        if value is None or diagnosis is None or not fires(
                alert["when"], {metric: value}, where="catalogue"):
            continue
        seen = {**diagnosis,
                "keyed": {**(diagnosis.get("keyed") or {}), **(keyed.get(version) or {})},
                "metrics": {**(diagnosis.get("metrics") or {}), metric: {"value": value}},
                "alerts": [*(diagnosis.get("alerts") or []), {"name": alert["name"]}]}
        produced_by = view.ws.resolved_recipe(version, view.states)
        opens |= {m.skill.name for m in match(view.skills, seen, domain=domain,
                                               recipe=produced_by, patch_base=recipe)
                  if not m.applied and m.skill.name not in closed}
    return sorted(opens)
