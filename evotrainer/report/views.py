"""What the report shows, read from the workspace into plain objects the templates draw.

Everything here comes from git (specs and records), the workspace's harness revisions and
skills, and, for example rollouts only, the artifact folder a run record names. Nothing is
written and nothing is trusted: rollout text reaches the page only through autoescape."""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import yaml

from evotrainer.control.reconcile import Context, steps_spent
from evotrainer.diagnosis.harness import LAYERS, HarnessRevision, load_harness, resolve_harness
from evotrainer.errors import EvoError
from evotrainer.evidence.io import read_rollouts
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.report import svg
from evotrainer.skills.library import workspace_library
from evotrainer.skills.skill import Skill
from evotrainer.store import specs
from evotrainer.store.lineage import (
    LineageRow,
    _natural,
    lineage_rows,
    main_frontier,
    proposal_tokens,
)
from evotrainer.store.recipe import BASE_RECIPE
from evotrainer.store.workspace import VersionState, Workspace

EXAMPLES_PER_ALERT = 3  # rollouts shown in full; the alert's other example ids are listed
TEXT_LIMIT = 4000  # characters of a prompt or response shown; the rest is counted
_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,80}$")


def page_file(name: str) -> str:
    """A version's page file name: the name itself when it is a safe file name, else a slug
    made unique by a digest (branch names may hold characters a URL or a disk would not)."""
    if _SAFE_FILE.match(name):
        return f"{name}.html"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:60] or "version"
    return f"{slug}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.html"


# ------------------------------------------------------------------------------ versions


@dataclass
class DiffEntry:
    key: str
    old: str | None  # None: absent on that side
    new: str | None


@dataclass
class MetricView:
    name: str
    value: Any
    trend: float | None
    description: str
    spark: svg.Sparkline | None


@dataclass
class Rollout:
    id: str
    row: dict | None  # None: not found in the artifact folder
    prompt_more: int = 0  # characters clipped from the prompt / response
    response_more: int = 0


@dataclass
class AlertView:
    alert: dict
    examples: list[Rollout]
    more_ids: list[str]


@dataclass
class CriterionView:
    """A version's falsifiable criterion read beside the gate's verdict. The criterion is
    the hypothesis' own test; whether the version goes on is the gate's call, and the two
    can disagree (a leak that makes the score criterion hold is still pruned). So "held"
    is green only beside a promotion, and the note says how the two relate."""

    expression: str
    outcome: str  # held | did not hold | undecided | not tested | not tested yet
    css: str  # supports | caution | refuted | undecided
    note: str


def criterion_view(spec: dict | None, decision: dict, negative: bool) -> CriterionView | None:
    """None when the version states no criterion; `negative`: pruned, reverted or failed."""
    hypothesis = ((spec or {}).get("intervention") or {}).get("hypothesis") or {}
    recorded = decision.get("criterion") or {}
    expression = recorded.get("expression") or hypothesis.get("criterion")
    if not expression:
        return None
    verdict = str(decision.get("verdict") or "")
    if not verdict:
        return CriterionView(expression, "not tested yet", "undecided",
                             "the gate has not decided this version")
    if "held" not in recorded:
        # Decided without the test: an early stop, a failed run, a leak's prune.
        rule = decision.get("rule")
        return CriterionView(expression, "not tested", "undecided",
                             f"the gate decided {verdict}"
                             f"{f' by its rule {rule}' if rule else ''} without testing it")
    held = recorded["held"]
    if held is None:
        return CriterionView(expression, "undecided", "undecided",
                             "a metric it reads is null, so the test could not be made")
    if held is False:
        note = "the hypothesis failed its own test"
        if verdict == "promote":
            note += "; the gate promoted the version on its rules nonetheless"
        return CriterionView(expression, "did not hold", "refuted", note)
    if verdict == "promote" and not negative:
        return CriterionView(expression, "held", "supports",
                             "the hypothesis passed its test and the gate promoted the version")
    blocked = decision.get("blocked_by") or []
    why = f" (blocked by {', '.join(map(str, blocked))})" if blocked else ""
    return CriterionView(expression, "held", "caution",
                         f"the hypothesis passed its test, but the gate's verdict is "
                         f"{verdict or 'not recorded'}{why}: a criterion that holds does not "
                         "overrule the gate")


