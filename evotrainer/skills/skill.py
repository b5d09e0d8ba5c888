"""The skill library: load, search, match triggers against a diagnosis, record evidence.

A skill (`skills/<name>.yaml`, kind Skill) pairs a trigger with a mechanism and the evidence
for and against it. A workspace carries its own copy of the library (`init` copies the built-in
one), so its evidence accumulates in its own git history; outside a workspace the built-in
library is read.

A skill's mechanism is a recipe patch; `mechanism.domain_patches` gives a domain its own
patch where the same intent needs another mechanism there (`Skill.patch_for`).

A patch moves the recipe it is applied to; it never writes a magnitude blind. A number in a
patch is an operation on the value the recipe already has, with its declared direction:

- `{direction: raise, multiply: 2, min: 16, max: 32768}`: twice the value, at least 16 (a
  floor), at most 32768 (a ceiling); `add: 0.2` instead of `multiply` adds a step;
- `{direction: raise, min: 0.1}`: at least 0.1 (installs 0.1 where the value is not set);
- `{direction: lower, multiply: 0.1, min: 1e-7, max: 1e-4}`: a tenth, within the bounds;
- `{set: V}`: an absolute value, for booleans, names and whole configurations (a group
  filter with its parameters); a bare boolean, string or null in a patch is the same.

A raise never lowers and a lower never raises: a value already past the bound stays where it
is, and that key makes no change. `resolve_skill` turns a patch into the concrete values a
version spec records (so `git diff` shows numbers, not operations); a skill whose patch
changes nothing on a recipe (every value already at its bound) is not proposed for it, and
`Resolution.reason` says why.

Triggers are CEL over a diagnosis. Their variables:

- every metric by name, holding its value (`dead_group_ratio > 0.5`);
- `alerts`: the names of the fired alerts (`"leak" in alerts`);
- `trend`: metric name → slope per step, only for metrics that have one
  (`has(trend.reward_mean) && trend.reward_mean > 0.0`);
- `recipe`: the resolved recipe of the version the diagnosis describes, so a trigger can tie
  a symptom to the setting that causes it (`recipe.grpo.temperature < 0.5 &&
  dead_group_ratio > 0.5`). Null where the caller has no version (a standalone diagnosis);
- `keyed`: keyed metric name → {key: value}, each key's value of a keyed metric (the
  per-component `reward_alignment`: `keyed.reward_alignment["efficiency"] < 0.15`).

A skill may `bind` variables (`bind: {component: CEL expression}`) evaluated over the same
variables when its trigger fires; `{component}` in the mechanism's strings is replaced by
the bound value (a string that is exactly `{component}` takes the value with its type), so
one skill acts on whichever component a diagnosis names. A binding that fails or is null
means the skill does not fire. A bound skill (`Skill.bound`) is what the patch, the
backtest and the version spec read; an unbound one cannot be applied.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.store import cel, specs
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.recipe import _is_named_list, deep_merge
from evotrainer.store.specs import schema_modeline

# Verdicts of the gate that count as evidence, and the list each one goes to.
EVIDENCE_LISTS = {
    "promote": "evidence",
    "prune": "negative_evidence",
    "revert": "negative_evidence",
}
SKILL_MODELINE = schema_modeline("skills/x.yaml", "Skill")


# A placeholder of a bound variable in a mechanism string.
_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")


@dataclass(frozen=True)
class Skill:
    data: dict[str, Any]
    source: str  # the file it came from, for error messages
    # Variable → value bound when its trigger fired; its mechanism has them substituted.
    bindings: dict[str, Any] = field(default_factory=dict)

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

    @property
    def bind(self) -> dict[str, str]:
        """Variable → the CEL expression that binds it when the trigger fires."""
        return dict(self.data.get("bind") or {})

    @property
    def unbound(self) -> bool:
        """Whether its mechanism still holds placeholders: it names no concrete setting."""
        return bool(self.bind) and not self.bindings

    def bound(self, bindings: dict[str, Any]) -> Skill:
        """This skill with `bindings` substituted into its mechanism's strings."""
        data = {**self.data, "mechanism": _substitute(self.data["mechanism"], bindings)}
        return Skill(data, self.source, dict(bindings))

    def applies_to(self, domain: str | None) -> bool:
        """A skill without `domains` applies everywhere; otherwise the domain must be listed."""
        return domain is None or not self.domains or domain in self.domains


# ---------------------------------------------------------------------------------- loading


