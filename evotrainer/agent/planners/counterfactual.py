"""Counterfactual branches: when the obvious fix has negative evidence, a small family of
siblings says where the pathology comes from.

An alert fires on the base's evidence (its own diagnosis or its children's) and the library
skill its trigger selects — the obvious fix, a skill whose trigger names the alert or reads its
metric — has negative evidence on this lineage: a version that applied it failed with the
alert still firing there (`View.refuted_skills`), or its backtest on the stored rollouts
predicts no effect. One more single factor would stack a guess on a refuted one. The paper's
method has another way (its v9/v10/v11): branches that keep the suspected factor beside a
control without it, trained together, so one round says whether the factor is the cause.

The rules planner designs that family from what it already has, in one decision:

- the suspected factor: the settings the obvious fix moves (its patch resolved as the failed
  version applied it, or on the base's recipe);
- treatments: up to `TREATMENTS` other fixes for the same alert, fired and untried (the
  skill candidates, best first), each a single factor from the base;
- a control: the base retrained without the suspected factor — the settings a version on the
  base's chain introduced, restored to what its parent had — or, when the chain never set them
  (they come with the project) or restoring them would repeat the failed version, the base as
  it is on a new seed: the failed run was one seed, and the control measures the spread the
  treatments are judged against.

Every member's spec records the family under `proposal.family` (its name, its role, the
control, the members, the suspected factor and what the family tests); the gate compares each
treatment with the control beside its parent, the correction counting every treatment
(gate/counterfactual.py). The family takes one proposal slot. It is not proposed when no other
fix remains for the alert, when the base already has a family for the same fix, or when
`autonomy.max_total_steps` has no room for every member (a note says which).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from evotrainer.agent.planners.base import (
    Proposal,
    View,
    dotted_keys,
    dotted_settings,
    next_name,
    overrides_key,
    revert_overrides,
)
from evotrainer.agent.planners.evidence import steps_spent
from evotrainer.control.versions import parse_assignment
from evotrainer.gate.counterfactual import CONTROL, TREATMENT, family_of
from evotrainer.skills.skill import Match, resolve_skill
from evotrainer.store.checkpoints import init_mode
from evotrainer.store.recipe import set_dotted

MOVE = "counterfactual"  # proposal.move of a family's control
TREATMENTS = 2  # at most this many treatments beside the control


@dataclass(frozen=True)
class Refuted:
    """A fired skill this lineage refuted, with the evidence it fired on."""

    source: str
    diagnosis: dict
    match: Match


@dataclass(frozen=True)
class _Fix:
    """The obvious fix with negative evidence: the alert it answers and why it is doubted."""

    skill: str
    alert: str
    negative: str
    overrides: dict  # what it moves, as the failed version (or the base) resolves it
    refuted_by: str | None  # the failed version that applied it


def answers(expression: str, values: dict[str, Any], alert: dict) -> bool:
    """Does a trigger (its expression and the values it read) select a fix for `alert`: it
    names the alert or reads the alert's metric."""
    return f'"{alert["name"]}"' in expression or alert.get("metric") in values


def family(
    view: View, base: str, evidence: list[tuple[str, dict]], refuted: list[Refuted],
    candidates: list[tuple[Proposal, float | None]], notes: list[str],
) -> list[Proposal] | None:
    """The family's members (treatments, then the control), or None. `evidence`: the base's
    diagnosis and its children's; `refuted`: fired skills skipped as refuted; `candidates`:
    the skill proposals from the base, best first, each with the share of the dead groups its
    backtest fixes (None without one). What was considered and declined goes to `notes`."""
    fix = _obvious_fix(view, base, evidence, refuted, candidates)
    if fix is None:
        return None
    if any((family_of(view.states[c].spec) or {}).get("suspected", {}).get("fix") == fix.skill
           for c in view.children(base)):
        return None  # designed once from this base
    alert = {"name": fix.alert, "metric": _alert_metric(evidence, fix.alert)}
    treatments = [p for p, _ in candidates if p.skills != [fix.skill]
                  and answers(p.proposal["trigger"]["expression"],
                              p.proposal["trigger"]["values"], alert)][:TREATMENTS]
    if not treatments:
        notes.append(f"no counterfactual family for {fix.alert}: {fix.skill} {fix.negative}, "
                     "and no other fix for it remains")
        return None
    recipe = view.ws.resolved_recipe(base, view.states)
    control, restored, why = _control(view, base, recipe, fix)
    seeds = list(recipe.get("seeds") or [0])
    cost = int(recipe["grpo"]["steps"]) * (len(seeds) * len(treatments) + (
        1 if restored is None else len(seeds)))
    budget = view.autonomy.get("max_total_steps")
    spent = steps_spent(view)
    if budget is not None and spent + cost > int(budget):
        notes.append(f"no counterfactual family for {fix.alert}: its {len(treatments) + 1} "
                     f"members ({cost} steps) would pass autonomy.max_total_steps ({spent} of "
                     f"{budget} spent)")
        return None
    return _members(view, base, fix, treatments, (control, restored, why), cost)


