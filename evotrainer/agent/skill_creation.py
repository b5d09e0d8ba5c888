"""Skill creation: a promoted intervention that no library skill describes becomes a skill.

A hand-made version (`version new --set`) or an LLM planner's proposal that the gate
promoted is knowledge the library does not hold yet. `propose_skill` writes it as a skill
spec, for review, as one commit on the branch `skill/<name>` forked from main (merge it to
adopt the skill; nothing on main changes until then):

- trigger: the alerts of the parent's diagnosis that motivated the change and that the
  version no longer fires (`"dead_groups" in alerts || ...`); all of the parent's alerts
  when none went away; `trigger=` overrides it, and a parent without alerts needs it;
- mechanism: the version's recipe overrides against its parent's resolved recipe, as the
  library writes patches — a number as a move from the recipe's value (`{direction: raise,
  min: 0.002}` where the parent had less), a name or a flag as it is — checked to resolve
  on the parent's recipe to exactly the values the version trained with;
- evidence: the gate's outcome (Δ, CI; `skills.evidence_entry`) with the case that
  motivated it (the alert pattern) in its note;
- description, criterion: the version's rationale and falsifiable criterion.

It validates against skill.schema.json before anything is written. A version that applied
library skills, or whose change a non-negative library skill already makes on the same
recipe, is refused: its evidence belongs on that skill (reconcile records it there).
"""

from __future__ import annotations

import re
from typing import Any

from evotrainer import API_VERSION
from evotrainer.errors import EvoError
from evotrainer.skills.library import workspace_library
from evotrainer.skills.skill import (
    SKILL_MODELINE,
    Skill,
    check_operations,
    evidence_entry,
    resolve_patch,
    resolve_skill,
)
from evotrainer.stats import confidence_label
from evotrainer.store import cel, specs
from evotrainer.store.recipe import _is_named_list, deep_merge
from evotrainer.store.workspace import VersionState, Workspace

SKILL_BRANCH_PREFIX = "skill/"
# The recipe section a change lives in → the skill category it belongs to.
CATEGORY_BY_SECTION = {"reward": "reward", "group_filter": "filter", "environment": "tooling",
                       "data": "curriculum", "grpo": "stability", "eval": "eval-protocol"}
_NAME_CHARS = re.compile(r"[^a-z0-9_-]+")


def patch_from_overrides(overrides: dict[str, Any], parent: Any) -> dict[str, Any]:
    """The library patch that moves `parent` (a resolved recipe, or a part of it) to the
    values `overrides` sets (see the module docstring)."""
    parent = parent if isinstance(parent, dict) else {}
    patch: dict[str, Any] = {}
    for key, value in overrides.items():
        before = parent.get(key)
        if _is_named_list(value):
            index = {e["name"]: e for e in before or [] if isinstance(e, dict) and "name" in e}
            patch[key] = [{"name": e["name"], **patch_from_overrides(
                {k: v for k, v in e.items() if k != "name"}, index.get(e["name"]))}
                for e in value]
        elif isinstance(value, dict) and value and isinstance(before, dict):
            patch[key] = patch_from_overrides(value, before)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numeric = isinstance(before, (int, float)) and not isinstance(before, bool)
            if numeric and value < before:
                patch[key] = {"direction": "lower", "max": value}
            elif before is None or numeric:
                patch[key] = {"direction": "raise", "min": value}
            else:
                patch[key] = {"set": value}
        elif isinstance(value, (dict, list)):
            patch[key] = {"set": value}  # a whole configuration, or one the parent lacks
        else:
            patch[key] = value  # a flag, a name, or null (removes the key)
    return patch


def _keys(overrides: Any, prefix: str = "") -> list[str]:
    if not isinstance(overrides, dict) or not overrides:
        return [prefix] if prefix else []
    return [k for key, value in overrides.items()
            for k in _keys(value, f"{prefix}.{key}" if prefix else str(key))]