@dataclass
class VersionPage:
    row: LineageRow
    state: VersionState
    file: str
    children: list[str]
    recipe_diff: list[DiffEntry] | None = None
    recipe_error: str | None = None
    metrics: list[tuple[str, list[MetricView]]] = field(default_factory=list)
    alerts: list[AlertView] = field(default_factory=list)
    evidence_note: str | None = None  # why example rollouts are ids only
    criterion: CriterionView | None = None
    # The run's seeds: its result's, else the resolved recipe's (a run stopped early, or a
    # backend whose result does not list them, still ran the recipe's seeds).
    seeds: list | None = None

    @property
    def css(self) -> str:
        return svg.status_class(self.row.status)

    @property
    def negative(self) -> bool:
        return self.css in svg.NEGATIVE_CLASSES or self.row.pruned

    def record(self, kind: str) -> dict:
        return self.state.records.get(kind) or {}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a recipe; a list of named mappings is keyed by name (as it merges)."""
    if isinstance(value, dict):
        # An empty mapping contributes no key: adding the first entry is one change, not two.
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if (isinstance(value, list) and value
            and all(isinstance(i, dict) and "name" in i for i in value)):
        out = {}
        for item in value:
            rest = {k: v for k, v in item.items() if k != "name"}
            out.update(_flatten(rest, f"{prefix}[{item['name']}]") if rest
                       else {f"{prefix}[{item['name']}]": {}})
        return out
    return {prefix: value}


def _shown(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def recipe_diff(old: dict, new: dict) -> list[DiffEntry]:
    a, b = _flatten(old), _flatten(new)
    return [DiffEntry(key, _shown(a[key]) if key in a else None,
                      _shown(b[key]) if key in b else None)
            for key in sorted(a.keys() | b.keys()) if a.get(key, ...) != b.get(key, ...)]


def _rollout_key(rollout_id: str) -> tuple | None:
    """`version/seed/split/step/group_id/sample_idx` → its fields (a group id may hold '/')."""
    parts = rollout_id.split("/")
    if len(parts) < 6:
        return None
    try:
        return (parts[0], int(parts[1]), parts[2], int(parts[3]), "/".join(parts[4:-1]),
                int(parts[-1]))
    except ValueError:
        return None


class _Evidence:
    """A version's rollout tables, read once per split and only when an alert cites them."""

    def __init__(self, ws: Workspace, state: VersionState) -> None:
        self.folder: Path | None = None
        self.refused: str | None = None
        self.tables: dict[str, pa.Table | None] = {}
        if "seal" in state.record_errors:  # forged: no folder it names is read
            self.refused = state.record_errors["seal"].message
        elif state.run and state.run.artifact_dir:
            try:  # a record edited on a branch cannot show another folder's rollouts
                self.folder = ws.run_dir(state.name, state.records["run"])
            except EvoError as err:
                self.refused = err.message

    def missing(self) -> str | None:
        if self.refused is not None:
            return self.refused
        if self.folder is None:
            return "the run record names no artifact folder"
        if not RunArtifacts(self.folder).rollouts_dir.is_dir():
            return f"the artifact folder {self.folder} is gone"
        return None

    def find(self, ids: list[str]) -> dict[str, dict]:
        keys = {i: k for i in ids if (k := _rollout_key(i))}
        found: dict[str, dict] = {}
        for split in sorted({k[2] for k in keys.values()}):
            table = self._table(split)
            if table is None:
                continue
            groups = pa.array(sorted({k[4] for k in keys.values()}), pa.string())
            rows = table.filter(pc.is_in(table["group_id"], value_set=groups)).to_pylist()
            by_key = {(r["version"], r["seed"], r["split"], r["step"], r["group_id"],
                       r["sample_idx"]): r for r in rows}
            found.update({i: by_key[k] for i, k in keys.items() if k in by_key})
        return found

    def _table(self, split: str) -> pa.Table | None:
        if split not in self.tables:
            path = RunArtifacts(self.folder).rollouts(split)
            try:
                self.tables[split] = read_rollouts(path) if path.is_file() else None
            except (EvoError, OSError, pa.ArrowException):
                self.tables[split] = None  # unreadable: the ids are still listed
        return self.tables[split]