def load_skill(path: Path, source: str | None = None) -> Skill:
    doc = specs.load(path, "Skill", source=source)
    skill = Skill(doc.data, doc.source)
    check_operations(skill)
    check_bindings(skill)
    return skill


def _substitute(value: Any, bindings: dict[str, Any]) -> Any:
    """`value` with each `{var}` of `bindings` replaced in its strings (not its keys)."""
    if isinstance(value, dict):
        return {k: _substitute(v, bindings) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, bindings) for v in value]
    if not isinstance(value, str):
        return value
    whole = _PLACEHOLDER.fullmatch(value)
    if whole and whole[1] in bindings:
        return bindings[whole[1]]
    return _PLACEHOLDER.sub(
        lambda m: str(bindings[m[1]]) if m[1] in bindings else m[0], value)


def _placeholders(value: Any, path: str) -> list[tuple[str, str]]:
    """(variable, dotted field) of each placeholder in `value`'s strings."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _placeholders(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _placeholders(v, f"{path}[{i}]")]
    return [(m, path) for m in _PLACEHOLDER.findall(value)] if isinstance(value, str) else []


def check_bindings(skill: Skill) -> None:
    """Every placeholder of the mechanism is bound, every binding is used, and each binding
    compiles: a skill that cannot name its concrete setting is refused where it is loaded."""
    bind = skill.bind
    used = _placeholders(skill.data.get("mechanism") or {}, "mechanism")
    for var, path in used:
        if var not in bind:
            raise EvoError(
                f"skill {skill.name!r} uses {{{var}}}, which `bind` does not bind",
                where=skill.source, field=path,
                hint=f"add bind.{var}: a CEL expression naming its value, or write the value",
            )
    for var, expr in bind.items():
        if var not in {v for v, _ in used}:
            raise EvoError(
                f"skill {skill.name!r} binds {var!r}, which its mechanism never uses",
                where=skill.source, field=f"bind.{var}",
                hint=f"write {{{var}}} where the mechanism takes it, or drop the binding",
            )
        try:
            cel.check(expr)
        except EvoError as err:
            raise EvoError(err.message, where=skill.source, field=f"bind.{var}",
                           hint=err.hint) from None


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


def skill_overrides(paths: list[Path | Skill], parent_recipe: dict[str, Any]
                    ) -> dict[str, Any]:
    """The concrete recipe overrides of the skills in `paths` (files, or skills already
    loaded: a shared library's) applied in order to `parent_recipe` (the parent's resolved
    recipe; nulls kept, to remove keys when merged onto a recipe): what a version applying
    them sets. A skill that would change nothing is refused with the reason, so no version
    is spent on a no-op."""
    overrides: dict[str, Any] = {}
    recipe = parent_recipe
    for path in paths:
        skill = path if isinstance(path, Skill) else load_skill(path, f"skills/{path.name}")
        if skill.unbound:
            raise EvoError(
                f"skill {skill.name!r} binds {', '.join(skill.bind)} when its trigger fires, "
                "and no value is given",
                where=skill.source,
                field="--skill",
                hint="let a planner propose it from a diagnosis where it fires",
            )
        resolution = resolve_skill(skill, recipe)
        if not resolution.changes:
            raise EvoError(
                f"skill {skill.name!r} changes nothing on the parent's recipe: "
                f"{resolution.reason}",
                where=skill.source,
                field="--skill",
                hint="pick another skill, or change the recipe with --set",
            )
        overrides = deep_merge(overrides, resolution.overrides, keep_nulls=True)
        recipe = deep_merge(recipe, resolution.overrides)
    return overrides


def get_skill(skills: dict[str, Skill], name: str) -> Skill:
    if name not in skills:
        raise EvoError(
            f"unknown skill {name!r}",
            field="NAME",
            hint=f"known skills: {', '.join(sorted(skills)) or 'none'}",
        )
    return skills[name]


# ----------------------------------------------------------------------- relative patches

def is_operation(value: Any) -> bool:
    """A patch value that operates on the recipe's value (`set`, or a `direction` with its
    step and bounds) rather than a mapping merged key by key."""
    return isinstance(value, dict) and ("set" in value or "direction" in value)


@dataclass(frozen=True)
class Change:
    """One recipe value a skill moves: `key` dotted, a named list entry as `[name]`
    (`reward.components[partial].weight`); `before` is None where the recipe has no value."""

    key: str
    before: Any
    after: Any
    direction: str  # raise, lower, or set (an absolute value)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "before": self.before, "after": self.after,
                "direction": self.direction}

    def __str__(self) -> str:
        return f"{self.key} {_show(self.before)} → {_show(self.after)}"


@dataclass(frozen=True)
class Resolution:
    """A patch resolved against one recipe: the concrete overrides a version spec records
    (only what changes), each change, and why each other patched key keeps its value."""

    overrides: dict[str, Any]
    changes: tuple[Change, ...]
    unchanged: tuple[str, ...]

    @property
    def reason(self) -> str:
        return "; ".join(self.unchanged) or "the patch is empty"


def resolve_skill(skill: Skill, recipe: dict[str, Any]) -> Resolution:
    """`skill`'s patch for the recipe's domain, resolved against `recipe` (a resolved recipe:
    the parent's, at proposal time)."""
    domain = (recipe.get("domain") or {}).get("name")
    return resolve_patch(skill.patch_for(domain), recipe, where=skill.source)


def resolve_patch(patch: dict[str, Any], recipe: dict[str, Any], *, where: str) -> Resolution:
    """The concrete overrides `patch` makes on `recipe` (see the module docstring)."""
    changes: list[Change] = []
    unchanged: list[str] = []
    overrides = _resolve_mapping(patch, recipe, "", changes, unchanged, where)
    return Resolution(overrides, tuple(changes), tuple(unchanged))


def _resolve_mapping(
    patch: dict[str, Any], base: Any, prefix: str, changes: list[Change], unchanged: list[str],
    where: str,
) -> dict[str, Any]:
    base = base if isinstance(base, dict) else {}
    out: dict[str, Any] = {}
    for key, value in patch.items():
        dotted = f"{prefix}.{key}" if prefix else key
        before = base.get(key)
        if is_operation(value):
            after, direction, why = _apply(value, before, dotted, where)
            if why is not None:
                unchanged.append(why)
                continue
            out[key] = after
            changes.append(Change(dotted, before, after, direction))
        elif isinstance(value, dict) and value:
            nested = _resolve_mapping(value, before, dotted, changes, unchanged, where)
            if nested:
                out[key] = nested
        elif _is_named_list(value):
            entries = _resolve_entries(value, before, dotted, changes, unchanged, where)
            if entries:
                out[key] = entries
        elif value is None and key not in base:
            unchanged.append(f"{dotted} is already unset")
        elif value is not None and before == value:
            unchanged.append(f"{dotted} is already {_show(value)}")
        else:  # a literal (boolean, name) written as is; null removes the key
            out[key] = value
            changes.append(Change(dotted, before, value, "set"))
    return out


def _resolve_entries(
    patch: list[dict[str, Any]], base: Any, prefix: str, changes: list[Change],
    unchanged: list[str], where: str,
) -> list[dict[str, Any]]:
    """A named list (reward components, tools): each entry resolved against the recipe's
    entry of the same name (none: a new entry, its operations on unset values)."""
    index = {e["name"]: e for e in base or [] if isinstance(e, dict) and "name" in e}
    out = []
    for entry in patch:
        fields = {k: v for k, v in entry.items() if k != "name"}
        resolved = _resolve_mapping(fields, index.get(entry["name"]),
                                    f"{prefix}[{entry['name']}]", changes, unchanged, where)
        if resolved:
            out.append({"name": entry["name"], **resolved})
    return out


def _apply(op: dict[str, Any], before: Any, key: str, where: str) -> tuple[Any, str, str | None]:
    """(value after, direction, why it stays) for one operation on the recipe's `before`."""
    if "set" in op:
        if before == op["set"]:
            return before, "set", f"{key} is already {_show(before)}"
        return op["set"], "set", None
    direction, low, high = op["direction"], op.get("min"), op.get("max")
    if before is None:
        # Nothing to scale: a raise installs its floor; a lower has nothing to lower.
        if direction == "raise" and low is not None:
            return low, direction, None
        return None, direction, f"{key} is not set: nothing to {direction}"
    if isinstance(before, bool) or not isinstance(before, (int, float)):
        raise EvoError(
            f"the skill would {direction} {key}, but the recipe's value is {before!r}, "
            "not a number",
            where=where,
            field="mechanism",
            hint="operations (multiply, add, min, max) apply to numbers; use {set: VALUE}",
        )
    target = before * op["multiply"] if "multiply" in op else before + op.get("add", 0)
    if low is not None:
        target = max(target, low)
    if high is not None:
        target = min(target, high)
    # Turns and token budgets stay whole numbers, unless rounding would cross a bound (an
    # integer weight 1 halved within a floor of 0.5 is 0.5, not 0); a float is cut to 12
    # digits so the spec reads 1.4 where 1.2 + 0.2 gives 1.4000000000000001.
    whole = round(target)
    if isinstance(before, int) and (low is None or whole >= low) and (high is None or
                                                                        whole <= high):
        target = whole
    else:
        target = float(f"{target:.12g}")
    after = max(before, target) if direction == "raise" else min(before, target)
    if after != before:
        return after, direction, None
    bound = high if direction == "raise" else low
    if bound is not None and (before >= bound if direction == "raise" else before <= bound):
        edge = "ceiling" if direction == "raise" else "floor"
        return before, direction, f"{key} is {_show(before)}, at or past the skill's {edge} " \
            f"{_show(bound)}"
    limit = low if direction == "raise" else high
    return before, direction, f"{key} is {_show(before)}, already " \
        f"{'at least' if direction == 'raise' else 'at most'} {_show(limit)}"


# Recipe keys a skill may never patch, at any depth: what runs a program (a judge server's
# `command`, verl's `python`, a reward or tool module, Hydra `overrides`, a test interpreter,
# a container image), where requests go (`endpoint`, `base_url`, `ray_address`) and which
# secrets or environment they carry (`api_key_env`, `env`). A skill is applied by a planner,
# and in `autonomy.mode: auto` approved by the controller, with nobody reading the patch; a
# command, an endpoint or a secret belongs in a version's own recipe, where its reviewer sees
# it. The one list, checked wherever a skill is loaded (built in, the workspace's, a shared
# library's, one created from a version).
RESTRICTED_PATCH_KEYS = frozenset({
    "command", "endpoint", "base_url", "api_base", "url", "headers", "api_key", "api_key_env",
    "env", "python", "test_python", "ray_address", "reward_module", "reward_function",
    "tool_config_path", "overrides", "docker_image", "image", "serve",
})


def restricted_keys(patch: Any, prefix: str = "") -> list[str]:
    """The dotted keys of `patch` (a named list's entry as `[name]`, a `set`'s value walked
    too) that `RESTRICTED_PATCH_KEYS` names."""
    found: list[str] = []
    if isinstance(patch, dict):
        for key, value in patch.items():
            if key == "set" and is_operation(patch):  # {set: V}: V is what lands
                found += restricted_keys(value, prefix)
                continue
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if str(key) in RESTRICTED_PATCH_KEYS:
                found.append(dotted)
            found += restricted_keys(value, dotted)
    elif isinstance(patch, list):
        for index, entry in enumerate(patch):
            name = entry.get("name") if isinstance(entry, dict) else None
            label = name if isinstance(name, str) else index
            found += restricted_keys(entry, f"{prefix}[{label}]")
    return found


def check_reach(skill: Skill) -> None:
    """A skill patches settings, never commands, endpoints or secrets (see
    RESTRICTED_PATCH_KEYS): one that does is refused where it is loaded, by name."""
    mechanism = skill.data.get("mechanism") or {}
    patches = [("mechanism.recipe_patch", mechanism.get("recipe_patch"))] + [
        (f"mechanism.domain_patches.{domain}", patch)
        for domain, patch in (mechanism.get("domain_patches") or {}).items()]
    for where, patch in patches:
        keys = restricted_keys(patch)
        if keys:
            raise EvoError(
                f"skill {skill.name!r} patches {keys[0]}: a skill may not set a command, an "
                "endpoint or a secret (it is applied, and in autonomy.mode auto approved, "
                "with nobody reading the patch)",
                where=skill.source,
                field=f"{where}.{keys[0]}",
                hint="remove that key from the skill; a judge's server, endpoint or key "
                "variable goes in a version's own recipe, where its reviewer sees it",
            )


def check_operations(skill: Skill) -> None:
    """What the schema cannot say: the patch reaches no command, endpoint or secret
    (`check_reach`), and every operation's floor is at most its ceiling."""
    check_reach(skill)
    for domain in [None, *(skill.data["mechanism"].get("domain_patches") or {})]:
        for key, op in operations(skill, domain).items():
            low, high = op.get("min"), op.get("max")
            if low is not None and high is not None and low > high:
                raise EvoError(
                    f"{key}: min {_show(low)} is above max {_show(high)}"
                    + (f" (domain {domain})" if domain else ""),
                    where=skill.source,
                    field="mechanism." + (f"domain_patches.{domain}" if domain
                                          else "recipe_patch") + f".{key}",
                    hint="the floor (min) must be at most the ceiling (max)",
                )


def operations(skill: Skill, domain: str | None) -> dict[str, dict[str, Any]]:
    """{dotted key: operation} of the skill's patch for `domain`; a literal is a `set`."""
    return dict(_operations(skill.patch_for(domain), ""))


def _operations(patch: dict[str, Any], prefix: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key, value in patch.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if is_operation(value):
            out.append((dotted, value))
        elif isinstance(value, dict) and value:
            out += _operations(value, dotted)
        elif _is_named_list(value):
            for entry in value:
                fields = {k: v for k, v in entry.items() if k != "name"}
                out += _operations(fields, f"{dotted}[{entry['name']}]")
        else:
            out.append((dotted, {"set": value}))
    return out


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return "unset" if value is None else str(value).lower() if isinstance(value, bool) \
        else str(value)


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
    for key, boost in _FIELDS:
        value = skill.data.get(key)
        text = " ".join(value) if isinstance(value, list) else str(value or "")
        words += tokens(text) * boost
    return words


def bm25(docs: dict[str, Counter], query: set[str]) -> dict[str, float]:
    """BM25 relevance to the words `query` of each document (its words counted), for the
    documents that share a word with it."""
    if not query or not docs:
        return {}
    avg_len = sum(sum(d.values()) for d in docs.values()) / len(docs) or 1.0
    df = Counter(word for d in docs.values() for word in set(d) if word in query)
    scores = {}
    for key, counts in docs.items():
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
            scores[key] = score
    return scores


def search(skills: dict[str, Skill], text: str) -> list[tuple[Skill, float]]:
    """Skills ranked by BM25 relevance to `text` (only those sharing a word with it)."""
    docs = {name: Counter(_document(skill)) for name, skill in skills.items()}
    ranked = [(skills[name], score) for name, score in bm25(docs, set(tokens(text))).items()]
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
    variables["keyed"] = dict(diagnosis.get("keyed") or {})
    return variables


def fires(expr: str, variables: dict[str, Any], *, where: str | None = None) -> bool:
    """Whether a trigger holds; a null or absent metric never makes it fire."""
    try:
        return cel.evaluate_unless_null(expr, variables) is True
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
    applied: bool  # the patch changes nothing on the recipe it would be applied to
    names_cause: bool = False  # fires only with the recipe's settings: they explain the symptom
    resolution: Resolution | None = None  # the patch on that recipe, when it is known
    bindings: dict[str, Any] = field(default_factory=dict)  # `skill` is bound with them

    @property
    def no_change(self) -> str | None:
        """Why proposing this skill would spend a version on a no-op; None when it moves
        the recipe."""
        return self.resolution.reason if self.applied and self.resolution else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.skill.name,
            "title": self.skill.title,
            **({"bindings": self.bindings} if self.bindings else {}),
            "category": self.skill.category,
            "values": self.values,
            "in_domain": self.in_domain,
            "support": self.support,
            "against": self.against,
            "mean_delta": self.mean_delta,
            "applied": self.applied,
            "names_cause": self.names_cause,
            "changes": [c.as_dict() for c in self.resolution.changes]
            if self.resolution else None,
            "no_change": self.no_change,
        }


def _evaluate(
    skill: Skill, variables: dict[str, Any], domain: str | None, target: dict[str, Any] | None
) -> Match | None:
    if not skill.trigger or not fires(skill.trigger, variables, where=skill.source):
        return None
    if skill.bind:
        bindings = _bindings(skill, variables)
        if bindings is None:
            return None
        skill = skill.bound(bindings)
    deltas = [e["delta"] for e in skill.evidence if e.get("delta") is not None]
    patch = skill.patch_for(domain)
    resolution = resolve_patch(patch, target, where=skill.source) if target is not None \
        else None
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
        applied=bool(patch) and resolution is not None and not resolution.changes,
        names_cause=names_cause,
        resolution=resolution,
        bindings=skill.bindings,
    )


def _bindings(skill: Skill, variables: dict[str, Any]) -> dict[str, Any] | None:
    """Each `bind` expression's value over `variables`; None when one fails, is null or is not
    a scalar."""
    out = {}
    for var, expr in skill.bind.items():
        try:
            value = cel.evaluate_unless_null(expr, variables)
        except EvoError:
            return None
        # Only a scalar is bound: a map or list from the recipe (which the version's author
        # writes) would carry keys into the patch that check_reach never saw.
        if value is None or not isinstance(value, (str, int, float, bool)):
            return None
        out[var] = value
    return out


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
    Each patch is resolved against `patch_base` (the recipe it would be applied to; default
    `recipe`); one that changes nothing there (every value at its bound) is marked
    `applied`, with the reason in `no_change`, and ranked last: proposing it would spend a
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