def skill_document(ws: Workspace, version: str, *, name: str | None = None,
                   category: str | None = None, trigger: str | None = None) -> dict[str, Any]:
    """The Skill spec `version`'s promoted intervention makes (see the module docstring)."""
    states = ws.versions()
    state = ws.version(version, states)
    decision = _promoted(state)
    overrides = _own_change(state)
    parent_recipe = ws.resolved_recipe(state.parent, states)
    domain = parent_recipe["domain"]["name"]
    library = workspace_library(ws)
    patch = _relative_patch(ws, state, overrides, parent_recipe, states, library)
    before, after = (_alert_names(states[state.parent]), _alert_names(state))
    gone = [a for a in before if a not in after]
    trigger = trigger if trigger is not None else _trigger(state.parent, gone or before)
    cel.check(trigger)
    keys = _keys(overrides)
    category = category or CATEGORY_BY_SECTION.get(keys[0].split(".")[0], "tooling")
    name = _skill_name(name, version, keys[0], library)
    intervention = (state.spec or {}).get("intervention") or {}
    hypothesis = intervention.get("hypothesis") or {}
    entry = evidence_entry(version, domain, decision)
    entry["note"] = (f"created from {version} (parent {state.parent}); motivated by "
                     f"{', '.join(before) or 'no alert'}"
                     + (f", gone after: {', '.join(gone)}" if gone else ""))
    document: dict[str, Any] = {
        "apiVersion": API_VERSION, "kind": "Skill", "name": name,
        "title": f"{', '.join(keys)} as {version} set it",
        "category": category,
        "description": " ".join(filter(None, [
            str(intervention.get("rationale") or "").strip(),
            str(hypothesis.get("statement") or "").strip()])) or f"the change of {version}",
        "trigger": trigger,
        "mechanism": {"recipe_patch": patch},
        "domains": [domain],
        "expected_effect": _effect(decision.get("comparison") or {}, version, state.parent),
        "evidence": [entry],
        "negative_evidence": [],
    }
    if hypothesis.get("criterion"):
        document["criterion"] = hypothesis["criterion"]
    text = SKILL_MODELINE + specs.dump(document)
    doc = specs.load_text(text, f"skills/{name}.yaml", "Skill")  # the schema, with positions
    check_operations(Skill(doc.data, f"skills/{name}.yaml"))
    return document


def _promoted(state: VersionState) -> dict[str, Any]:
    """The version's decision record, which must be a promotion: its evidence is the gate's."""
    decision = state.records.get("decision") or {}
    if decision.get("verdict") != "promote":
        raise EvoError(f"{state.name} was not promoted (verdict "
                       f"{decision.get('verdict') or 'none yet'})",
                       where=state.record_where("decision"), field="verdict",
                       hint="only an intervention the gate promoted becomes a skill; its "
                       "evidence is the gate's")
    return decision


def _own_change(state: VersionState) -> dict[str, Any]:
    """The recipe overrides the version made by hand: a version that applied library skills
    has its evidence recorded on them, and one without a change has nothing to generalise."""
    spec = state.spec or {}
    applied = list((spec.get("intervention") or {}).get("skills") or [])
    if applied:
        raise EvoError(f"{state.name} applied library skill(s) {', '.join(applied)}",
                       where=state.spec_source, field="intervention.skills",
                       hint="its evidence is recorded on them (reconcile does it); a new "
                       "skill is for a change no library skill makes")
    overrides = spec.get("recipe") or {}
    if not overrides or state.parent is None:
        raise EvoError(f"{state.name} changes no recipe value of a parent",
                       where=state.spec_source, field="recipe",
                       hint="a skill is a recipe change; there is nothing to generalise")
    return overrides


