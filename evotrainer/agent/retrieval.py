"""Retrieval over the knowledge the project holds offline: the memory planners cite.

What is searched (each item says where it came from: `Retrieved.cite()`):

- every recorded decision of this workspace and of the other workspaces the project lists
  (`skill_library.workspaces`, or `workspaces=` here): the version, its parent, the
  diagnosis alerts that motivated it (the parent's), the intervention (skills, recipe
  overrides, rationale), the verdict with its Δ, CI and p — kind `decision`;
- every recorded diagnosis: the alerts a version fired, with the values they fired on —
  kind `diagnosis`;
- case memory: an alert pattern that recurred before two or more decided versions of one
  workspace, with what each one tried and how it ended — kind `case`;
- every skill of the workspace's library and of the shared library (`skill_library.repo`):
  trigger, mechanism, expected effect — kind `skill`; and each evidence entry of a skill,
  the sources it cites (a paper's run, another workspace's gate) — kind `skill-evidence`.

Scoring is deterministic and documented here: relevance = 2 × the alert names an item
shares with the query + 1 × the metric names it shares + BM25 of the query's words (its
text, alert and metric names) over the item's text (skills.bm25, the library search's
scorer). Items with no relevance are dropped; an item of the query's domain gets +0.5, so
in-domain knowledge ranks first and another domain's is the fallback the method describes,
not hidden. Ties break by kind, then by citation.

API (for planners):

    from evotrainer.agent.retrieval import Query, SearchTrace, query_for, retrieve
    query = query_for(diagnosis, domain="arith")      # alerts, out-of-band metrics
    trace = SearchTrace()
    found = retrieve(ws, query, limit=5, trace=trace)  # list[Retrieved], best first
    found[0].cite()   # "workspace swe-ws, version v3 @ 1a2b3c4d5e6f (runs/v3/decision.yaml)"
    found[0].as_dict()  # kind, title, text, score, domain, alerts, data, cite
    proposal.proposal["retrieval"] = trace.as_list()  # queries, sources, what was retrieved

Records of another workspace are data, read through that workspace's own checked reader:
with its record key (in its own .evotrainer/) forged records are dropped as they are there;
without it nothing can be verified, and each such citation says `unverified`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.skills.library import SharedLibrary, library_config, shared_library
from evotrainer.skills.skill import Skill, bm25, load_library, tokens
from evotrainer.store import cel
from evotrainer.store.workspace import PROJECT_FILE, OldLayout, Workspace, run_path

ALERT_WEIGHT, METRIC_WEIGHT, DOMAIN_BONUS = 2.0, 1.0, 0.5
# Tie order: the most specific first.
KINDS = ("case", "decision", "diagnosis", "skill-evidence", "skill")
# A trigger's alert test: `"dead_groups" in alerts`.
_ALERT_TEST = re.compile(r"""["']([A-Za-z_][A-Za-z0-9_]*)["']\s+in\s+alerts\b""")
_TRIGGER_VARIABLES = frozenset({"alerts", "trend", "recipe"})


@dataclass(frozen=True)
class Query:
    """What to look for: free text, fired alert names, metric names, the asking domain."""

    text: str = ""
    alerts: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    domain: str | None = None

    def words(self) -> set[str]:
        return set(tokens(" ".join([self.text, *self.alerts, *self.metrics])))

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "alerts": list(self.alerts), "metrics": list(self.metrics),
                "domain": self.domain}


@dataclass(frozen=True)
class Retrieved:
    """One piece of recorded knowledge and where it came from."""

    kind: str  # decision, diagnosis, case, skill, skill-evidence
    title: str
    text: str  # what it says, as searched
    origin: str  # "workspace NAME", "skill library REPO@REF", "built-in library"
    path: str  # the file it was read from
    commit: str | None = None
    version: str | None = None
    domain: str | None = None
    domains: tuple[str, ...] = ()
    alerts: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    data: dict[str, Any] = field(default_factory=dict)
    unverified: bool = False
    score: float = 0.0

    def cite(self) -> str:
        where = self.origin
        if self.kind in ("skill", "skill-evidence"):
            where += f", skill {self.title}"
        if self.version is not None:
            where += f", {'evidence ' if self.kind == 'skill-evidence' else 'version '}" \
                f"{self.version}"
        if self.commit:
            where += f" @ {self.commit[:12]}"
        note = ", unverified" if self.unverified else ""
        return f"{where} ({self.path}{note})"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "title": self.title, "text": self.text,
                "score": round(self.score, 4), "domain": self.domain,
                "domains": list(self.domains), "alerts": list(self.alerts),
                "data": self.data, "cite": self.cite()}