def _clip(text: str | None) -> tuple[str, int]:
    text = text or ""
    return (text[:TEXT_LIMIT], max(0, len(text) - TEXT_LIMIT))


def _alert_views(ws: Workspace, page: VersionPage) -> None:
    alerts = page.record("diagnosis").get("alerts") or []
    evidence = _Evidence(ws, page.state)
    page.evidence_note = evidence.missing() if alerts else None
    cited = [i for a in alerts for i in (a.get("examples") or [])[:EXAMPLES_PER_ALERT]]
    found = evidence.find(cited) if cited and page.evidence_note is None else {}
    for alert in alerts:
        ids = [str(i) for i in alert.get("examples") or []]
        shown = []
        for rollout_id in ids[:EXAMPLES_PER_ALERT]:
            # A copy: two alerts may cite the same rollout, and clipping edits the row.
            row = dict(found[rollout_id]) if rollout_id in found else None
            example = Rollout(rollout_id, row)
            if row is not None:
                row["prompt"], example.prompt_more = _clip(row["prompt"])
                row["response"], example.response_more = _clip(row["response"])
            shown.append(example)
        page.alerts.append(AlertView(alert, shown, ids[EXAMPLES_PER_ALERT:]))


def _metric_views(diagnosis: dict, harness: HarnessRevision | None) -> list:
    described = {m.name: m.description for m in harness.metrics} if harness else {}
    series = diagnosis.get("series") or {}
    by_layer: dict[str, list[MetricView]] = {}
    for name, entry in (diagnosis.get("metrics") or {}).items():
        entry = entry if isinstance(entry, dict) else {"value": entry}
        trend = entry.get("trend")
        if isinstance(trend, float) and abs(trend) < 1e-12:
            trend = 0.0  # a least-squares slope of a flat series is float noise, not a trend
        by_layer.setdefault(entry.get("layer") or "other", []).append(MetricView(
            name, entry.get("value"), trend, described.get(name, ""),
            svg.sparkline(series.get(name))))
    order = [*LAYERS, *sorted(set(by_layer) - set(LAYERS))]
    return [(layer, by_layer[layer]) for layer in order if layer in by_layer]


# ---------------------------------------------------------------------- harness, skills


@dataclass
class HarnessPage:
    name: str
    text: str
    revision: HarnessRevision | None
    error: str | None
    in_force: bool
    diagnosed: list[str]  # versions whose diagnosis was made with this revision
    cases: list[dict]  # backtest cases as written (the parsed revision keeps version/expect)
    diff_base: str | None = None
    diff_why: str = ""
    diff: list[tuple[str, str]] = field(default_factory=list)  # (css, line)


def _diff_lines(old: str, new: str, old_name: str, new_name: str) -> list[tuple[str, str]]:
    lines = []
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(),
                                     f"{old_name}.yaml", f"{new_name}.yaml", lineterm=""):
        css = ("hunk" if line.startswith("@@") else "file" if line.startswith(("+++", "---"))
               else "add" if line.startswith("+") else "del" if line.startswith("-") else "ctx")
        lines.append((css, line))
    return lines


