"""The skill library: load, search, match triggers against a diagnosis, record evidence.

A skill (`skills/<name>.yaml`, kind Skill) pairs a trigger with a mechanism and the evidence
for and against it. A workspace carries its own copy of the library (`init` copies the built-in
one), so its evidence accumulates in its own git history; outside a workspace the built-in
library is read.

A skill's mechanism is a recipe patch; `mechanism.domain_patches` gives a domain its own
patch where the same intent needs another mechanism there (`Skill.patch_for`).

Triggers are CEL over a diagnosis. Their variables:

- every metric by name, holding its value (`dead_group_ratio > 0.5`);
- `alerts`: the names of the fired alerts (`"leak" in alerts`);
- `trend`: metric name → slope per step, only for metrics that have one
  (`has(trend.reward_mean) && trend.reward_mean > 0.0`);
- `recipe`: the resolved recipe of the version the diagnosis describes, so a trigger can tie
  a symptom to the setting that causes it (`recipe.grpo.temperature < 0.5 &&
  dead_group_ratio > 0.5`). Null where the caller has no version (a standalone diagnosis).

A metric that is null or absent never makes a trigger fire, as in the harness's gate: celpy
cannot compare null (`x != null` itself fails), so an evaluation that fails while reading a
null metric (or a `trend` or `recipe` entry that is not there) counts as "does not fire"; `||`
still fires on its other, non-null branch.

A match whose trigger would not fire without the recipe `names_cause`: a recipe setting
explains the symptom, so it ranks before skills that answer the symptom alone.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evotrainer.diagnosis import cel
from evotrainer.diagnosis.diagnose import evaluate_unless_null
from evotrainer.errors import EvoError
from evotrainer.store import specs
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.recipe import deep_merge

# Verdicts of the gate that count as evidence, and the list each one goes to.
EVIDENCE_LISTS = {
    "promote": "evidence",
    "prune": "negative_evidence",
    "revert": "negative_evidence",
}
SKILL_MODELINE = "# yaml-language-server: $schema=../spec/schemas/skill.schema.json\n"


@dataclass(frozen=True)
class Skill:
    data: dict[str, Any]
    source: str  # the file it came from, for error messages

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def title(self) -> str:
        return self.data.get("title") or self.name

    @property
    def category(self) -> str:
        return self.data["category"]

    @property
    def negative(self) -> bool:
        return bool(self.data.get("negative"))

    @property
    def domains(self) -> list[str]:
        return list(self.data.get("domains") or [])

    @property
    def trigger(self) -> str | None:
        return self.data.get("trigger")

    @property
    def recipe_patch(self) -> dict[str, Any]:
        """The patch for every domain without its own entry in `domain_patches`."""
        return self.data["mechanism"].get("recipe_patch") or {}

    def patch_for(self, domain: str | None) -> dict[str, Any]:
        """The recipe patch this skill applies in `domain`: its `domain_patches` entry when it
        has one (the same intent needs another mechanism there: close-leak disables
        toolenv's `reveal` tool but clears swe's git history), else `recipe_patch`."""
        by_domain = self.data["mechanism"].get("domain_patches") or {}
        if domain is not None and domain in by_domain:
            return by_domain[domain] or {}
        return self.recipe_patch

    @property
    def entry_point(self) -> dict[str, Any] | None:
        return self.data["mechanism"].get("entry_point")

    @property
    def evidence(self) -> list[dict[str, Any]]:
        return list(self.data.get("evidence") or [])

    @property
    def negative_evidence(self) -> list[dict[str, Any]]:
        return list(self.data.get("negative_evidence") or [])

    def applies_to(self, domain: str | None) -> bool:
        """A skill without `domains` applies everywhere; otherwise the domain must be listed."""
        return domain is None or not self.domains or domain in self.domains


# ---------------------------------------------------------------------------------- loading


def load_skill(path: Path, source: str | None = None) -> Skill:
    doc = specs.load(path, "Skill", source=source)
    return Skill(doc.data, doc.source)


def load_library(folder: Path | None = None) -> dict[str, Skill]:
    """Every `*.yaml` skill in `folder` (default: the built-in library), by name."""
    folder = folder or builtin_dir("skills")
    skills = {}
    for path in sorted(folder.glob("*.yaml")):
        skill = load_skill(path, f"{folder.name}/{path.name}")
        if skill.name != path.stem:
            raise EvoError(
                f"name {skill.name!r} does not match the file name",
                where=skill.source,
                field="name",
                hint=f"rename the file to {skill.name}.yaml or fix `name`",
            )
        skills[skill.name] = skill
    return skills


def workspace_library(ws: Any | None) -> dict[str, Skill]:
    """The workspace's `skills/` when it holds any skill, else the built-in library."""
    if ws is not None and ws.skill_names():
        return load_library(ws.root / "skills")
    return load_library()