@dataclass
class SearchTrace:
    """The search trace of one decision: each query, the sources searched, the citations
    retrieved; recorded with the proposal (`proposal.retrieval`)."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    def record(self, query: Query, sources: list[str], found: list[Retrieved]) -> None:
        self.entries.append({"query": query.as_dict(), "sources": sources,
                             "retrieved": [r.cite() for r in found]})

    def cites(self) -> set[str]:
        return {c for entry in self.entries for c in entry["retrieved"]}

    def as_list(self) -> list[dict[str, Any]]:
        return [dict(entry) for entry in self.entries]


def query_for(diagnosis: dict[str, Any] | None, domain: str | None = None,
              text: str = "") -> Query:
    """The query a diagnosis asks: its fired alerts and the metrics they fired on."""
    alerts = (diagnosis or {}).get("alerts") or []
    return Query(text=text, alerts=tuple(sorted({a["name"] for a in alerts if "name" in a})),
                 metrics=tuple(sorted({a["metric"] for a in alerts if a.get("metric")})),
                 domain=domain)


def retrieve(ws: Workspace, query: Query, limit: int = 10, *,
             workspaces: tuple[str | Path, ...] = (), trace: SearchTrace | None = None,
             states: dict | None = None) -> list[Retrieved]:
    """The `limit` most relevant items for `query` (see the module docstring)."""
    items, sources = knowledge(ws, workspaces=workspaces, states=states)
    words = query.words()
    text_scores = bm25({i: Counter(tokens(item.text)) for i, item in enumerate(items)}, words)
    ranked = []
    for i, item in enumerate(items):
        relevance = (ALERT_WEIGHT * len(set(item.alerts) & set(query.alerts))
                     + METRIC_WEIGHT * len(set(item.metrics) & set(query.metrics))
                     + text_scores.get(i, 0.0))
        if relevance <= 0:
            continue
        local = query.domain is not None and (query.domain == item.domain
                                              or query.domain in item.domains)
        ranked.append(_scored(item, relevance + (DOMAIN_BONUS if local else 0.0)))
    ranked.sort(key=lambda r: (-r.score, KINDS.index(r.kind), r.cite()))
    found = ranked[:limit]
    if trace is not None:
        trace.record(query, sources, found)
    return found


def _scored(item: Retrieved, score: float) -> Retrieved:
    return Retrieved(**{**item.__dict__, "score": score})


# ------------------------------------------------------------------------------- sources


def knowledge(ws: Workspace, *, workspaces: tuple[str | Path, ...] = (),
              states: dict | None = None) -> tuple[list[Retrieved], list[str]]:
    """Every retrievable item and the names of the sources they came from."""
    items = workspace_items(ws, states if states is not None else ws.versions())
    sources = [f"workspace {_name(ws)}"]
    listed = [*(library_config(ws).get("workspaces") or []), *workspaces]
    for path in dict.fromkeys(str(p) for p in listed):
        other = _other_workspace(ws, path)
        if other.root == ws.root:
            continue
        items += workspace_items(other, other.versions())
        sources.append(f"workspace {_name(other)}")
    local = load_library(ws.root / "skills") if ws.skill_names() else load_library()
    origin = f"workspace {_name(ws)}" if ws.skill_names() else "built-in library"
    items += skill_items(local, origin, ws.git.rev("refs/heads/main"))
    shared = shared_library(ws)
    if shared is not None:
        seen = {(i.title, i.path.rsplit("/", 1)[-1], _entry_id(i)) for i in items
                if i.kind == "skill-evidence"}
        items += [i for i in _library_items(shared)
                  if (i.kind == "skill" and i.title not in local)
                  or (i.kind == "skill-evidence"
                      and (i.title, i.path.rsplit("/", 1)[-1], _entry_id(i)) not in seen)]
        sources.append(f"skill library {shared.repo}@{shared.ref}")
    return items, sources


def _entry_id(item: Retrieved) -> tuple:
    entry = item.data.get("entry") or {}
    return (entry.get("version"), entry.get("domain"), entry.get("source"))


def _library_items(shared: SharedLibrary) -> list[Retrieved]:
    return skill_items(shared.skills, f"skill library {shared.repo}@{shared.ref}",
                       shared.commit)


def _name(ws: Workspace) -> str:
    return str(ws.project.get("name") or ws.root.name)


def _other_workspace(ws: Workspace, path: str) -> Workspace:
    try:
        return Workspace(ws.root / path)
    except EvoError as err:
        # A workspace in an older layout is fixed there; anything else here, by the listing.
        hint = (f"in {path}: {err.hint}" if isinstance(err, OldLayout)
                else "list workspace folders (with spec/project.yaml), or remove it")
        raise EvoError(f"listed workspace {path!r} cannot be read: {err.message}",
                       where=PROJECT_FILE, field="skill_library.workspaces", hint=hint
                       ) from None


def workspace_items(ws: Workspace, states: dict) -> list[Retrieved]:
    """A workspace's decided versions, its diagnoses' alerts, then its recurring cases."""
    origin = f"workspace {_name(ws)}"
    decided, diagnosed = [], []
    for name, state in sorted(states.items()):
        own = state.records.get("diagnosis") or {}
        if own.get("alerts"):
            diagnosed.append(_diagnosis_item(ws, states, name, state, own, origin))
        decision = state.records.get("decision") or {}
        if state.parent is None or not decision.get("verdict"):
            continue
        parent = states.get(state.parent)
        motivating = (parent.records.get("diagnosis") or {}) if parent else {}
        decided.append(_decision_item(ws, states, name, state, decision, motivating, own,
                                      origin, state.unverified))
    return decided + diagnosed + _cases(decided, origin)


def _domain(ws: Workspace, name: str, states: dict) -> str | None:
    try:
        return ws.resolved_recipe(name, states)["domain"]["name"]
    except EvoError:
        return None  # a spec that no longer resolves still recorded what it saw


def _diagnosis_item(ws: Workspace, states: dict, name: str, state: Any, diagnosis: dict,
                    origin: str) -> Retrieved:
    alerts = [a for a in diagnosis.get("alerts") or [] if "name" in a]
    fired = "; ".join(
        f"{a['name']} ({a.get('severity') or '?'}) on {a.get('metric') or '?'}"
        + (f" = {a['value']:.4g}" if isinstance(a.get("value"), (int, float)) else "")
        + (f": {a['message']}" if a.get("message") else "") for a in alerts)
    return Retrieved(
        kind="diagnosis", title=f"{name}: {', '.join(a['name'] for a in alerts)}",
        text=f"{name} diagnosed by {(diagnosis.get('harness') or {}).get('name') or '?'}: "
             f"{fired}.",
        origin=origin, path=run_path(name, "diagnosis.yaml"), commit=state.sha, version=name,
        domain=_domain(ws, name, states), alerts=tuple(sorted({a["name"] for a in alerts})),
        metrics=tuple(sorted({a["metric"] for a in alerts if a.get("metric")})),
        data={"alerts": [{k: a.get(k) for k in ("name", "severity", "metric", "value")}
                         for a in alerts]},
        unverified=state.unverified)


def _decision_item(ws: Workspace, states: dict, name: str, state: Any, decision: dict,
                   motivating: dict, own: dict, origin: str, unverified: bool) -> Retrieved:
    spec = state.spec or {}
    intervention = spec.get("intervention") or {}
    skills = list(intervention.get("skills") or [])
    overrides = spec.get("recipe") or {}
    domain = _domain(ws, name, states)
    comparison = decision.get("comparison") or {}
    before = [a["name"] for a in motivating.get("alerts") or [] if "name" in a]
    after = [a["name"] for a in own.get("alerts") or [] if "name" in a]
    metrics = {a["metric"] for a in [*(motivating.get("alerts") or []), *(own.get("alerts") or [])]
               if a.get("metric")}
    what = ", ".join(skills) or ", ".join(f"{k}" for k in _dotted(overrides)) or "no change"
    numbers = _numbers(comparison)
    text = (f"{name} from {state.parent}: {what}. {intervention.get('rationale') or ''} "
            f"Parent alerts: {', '.join(before) or 'none'}; own alerts: "
            f"{', '.join(after) or 'none'}. Verdict {decision['verdict']}{numbers}. "
            f"{decision.get('reason') or ''}")
    return Retrieved(
        kind="decision", title=f"{name}: {what} → {decision['verdict']}", text=text,
        origin=origin, path=run_path(name, "decision.yaml"), commit=state.sha, version=name,
        domain=domain, alerts=tuple(sorted(set(before))), metrics=tuple(sorted(metrics)),
        data={"parent": state.parent, "skills": skills, "overrides": overrides,
              "verdict": decision["verdict"], "delta": comparison.get("delta"),
              "ci": [comparison.get("ci_low"), comparison.get("ci_high")],
              "p": comparison.get("p_bootstrap"), "alerts_after": sorted(set(after))},
        unverified=unverified)


def _numbers(comparison: dict) -> str:
    if comparison.get("delta") is None:
        return ""
    out = f", Δ {comparison['delta']:+.4f}"
    if comparison.get("ci_low") is not None and comparison.get("ci_high") is not None:
        out += f" CI [{comparison['ci_low']:+.4f}, {comparison['ci_high']:+.4f}]"
    if comparison.get("p_bootstrap") is not None:
        out += f" p={comparison['p_bootstrap']:.4f}"
    return out


def _dotted(overrides: Any, prefix: str = "") -> list[str]:
    if not isinstance(overrides, dict) or not overrides:
        return [prefix] if prefix else []
    out = []
    for key, value in overrides.items():
        out += _dotted(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def _cases(decided: list[Retrieved], origin: str) -> list[Retrieved]:
    """Case memory: the same alert pattern before two or more decided versions."""
    by_pattern: dict[tuple[str, ...], list[Retrieved]] = {}
    for item in decided:
        if item.alerts:
            by_pattern.setdefault(item.alerts, []).append(item)
    cases = []
    for pattern, seen in sorted(by_pattern.items()):
        if len(seen) < 2:
            continue
        outcomes = "; ".join(f"{i.version} {i.title.split(': ', 1)[1]}"
                             + (f" Δ {i.data['delta']:+.4f}" if i.data["delta"] is not None
                                else "") for i in seen)
        domains = tuple(sorted({i.domain for i in seen if i.domain}))
        cases.append(Retrieved(
            kind="case", title=f"recurring {' + '.join(pattern)} ({len(seen)} versions)",
            text=f"Alert pattern {', '.join(pattern)} recurred before "
                 f"{', '.join(str(i.version) for i in seen)}: {outcomes}.",
            origin=origin, path=", ".join(i.path for i in seen),
            version=",".join(str(i.version) for i in seen), domain=domains[0] if len(
                domains) == 1 else None, domains=domains, alerts=pattern,
            metrics=tuple(sorted({m for i in seen for m in i.metrics})),
            data={"versions": {str(i.version): {"commit": i.commit, **i.data} for i in seen}},
            unverified=any(i.unverified for i in seen)))
    return cases


def skill_items(skills: dict[str, Skill], origin: str, commit: str | None) -> list[Retrieved]:
    """Each skill, and each evidence entry it cites, as retrievable items."""
    out = []
    for name, skill in sorted(skills.items()):
        trigger = skill.trigger or ""
        alerts = tuple(sorted(set(_ALERT_TEST.findall(trigger))))
        metrics = tuple(sorted(cel.names(trigger) - _TRIGGER_VARIABLES)) if trigger else ()
        path = skill.source.rsplit(":", 1)[-1] if ":" in skill.source else skill.source
        path = path if path.startswith("skills/") else f"skills/{name}.yaml"
        described = " ".join(str(skill.data.get(k) or "") for k in (
            "title", "description", "expected_effect", "criterion"))
        out.append(Retrieved(
            kind="skill", title=name, text=f"{name} {skill.category} {described} "
            f"trigger {trigger}", origin=origin, path=path, commit=commit,
            domains=tuple(skill.domains), alerts=alerts, metrics=metrics,
            data={"category": skill.category, "negative": skill.negative,
                  "trigger": trigger, "support": len(skill.evidence),
                  "against": len(skill.negative_evidence)}))
        for key, sign in (("evidence", "for"), ("negative_evidence", "against")):
            for entry in skill.data.get(key) or []:
                delta = entry.get("delta")
                out.append(Retrieved(
                    kind="skill-evidence", title=name,
                    text=f"{name} {skill.title} evidence {sign}: {entry.get('version')} "
                         f"({entry.get('domain') or 'any domain'}) "
                         f"{entry.get('verdict') or ''}"
                         f"{f' Δ {delta:+.4f}' if delta is not None else ''}; "
                         f"source {entry.get('source') or '?'}. {entry.get('note') or ''}",
                    origin=origin, path=path, commit=commit, version=entry.get("version"),
                    domain=entry.get("domain"), alerts=alerts, metrics=metrics,
                    data={"skill": name, "list": key, "entry": entry}))
    return out