def _obvious_fix(
    view: View, base: str, evidence: list[tuple[str, dict]], refuted: list[Refuted],
    candidates: list[tuple[Proposal, float | None]],
) -> _Fix | None:
    """A refuted fix whose alert still fires on the version that applied it, else an alert's
    best candidate fix whose backtest predicts no effect (it fixes no dead group)."""
    failed = view.refuted_skills(base)
    for found in refuted:
        version = failed[found.match.skill.name]
        after = view.states[version].records.get("diagnosis") or found.diagnosis
        still = {a["name"] for a in after.get("alerts") or []}
        for alert in found.diagnosis.get("alerts") or []:
            if alert["name"] in still and answers(found.match.skill.trigger,
                                                  found.match.values, alert):
                parent = view.states[version].parent or base
                skill = view.applied_skill(version, found.match.skill.name) or found.match.skill
                overrides = resolve_skill(skill, view.ws.resolved_recipe(parent, view.states))
                return _Fix(found.match.skill.name, alert["name"],
                            f"was refuted by {version} ({view.verdict(version) or 'failed'}; "
                            f"{alert['name']} still fires there)", overrides.overrides, version)
    recipe = view.ws.resolved_recipe(base, view.states)
    for source, diagnosis in evidence:
        for alert in diagnosis.get("alerts") or []:
            # The obvious fix for the alert: the best candidate that answers it.
            obvious = next(((p, effect) for p, effect in candidates
                            if p.proposal["evidence_version"] == source
                            and answers(p.proposal["trigger"]["expression"],
                                        p.proposal["trigger"]["values"], alert)), None)
            if obvious is None or obvious[1] != 0.0:
                continue
            proposal = obvious[0]
            [name] = proposal.skills
            bindings = proposal.bindings.get(name)
            skill = view.skills[name].bound(bindings) if bindings else view.skills[name]
            return _Fix(name, alert["name"], f"has a backtest on "
                        f"{proposal.proposal['backtest']['version']}'s rollouts that predicts "
                        "no effect", resolve_skill(skill, recipe).overrides, None)
    return None


def _alert_metric(evidence: list[tuple[str, dict]], name: str) -> str | None:
    return next((a.get("metric") for _, d in evidence for a in d.get("alerts") or []
                 if a["name"] == name), None)


def _control(
    view: View, base: str, recipe: dict, fix: _Fix
) -> tuple[list[str], list[str] | None, str]:
    """(the control's settings, the suspected settings it restores — None for the base as it
    is on a new seed —, why that control)."""
    suspected = dotted_keys(fix.overrides)
    for version in reversed(view.chain(base)):
        parent = view.states[version].parent
        if parent is None:
            continue
        introduced = [s for s in dotted_settings(view.states[version].spec.get("recipe") or {})
                      if _overlaps(s.split("=", 1)[0], suspected)]
        if not introduced:
            continue
        patch: dict = {}
        for setting in introduced:
            set_dotted(patch, *parse_assignment(setting))
        settings = dotted_settings(revert_overrides(
            view.ws.resolved_recipe(parent, view.states), patch))
        if overrides_key(settings) != overrides_key(dotted_settings(fix.overrides)):
            return settings, [s.split("=", 1)[0] for s in settings], \
                f"{version} introduced it; the control restores {parent}'s values"
        why = f"restoring what {version} changed would repeat {fix.refuted_by}"
        break
    else:
        why = "no version of this chain set it (it comes with the project)"
    seeds = list(recipe.get("seeds") or [0])
    # A seed rerun repeats the base's own training; it must not continue from it.
    rerun = [f"model.init={json.dumps('base')}"] if init_mode(recipe) == "parent" else []
    return [*rerun, f"seeds={json.dumps([max(seeds) + 1])}"], None, why