def skill_overrides(paths: list[Path], domain: str | None) -> dict[str, Any]:
    """The composed recipe overrides of the skills in `paths` for `domain` (nulls kept, to
    remove keys when merged onto a recipe): what a version applying them sets."""
    overrides: dict[str, Any] = {}
    for path in paths:
        skill = load_skill(path, f"skills/{path.name}")
        overrides = deep_merge(overrides, skill.patch_for(domain), keep_nulls=True)
    return overrides


def get_skill(skills: dict[str, Skill], name: str) -> Skill:
    if name not in skills:
        raise EvoError(
            f"unknown skill {name!r}",
            field="NAME",
            hint=f"known skills: {', '.join(sorted(skills)) or 'none'}",
        )
    return skills[name]


# ----------------------------------------------------------------------------------- search

_TOKEN = re.compile(r"[a-z0-9]+")
# Field boosts: a word in the name or title says more about a skill than one in its prose.
_FIELDS = (
    ("name", 3),
    ("title", 3),
    ("category", 2),
    ("domains", 1),
    ("trigger", 1),
    ("description", 1),
    ("expected_effect", 1),
)
_BM25_K1, _BM25_B = 1.2, 0.75


def tokens(text: str) -> list[str]:
    """Lower-case words; `dead_group_ratio` → dead, group, ratio; a plural 's' is dropped."""
    out = []
    for word in _TOKEN.findall(text.lower()):
        if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        out.append(word)
    return out


def _document(skill: Skill) -> list[str]:
    words: list[str] = []
    for field, boost in _FIELDS:
        value = skill.data.get(field)
        text = " ".join(value) if isinstance(value, list) else str(value or "")
        words += tokens(text) * boost
    return words


def search(skills: dict[str, Skill], text: str) -> list[tuple[Skill, float]]:
    """Skills ranked by BM25 relevance to `text` (only those sharing a word with it)."""
    query = set(tokens(text))
    docs = {name: Counter(_document(skill)) for name, skill in skills.items()}
    if not query or not docs:
        return []
    avg_len = sum(sum(d.values()) for d in docs.values()) / len(docs)
    df = Counter(word for d in docs.values() for word in set(d) if word in query)
    ranked = []
    for name, counts in docs.items():
        length = sum(counts.values())
        score = 0.0
        for word in query & set(counts):
            idf = math.log(1 + (len(docs) - df[word] + 0.5) / (df[word] + 0.5))
            tf = counts[word]
            score += (
                idf
                * tf
                * (_BM25_K1 + 1)
                / (tf + _BM25_K1 * (1 - _BM25_B + _BM25_B * length / avg_len))
            )
        if score > 0:
            ranked.append((skills[name], score))
    return sorted(ranked, key=lambda pair: (-pair[1], pair[0].name))


# --------------------------------------------------------------------------------- matching