def harness_pages(ws: Workspace, states: dict[str, VersionState]) -> list[HarnessPage]:
    in_force = ws.project.get("harness", "h0")
    used: dict[str, list[str]] = {}
    for name in sorted(states, key=_natural):
        diagnosis = states[name].diagnosis
        if diagnosis and diagnosis.harness_name:
            used.setdefault(diagnosis.harness_name, []).append(name)
    names = sorted(ws.harness_names(), key=_natural)
    pages: list[HarnessPage] = []
    for name in names:
        path = ws.harness_path(name)
        text = path.read_text(encoding="utf-8")
        try:
            revision, error = load_harness(path), None
            cases = [c for c in specs.load_yaml(text, str(path)).get("backtest_cases") or []
                     if isinstance(c, dict)]
        except EvoError as err:
            revision, error, cases = None, str(err), []
        pages.append(HarnessPage(name, text, revision, error, name == in_force,
                                 used.get(name, []), cases))
    texts = {p.name: p.text for p in pages}
    for i, page in enumerate(pages):
        declared = page.revision.parent if page.revision else None
        if declared and declared in texts:
            page.diff_base, page.diff_why = declared, "its declared parent"
        elif i > 0:
            page.diff_base = pages[i - 1].name
            page.diff_why = "the revision before it by name (it declares no parent here)"
        if page.diff_base:
            page.diff = _diff_lines(texts[page.diff_base], page.text, page.diff_base, page.name)
    return pages


@dataclass
class SkillPage:
    skill: Skill
    applied_in: list[str]
    patch: str  # the recipe patch as YAML


# --------------------------------------------------------------------------------- site


@dataclass
class TokenRow:
    version: str
    planner: str
    input: int
    output: int


@dataclass
class Site:
    ws: Workspace
    project: dict
    rows: list[LineageRow]
    versions: dict[str, VersionPage]
    graph: svg.Graph
    chart: svg.Chart
    promoted: list[str]
    current_alerts: list[tuple[str, dict]]  # (version, alert) on the frontier
    settled_alerts: list[tuple[str, dict]]  # on versions already decided or dead
    steps_spent: int
    steps_budget: int | None
    gpu_hours_spent: float  # every run's GPUs × hours (each row's `spend` per version)
    gpu_hours_budget: float | None
    tokens: list[TokenRow]
    tokens_budget: int | None
    harness: list[HarnessPage]
    skills: list[SkillPage]

    @property
    def tokens_total(self) -> int:
        return sum(t.input + t.output for t in self.tokens)


def _promoted_path(rows: list[LineageRow], ws: Workspace,
                   states: dict[str, VersionState]) -> list[str]:
    """Root → main's frontier (main holds one chain of promotions); the first root while
    main holds no promotion nor baseline."""
    frontier = main_frontier(states, {r.name for r in rows if r.on_main})
    if frontier is None:
        return [rows[0].name] if rows else []
    try:
        return [s.name for s in ws.chain(frontier, states)]
    except EvoError:
        return [frontier]


def _tokens(states: dict[str, VersionState]) -> list[TokenRow]:
    out = []
    for name in sorted(states, key=_natural):
        proposal = (states[name].spec or {}).get("proposal") or {}
        if proposal:
            out.append(TokenRow(name, str(proposal.get("planner", "?")),
                                *proposal_tokens(states[name])))
    return out