def _relative_patch(ws: Workspace, state: VersionState, overrides: dict[str, Any],
                    parent_recipe: dict[str, Any], states: dict[str, VersionState],
                    library: dict[str, Skill]) -> dict[str, Any]:
    """The overrides as a library patch, checked to resolve on the parent's recipe to exactly
    the version's, and to be no change a non-negative library skill already makes there."""
    patch = patch_from_overrides(overrides, parent_recipe)
    resolution = resolve_patch(patch, parent_recipe, where=state.spec_source)
    if deep_merge(parent_recipe, resolution.overrides) != ws.resolved_recipe(state.name, states):
        raise EvoError(f"{state.name}'s change cannot be written as a relative patch "
                       f"({resolution.reason})", where=state.spec_source, field="recipe",
                       hint="write the skill by hand under skills/")
    domain = parent_recipe["domain"]["name"]
    for known in library.values():
        if not known.negative and known.applies_to(domain) and \
                resolve_skill(known, parent_recipe).overrides == resolution.overrides:
            raise EvoError(f"{state.name}'s change is what library skill {known.name!r} makes "
                           f"on {state.parent}'s recipe", where=state.spec_source,
                           field="recipe", hint=f"its evidence belongs on {known.name}: "
                           f"apply it as --skill {known.name} next time")
    return patch


def _alert_names(state: VersionState) -> list[str]:
    diagnosis = state.records.get("diagnosis") or {}
    return sorted({a["name"] for a in diagnosis.get("alerts") or [] if "name" in a})


def _trigger(parent: str, motivating: list[str]) -> str:
    """The CEL trigger: any of the alerts that motivated the change."""
    if not motivating:
        raise EvoError(f"{parent}'s diagnosis fired no alert, so nothing says when this "
                       "change applies", field="--trigger",
                       hint="pass --trigger with a CEL condition over a diagnosis, e.g. "
                       "'dead_group_ratio > 0.5'")
    return " || ".join(f'"{a}" in alerts' for a in motivating)


def _skill_name(name: str | None, version: str, first_key: str,
                library: dict[str, Skill]) -> str:
    name = name or _NAME_CHARS.sub("-", f"{version}-{first_key}".lower().replace(".", "-"))[:63]
    name = name.strip("-_") or version
    if name in library:
        raise EvoError(f"the library already has a skill named {name!r}", field="--name",
                       hint="pass another --name")
    return name


def _effect(comparison: dict[str, Any], version: str, parent: str) -> str:
    if comparison.get("delta") is None:
        return f"as {version} against {parent}"
    ci = ""
    if comparison.get("ci_low") is not None and comparison.get("ci_high") is not None:
        ci = (f", {confidence_label(comparison)} [{comparison['ci_low']:+.4f}, "
              f"{comparison['ci_high']:+.4f}]")
    p = f", p={comparison['p_bootstrap']:.4f}" if comparison.get("p_bootstrap") is not None \
        else ""
    return f"Avg@k {comparison['delta']:+.4f}{ci}{p} ({version} against {parent})"


def propose_skill(ws: Workspace, version: str, **options: Any) -> dict[str, Any]:
    """Write the skill `version` makes as one commit on `skill/<name>` from main (for
    review; merging it adopts the skill). Returns {name, branch, commit, path, skill}."""
    document = skill_document(ws, version, **options)
    name = document["name"]
    branch = f"{SKILL_BRANCH_PREFIX}{name}"
    if ws.git.rev(f"refs/heads/{branch}") is not None:
        raise EvoError(f"skill {name!r} is already proposed on {branch}", field="--name",
                       hint=f"review it (`git diff main...{branch}`), or pass another --name")
    path = f"skills/{name}.yaml"
    commit = ws.git.commit_files(
        branch, {path: (SKILL_MODELINE + specs.dump(document)).encode()},
        f"Propose skill {name} from {version}: {document['expected_effect']}\n\n"
        f"Trigger: {document['trigger']}. Merge this branch into main to add it to the "
        "library.",
        {"Action": "propose-skill", "Version": version, "Skill": name}, start="main")
    return {"name": name, "branch": branch, "commit": commit, "path": path,
            "skill": document}