def trigger_variables(
    diagnosis: dict[str, Any], recipe: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The CEL variables of a diagnosis document and the recipe that produced it (see the
    module docstring)."""
    variables: dict[str, Any] = {}
    trend: dict[str, float] = {}
    for name, entry in (diagnosis.get("metrics") or {}).items():
        if isinstance(entry, dict):
            variables[name] = entry.get("value")
            if entry.get("trend") is not None:
                trend[name] = entry["trend"]
        else:
            variables[name] = entry
    variables["alerts"] = [a["name"] for a in diagnosis.get("alerts") or [] if "name" in a]
    variables["trend"] = trend
    variables["recipe"] = recipe
    return variables


def fires(expr: str, variables: dict[str, Any], *, where: str | None = None) -> bool:
    """Whether a trigger holds; a null or absent metric never makes it fire."""
    try:
        return evaluate_unless_null(expr, variables) is True
    except EvoError as err:
        raise EvoError(
            err.message,
            where=where,
            field="trigger",
            hint="triggers compare metric values; write 2.0 * x, not 2 * x",
        ) from None


@dataclass(frozen=True)
class Match:
    """A skill whose trigger fires, with what made it fire and the evidence behind it."""

    skill: Skill
    values: dict[str, Any]  # what the trigger read (a map's entries as `trend.x`, `recipe.a.b`)
    in_domain: int  # positive evidence from the version's domain
    support: int  # positive evidence, all domains
    against: int  # negative evidence, all domains
    mean_delta: float | None  # mean delta of the positive evidence that has one
    applied: bool  # the version's recipe already has what the patch sets
    names_cause: bool = False  # fires only with the recipe's settings: they explain the symptom

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.skill.name,
            "title": self.skill.title,
            "category": self.skill.category,
            "values": self.values,
            "in_domain": self.in_domain,
            "support": self.support,
            "against": self.against,
            "mean_delta": self.mean_delta,
            "applied": self.applied,
            "names_cause": self.names_cause,
        }


def _evaluate(
    skill: Skill, variables: dict[str, Any], domain: str | None, target: dict[str, Any] | None
) -> Match | None:
    if not skill.trigger or not fires(skill.trigger, variables, where=skill.source):
        return None
    deltas = [e["delta"] for e in skill.evidence if e.get("delta") is not None]
    patch = skill.patch_for(domain)
    names_cause = variables.get("recipe") is not None and not fires(
        skill.trigger, {**variables, "recipe": None}, where=skill.source
    )
    return Match(
        skill=skill,
        values=_read_values(skill.trigger, variables),
        in_domain=sum(e.get("domain") == domain for e in skill.evidence),
        support=len(skill.evidence),
        against=len(skill.negative_evidence),
        mean_delta=sum(deltas) / len(deltas) if deltas else None,
        applied=bool(patch) and target is not None and deep_merge(target, patch) == target,
        names_cause=names_cause,
    )


_MEMBER_PATH = r"\b{name}((?:\.[A-Za-z_]\w*)+)"


def _read_values(expr: str, variables: dict[str, Any]) -> dict[str, Any]:
    """The values `expr` reads: a plain name's value, and for a map (`trend`, `recipe`) each
    dotted entry it reads (`recipe.grpo.temperature: 0.2`) rather than the whole map."""
    values: dict[str, Any] = {}
    for name in sorted(cel.names(expr)):
        value = variables.get(name)
        paths = sorted(set(re.findall(_MEMBER_PATH.format(name=re.escape(name)), expr)))
        if not isinstance(value, dict) or not paths:
            values[name] = value
            continue
        for path in paths:
            entry: Any = value
            for key in path.lstrip(".").split("."):
                entry = entry.get(key) if isinstance(entry, dict) else None
            values[name + path] = entry
    return values


def _rank(m: Match) -> tuple:
    # Evidence from the same domain first (cross-domain transfer is the fallback), then a
    # trigger that ties the symptom to a recipe setting (it names the cause), then the
    # balance of evidence, then the size of the gains.
    return (-m.in_domain, not m.names_cause, -(m.support - m.against), -(m.mean_delta or 0.0),
            m.skill.name)


def match(
    skills: dict[str, Skill],
    diagnosis: dict[str, Any],
    *,
    domain: str | None = None,
    recipe: dict[str, Any] | None = None,
    patch_base: dict[str, Any] | None = None,
) -> list[Match]:
    """Skills a planner may propose for this diagnosis, best first.

    Negative skills never match (see `refusals`), nor skills for another domain. `recipe` is
    the resolved recipe of the version the diagnosis describes (the triggers' `recipe`).
    A skill whose patch changes nothing on `patch_base` (the recipe it would be applied to;
    default `recipe`) is marked `applied` and ranked last: re-applying it would spend a
    version on a no-op.
    """
    variables = trigger_variables(diagnosis, recipe)
    target = patch_base if patch_base is not None else recipe
    found = [
        m
        for s in skills.values()
        if not s.negative and s.applies_to(domain)
        if (m := _evaluate(s, variables, domain, target)) is not None
    ]
    return sorted(found, key=lambda m: (m.applied, _rank(m)))


def refusals(
    skills: dict[str, Skill],
    diagnosis: dict[str, Any],
    *,
    domain: str | None = None,
    recipe: dict[str, Any] | None = None,
) -> list[Match]:
    """Known-harmful skills whose trigger fires: what a planner declines, and why."""
    variables = trigger_variables(diagnosis, recipe)
    found = [
        m
        for s in skills.values()
        if s.negative and s.applies_to(domain)
        if (m := _evaluate(s, variables, domain, None)) is not None
    ]
    return sorted(found, key=lambda m: m.skill.name)


def version_domain(ws: Any, version: str, states: dict | None = None) -> str:
    return ws.resolved_recipe(version, states)["domain"]["name"]


def match_version(ws: Any, version: str) -> tuple[list[Match], list[Match]]:
    """(matches, refusals) for a version's recorded diagnosis, with the workspace library."""
    states = ws.versions()
    state = ws.version(version, states)
    diagnosis = state.records.get("diagnosis")
    if not diagnosis:
        raise EvoError(
            f"version {version!r} has no diagnosis yet",
            where=f"evo/{version}:runs/{version}/diagnosis.yaml",
            hint="run `evotrainer reconcile` to train and diagnose it",
        )
    recipe = ws.resolved_recipe(version, states)
    domain = recipe["domain"]["name"]
    skills = workspace_library(ws)
    return (
        match(skills, diagnosis, domain=domain, recipe=recipe),
        refusals(skills, diagnosis, domain=domain, recipe=recipe),
    )


# --------------------------------------------------------------------------------- evidence


def evidence_entry(version: str, domain: str, decision: dict[str, Any]) -> dict[str, Any]:
    comparison = decision.get("comparison") or {}
    low, high = comparison.get("ci_low"), comparison.get("ci_high")
    harness = (decision.get("harness") or {}).get("name")
    return {
        "version": version,
        "domain": domain,
        "delta": comparison.get("delta"),
        "ci": [low, high] if low is not None and high is not None else None,
        "verdict": decision["verdict"],
        "source": f"gate ({harness})" if harness else "gate",
    }


def with_evidence(data: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any] | None:
    """`data` with `entry` filed under the list its verdict names, replacing an earlier entry
    for the same version (a re-gated version moves); None when nothing would change."""
    target = EVIDENCE_LISTS[entry["verdict"]]
    out = dict(data)
    for key in ("evidence", "negative_evidence"):
        out[key] = [e for e in data.get(key) or [] if e.get("version") != entry["version"]]
    out[target] = out[target] + [entry]
    if all((out[k] or []) == (data.get(k) or []) for k in ("evidence", "negative_evidence")):
        return None
    return out


def pending_evidence(
    ws: Any, version: str, decision: dict[str, Any], states: dict | None = None
) -> dict[str, bytes]:
    """The skill files on `main` that still lack `version`'s gated outcome: {path: new text}.

    promote → `evidence`, prune/revert → `negative_evidence`; other verdicts record nothing.
    Empty once recorded, so reconcile can tell (level-triggered) whether it is still to do.
    """
    if decision.get("verdict") not in EVIDENCE_LISTS:
        return {}
    states = states if states is not None else ws.versions()
    state = ws.version(version, states)
    applied = list(((state.spec or {}).get("intervention") or {}).get("skills") or [])
    if not applied:
        return {}
    entry = evidence_entry(version, version_domain(ws, version, states), decision)
    builtin = builtin_dir("skills")
    files: dict[str, bytes] = {}
    for name in applied:
        path = f"skills/{name}.yaml"
        raw = ws.git.read("main", path)
        if raw is None and (builtin / f"{name}.yaml").is_file():
            raw = (builtin / f"{name}.yaml").read_bytes()  # first evidence on a built-in skill
        if raw is None:
            raise EvoError(
                f"version {version!r} applied skill {name!r}, which is neither in "
                "the workspace nor built in",
                where=f"main:{path}",
                hint=f"restore {path} on main",
            )
        doc = specs.load_text(raw, f"main:{path}", "Skill")
        updated = with_evidence(doc.data, entry)
        if updated is None:
            continue
        text = _leading_comments(raw.decode()) + specs.dump(updated)
        specs.load_text(text, f"main:{path}", "Skill")  # never commit an invalid skill
        files[path] = text.encode()
    return files


def record_evidence(ws: Any, version: str, decision: dict[str, Any]) -> list[str]:
    """File `version`'s gated outcome on every skill it applied: one commit on `main`
    (trailer Action: evidence). Idempotent. Returns the names of the skills that changed."""
    files = pending_evidence(ws, version, decision)
    names = [Path(p).stem for p in files]
    if files:
        ws.git.commit_files(
            "main",
            files,
            f"Evidence from {version} ({decision['verdict']}): {', '.join(names)}",
            {"Action": "evidence", "Version": version},
        )
    return names


def _leading_comments(text: str) -> str:
    """The comment lines at the top of a file (the editor's schema modeline), kept on rewrite."""
    lines = []
    for line in text.splitlines(keepends=True):
        if not line.startswith("#"):
            break
        lines.append(line)
    return "".join(lines) or SKILL_MODELINE