def _version_pages(ws: Workspace, states: dict[str, VersionState], rows: list[LineageRow],
                   children: dict[str, list[str]]) -> dict[str, VersionPage]:
    """Each version's page: its recipe against its parent's, metrics, alerts, criterion."""
    harness_cache: dict[str, HarnessRevision | None] = {}

    def harness_named(name: str | None) -> HarnessRevision | None:
        if name and name not in harness_cache:
            try:
                harness_cache[name] = resolve_harness(name, ws.root)
            except EvoError:
                harness_cache[name] = None  # the harness page names the problem
        return harness_cache.get(name) if name else None

    pages: dict[str, VersionPage] = {}
    for row in rows:
        state = states[row.name]
        page = VersionPage(row, state, page_file(row.name), children.get(row.name, []))
        if state.spec is not None:
            try:
                new = ws.resolved_recipe(row.name, states)
                old = (ws.resolved_recipe(row.parent, states) if row.parent in states
                       else BASE_RECIPE)
                page.recipe_diff = recipe_diff(old, new)
                page.seeds = new.get("seeds")
            except EvoError as err:
                page.recipe_error = str(err)
        page.seeds = (page.record("run").get("result") or {}).get("seeds") or page.seeds
        diagnosis = page.record("diagnosis")
        page.metrics = _metric_views(diagnosis, harness_named(
            (diagnosis.get("harness") or {}).get("name")))
        _alert_views(ws, page)
        page.criterion = criterion_view(state.spec, page.record("decision"), page.negative)
        pages[row.name] = page
    return pages


def _alerts_by_standing(rows: list[LineageRow], pages: dict[str, VersionPage],
                        children: dict[str, list[str]], promoted: list[str]
                        ) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(current, settled): alerts on the frontier — the current best and every leaf still in
    play — are what the next proposal should answer; alerts on decided or dead branches are
    history."""
    frontier = {promoted[-1]} if promoted else set()
    frontier |= {r.name for r in rows
                 if not children.get(r.name) and not pages[r.name].negative}
    current, settled = [], []
    for row in rows:
        for alert in pages[row.name].record("diagnosis").get("alerts") or []:
            (current if row.name in frontier else settled).append((row.name, alert))
    return current, settled


def _skill_pages(ws: Workspace, states: dict[str, VersionState]) -> list[SkillPage]:
    """The workspace's library, each skill with the versions that applied it."""
    applied: dict[str, list[str]] = {}
    for name in sorted(states, key=_natural):
        for skill in ((states[name].spec or {}).get("intervention") or {}).get("skills") or []:
            applied.setdefault(skill, []).append(name)
    return [SkillPage(s, applied.get(s.name, []),
                      yaml.safe_dump(s.recipe_patch, sort_keys=False).strip()
                      if s.recipe_patch else "")
            for s in workspace_library(ws).values()]


def collect(ws: Workspace) -> Site:
    """Everything the report's pages show, read once from the workspace."""
    states = ws.versions()
    rows = lineage_rows(ws, states)
    by_name = {r.name: r for r in rows}
    hrefs = {r.name: f"versions/{page_file(r.name)}" for r in rows}
    children: dict[str, list[str]] = {}
    for row in rows:
        if row.parent in by_name:
            children.setdefault(row.parent, []).append(row.name)
    pages = _version_pages(ws, states, rows, children)

    promoted = _promoted_path(rows, ws, states)
    on_path = set(promoted)
    off_path = {name: [by_name[c] for c in children.get(name, []) if c not in on_path]
                for name in promoted}
    chart = svg.score_chart([by_name[n] for n in promoted], off_path, hrefs)
    current, settled = _alerts_by_standing(rows, pages, children, promoted)

    autonomy = ws.project.get("autonomy") or {}
    # The harness in force must load, as for reconcile: its error names the file and field.
    harness = resolve_harness(ws.project.get("harness", "h0"), ws.root)
    context = Context(ws, states, harness)
    return Site(
        ws=ws, project=ws.project, rows=rows, versions=pages,
        graph=svg.lineage_graph(rows, hrefs), chart=chart, promoted=promoted,
        current_alerts=current, settled_alerts=settled,
        steps_spent=steps_spent(context), steps_budget=autonomy.get("max_total_steps"),
        gpu_hours_spent=context.gpu_hours_spent or 0.0,
        gpu_hours_budget=autonomy.get("max_gpu_hours"),
        tokens=_tokens(states), tokens_budget=autonomy.get("max_llm_tokens"),
        harness=harness_pages(ws, states), skills=_skill_pages(ws, states),
    )