def _overlaps(key: str, keys: set[str]) -> bool:
    """One setting is, holds or lies inside another (`reward.components` and
    `reward.components[partial].weight`)."""
    return any(key == k or k.startswith((f"{key}.", f"{key}[")) or key.startswith(
        (f"{k}.", f"{k}[")) for k in keys)


def _members(
    view: View, base: str, fix: _Fix, treatments: list[Proposal],
    designed: tuple[list[str], list[str] | None, str], cost: int,
) -> list[Proposal]:
    control, restored, why = designed
    taken = list(view.states)
    names = []
    for _ in range(len(treatments) + 1):
        names.append(next_name([*taken, *names], "v"))
    *treated, controlled = names
    # The settings by their first two levels (group_filter.params, not each parameter).
    factor = ", ".join(sorted({".".join(k.split(".")[:2]) for k in dotted_keys(fix.overrides)})
                       ) or fix.skill
    fixes = ", ".join(f"{n} applies {p.skills[0]}" for n, p in zip(treated, treatments,
                                                                  strict=True))
    if restored is not None:
        what = (f"the control {controlled} retrains {base} without it ({why}: "
                f"{', '.join(control)}). "
                f"If the control loses {fix.alert} while the treatments keep it, {factor} is "
                f"the cause; if a treatment beats the control, its own factor answers "
                f"{fix.alert} whatever {factor} does")
    else:
        what = (f"the control {controlled} retrains {base} as it is on a new seed "
                f"({', '.join(control)}) — {why}, so there is nothing else to take out: the "
                "negative evidence is one run, and the control measures the seed spread each "
                "treatment is judged against")
    tests = (f"Does {fix.alert} come from {factor}? The treatments keep it and change one "
             f"other factor each ({fixes}); {what}.")
    record = {"name": f"cf-{treated[0]}", "control": controlled,
              "members": [*({"name": n, "role": TREATMENT} for n in treated),
                          {"name": controlled, "role": CONTROL}],
              "suspected": {"alert": fix.alert, "fix": fix.skill, "negative": fix.negative,
                            "settings": sorted(dotted_keys(fix.overrides))},
              "tests": tests, "steps": cost}
    lead = (f"Counterfactual family {record['name']} ({', '.join(names)}): {fix.alert} fires on "
            f"{base}'s evidence and the obvious fix {fix.skill} {fix.negative}. {tests}")
    out = [replace(p, name=n, rationale=f"{lead} Treatment {n}: {p.rationale}",
                   proposal={**p.proposal, "family": {**record, "role": TREATMENT}})
           for n, p in zip(treated, treatments, strict=True)]
    if restored is not None:
        hypothesis = (f"If {base} is retrained without {factor}, then {fix.alert} stops firing, "
                      f"because {factor} causes it.")
        criterion = f'!("{fix.alert}" in alerts)'
    else:
        hypothesis = (f"If {base} is retrained as it is on another seed, then {fix.alert} fires "
                      f"again, because {fix.alert} is {base}'s recipe's, not its seed's.")
        criterion = f'"{fix.alert}" in alerts'
    out.append(Proposal(
        base, f"{lead} Control {controlled}.", settings=control, hypothesis=hypothesis,
        criterion=criterion, name=controlled,
        proposal={"planner": "rules", "tokens": 0, "frontier": base, "move": MOVE,
                  "family": {**record, "role": CONTROL}}))
    return out
