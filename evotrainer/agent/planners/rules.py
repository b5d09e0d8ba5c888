"""The `rules` planner: deterministic, no network. The trainer-agent protocol as code.

1. Frontier = the latest promoted version on main (or the root). Every proposal forks from
   it — or from the latest mixed-evidence version grown from it (a fix that removed its
   pathology with a gain inside the CI: not refuted, built upon): a failed version is never
   built upon.
2. Evidence = the frontier's diagnosis and those of its gated children (a pruned child's
   alerts say what to fix next, e.g. the leak that blocked it).
3. Candidates = skills whose trigger fires (`skill.match`: negative skills never match and
   are listed as declined), one factor each, with the skill's falsifiable criterion. Skills
   this lineage already refuted (applied by a failed ancestor or sibling) or already tried
   from the frontier are skipped. Integrity and measurement fixes (audit, eval-protocol)
   come first: a score that cannot be trusted says nothing about anything else. Triggers
   read the recipe that produced the diagnosis; one that fires only through a recipe setting
   names the cause and ranks before skills that answer the symptom alone. An untrained root
   is first trained as is: that run is the reference for everything after.
4. A filter or reward skill is backtested on the stored rollouts that fired it; a backtest
   that shows no effect demotes the candidate.
5. Escalation after `autonomy.escalate_after_failures` consecutive failed versions: re-branch
   from the last good version, prefer subtraction (undo a skill on the chain, never an
   integrity fix: category audit), and switch layer (skip the categories the failed
   versions tried).
6. Nothing left: the most promising default (train the recipe as is from an untrained root,
   else twice the steps, else a second seed), saying that no trigger fired.
7. Two moves beside single factors: a **bundle** merges two children of the frontier whose
   single-factor fixes were each supported on their own (improvement or mixed evidence) and
   change disjoint settings (the method's controlled multi-factor option); a **revert**
   undoes the change of a version on the base's chain whose gate said revert or recorded a
   regression.
8. The harness evolves when a diagnostic gap fires (revisions.py; with `harness_evolution`
   off the gap is only noted): the revision adds the catalogue metric that discriminates it.
   Without one, the gate's procedure evolves where the recorded decisions call for it
   (gate_revisions.py): data sources that disagree in sign, intervals too wide to decide.
9. Evidence before moving on (evidence.py): a version left inconclusive with a positive
   point estimate inside its interval is rerun on one more seed, the seeds pooled by the
   gate, before any new factor; this move ranks first outside an escalation.
10. Counterfactual branches (counterfactual.py): an alert whose obvious fix has negative
   evidence (refuted with the alert still firing, or a backtest showing no effect) gets a
   family in one proposal slot — up to two other fixes as treatments and a control without
   the suspected factor — ranked just before its best treatment; the gate decides each
   treatment against the control.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from evotrainer.agent.planners import counterfactual, evidence, gate_revisions, revisions
from evotrainer.agent.planners.base import (
    BUNDLE,
    PlannerResult,
    Proposal,
    View,
    dotted_keys,
    dotted_settings,
    overrides_key,
    revert_overrides,
)
from evotrainer.agent.planners.base import fmt as _fmt
from evotrainer.agent.retrieval import SearchTrace, query_for, retrieve
from evotrainer.diagnosis.gaps import FiredSkill
from evotrainer.errors import EvoError
from evotrainer.gate.outcomes import MIXED, REGRESSION
from evotrainer.skills.replay import (
    backtest_filter,
    backtest_reward,
    skill_filter,
    skill_reward,
    version_rollouts,
)
from evotrainer.skills.skill import Match, match, refusals, resolve_skill
from evotrainer.store.checkpoints import init_mode

# Fix what makes the score untrustworthy first; then stabilise a policy that diverged (its
# truncation or dead groups are symptoms of the divergence, not of the budget or the reward);
# then measurement artifacts; then the rest in the library's evidence order.
CATEGORY_FIRST = {"audit": 0, "stability": 1, "eval-protocol": 2}
# An escalation never subtracts an integrity fix: undoing it re-opens what made the score
# untrustworthy (a leak the gate blocks whatever the score), so it cannot be what the
# failed additions fight.
NEVER_SUBTRACTED = {"audit"}
# Among the rest, a skill that puts signal into dead groups (a reward change) before one that
# drops them (a filter): a filter discards the groups a reward change would rescue, and the
# paper's Coding and Math paths refined the reward before transferring StdGroupFilter.
SIGNAL_BEFORE_FILTER = {"filter": 1}
# Items of recorded knowledge a skill proposal cites in its rationale.
CITED = 2

@dataclass
class _Candidate:
    proposal: Proposal
    rank: tuple
    skills: list[str] = field(default_factory=list)
    overrides: str = ""  # canonical overrides of a settings-only candidate
    # A counterfactual family: every member, written together in one proposal slot.
    members: list[_Candidate] = field(default_factory=list)


@dataclass
class _Fired:
    """What the skill candidates saw: whether any trigger fired, whether one offers a next
    step (a fired skill whose patch is already applied, or that this lineage refuted, does
    not), and each fired skill with the evidence it read (for gap (b))."""

    any: bool = False
    actionable: bool = False
    skills: dict[str, list[FiredSkill]] = field(default_factory=dict)  # evidence version →
    refuted: list[counterfactual.Refuted] = field(default_factory=list)


class RulesPlanner:
    name = "rules"

    def __init__(self, *, harness_evolution: bool = True) -> None:
        # Off: gaps are still detected and noted, but no revision is drafted (the gym's
        # `rules-no-harness` arm, `evotrainer evolve --no-harness-evolution`).
        self.harness_evolution = harness_evolution

    def propose(self, view: View, max_proposals: int) -> PlannerResult:
        result = PlannerResult()
        frontier = view.frontier()
        streak = view.failure_streak()
        escalation = None
        if len(streak) >= view.escalate_after():
            escalation = {
                "failed": streak,
                "threshold": view.escalate_after(),
                "rollback_to": frontier,
                "avoid_categories": sorted({
                    view.skills[s].category for v in streak for s in view.applied_skills(v)
                    if s in view.skills
                }),
            }
            result.notes.append(
                f"escalation: {len(streak)} consecutive failed versions ({', '.join(streak)}); "
                f"re-branching from the last good version {frontier}, subtracting first"
            )
        # An escalation rolls back to the last good version; otherwise build on mixed evidence.
        base = frontier if escalation else view.proposal_base(frontier)
        builds_on = None
        if base != frontier:
            reason = (view.states[base].records["decision"].get("outcome") or {}).get("reason")
            builds_on = {"version": base, "outcome": MIXED, "reason": reason}
            result.notes.append(f"building on {base} (mixed evidence: {reason})")
        candidates: list[_Candidate] = []
        if escalation:
            candidates += self._subtractions(view, frontier, escalation, result)
        else:
            candidates += self._bundles(view, frontier) + self._reverts(view, base)
        fired = _Fired()
        skill_candidates = self._skill_candidates(view, base, escalation, result, fired)
        candidates += skill_candidates + self._defaults(view, base, fired.any)
        if not escalation:
            candidates += self._family(view, base, skill_candidates, fired, result.notes)
            # An inconclusive gain gets more evidence before any new factor (evidence.py).
            candidates += [
                _Candidate(p, (-3, False, 0, i), overrides=overrides_key(p.settings))
                for i, p in enumerate(evidence.proposals(view, base, frontier, result.notes))]
        # What was tried from each parent a candidate forks from (bundles fork from the
        # frontier, the rest from the base): the same change is never proposed twice.
        tried: dict[str, _Tried] = {}
        slots = 0  # a family takes one slot for all its members
        for candidate in sorted(candidates, key=lambda c: c.rank):
            if slots >= max_proposals:
                break
            members = candidate.members or [candidate]
            if any(_tried(view, tried, m).has(m) for m in members):
                continue
            for member in members:
                if escalation:
                    member.proposal.proposal["escalation"] = escalation
                if builds_on and member.proposal.parent == base:
                    member.proposal.proposal["builds_on"] = builds_on
                    member.proposal.rationale = (f"Builds on {base} (mixed evidence: {reason}). "
                                                 f"{member.proposal.rationale}")
                result.proposals.append(member.proposal)
                _tried(view, tried, member).add(member)
            slots += 1
        # One revision a round: a metric for a diagnostic gap first, else a gate procedure
        # the recorded decisions call for.
        harness = revisions.revision_for_gaps(
            view, base, fired.skills, fired.actionable, result, drafting=self.harness_evolution
        ) or gate_revisions.propose(view, result, drafting=self.harness_evolution)
        if harness:
            result.harness.append(harness)
        return result

    def _family(
        self, view: View, base: str, skill_candidates: list[_Candidate], fired: _Fired,
        notes: list[str],
    ) -> list[_Candidate]:
        """A counterfactual family (counterfactual.py), ranked just before its best
        treatment: it holds that treatment, and answers why the obvious fix did not work."""
        ranked = sorted(skill_candidates, key=lambda c: c.rank)
        members = counterfactual.family(
            view, base, self._evidence(view, base), fired.refuted,
            [(c.proposal, _effect(c.proposal.proposal.get("backtest"))) for c in ranked], notes)
        if not members:
            return []
        *treatments, control = members
        best = min(c.rank for c in ranked
                   if c.skills in [t.skills for t in treatments])
        inner = [_Candidate(t, best, skills=list(t.skills)) for t in treatments]
        inner.append(_Candidate(control, best, overrides=overrides_key(control.settings)))
        return [_Candidate(members[0], (best[0], -1), members=inner)]

    # ---- skills ------------------------------------------------------------------------

    def _evidence(self, view: View, frontier: str) -> list[tuple[str, dict]]:
        """(version, diagnosis): the frontier's, then its gated children's, latest first."""
        out = []
        diagnosis = view.states[frontier].records.get("diagnosis")
        if diagnosis:
            out.append((frontier, diagnosis))
        children = [c for c in view.decided_order() if view.states[c].parent == frontier]
        for child in reversed(children):
            if (d := view.states[child].records.get("diagnosis")) is not None:
                out.append((child, d))
        return out

    def _skill_candidates(
        self, view: View, frontier: str, escalation: dict | None, result: PlannerResult,
        fired: _Fired,
    ) -> list[_Candidate]:
        """Candidates from fired triggers; `fired` learns whether any trigger fired at all
        and which skills stand as candidates on each piece of evidence."""
        recipe = view.ws.resolved_recipe(frontier, view.states)
        domain = recipe["domain"]["name"]
        refuted = view.refuted_skills(frontier)
        seen: set[str] = set()
        out = []
        for position, (source, diagnosis) in enumerate(self._evidence(view, frontier)):
            # Triggers read the recipe that produced the diagnosis; a patch is a no-op
            # (`applied`) when the frontier's recipe, which it would change, already has it.
            produced_by = view.ws.resolved_recipe(source, view.states)
            for declined in refusals(view.skills, diagnosis, domain=domain, recipe=produced_by):
                note = (f"declined {declined.skill.name} (negative evidence: "
                        f"{len(declined.skill.negative_evidence)} failed use(s))")
                if note not in result.notes:
                    result.notes.append(note)
            for order, found in enumerate(match(view.skills, diagnosis, domain=domain,
                                                recipe=produced_by, patch_base=recipe)):
                name = found.skill.name
                if name in seen:
                    continue
                seen.add(name)
                if found.applied:
                    result.notes.append(f"skipped {name}: it changes nothing on {frontier}'s "
                                        f"recipe ({found.no_change})")
                    continue
                if name in refuted:
                    result.notes.append(f"skipped {name}: refuted on this lineage by "
                                        f"{refuted[name]}")
                    fired.refuted.append(counterfactual.Refuted(source, diagnosis, found))
                    continue
                if escalation and found.skill.category in escalation["avoid_categories"]:
                    result.notes.append(f"skipped {name}: escalation switches layer away "
                                        f"from {found.skill.category}")
                    continue
                proposal, works = self._skill_proposal(view, frontier, source, diagnosis, found)
                rank = (CATEGORY_FIRST.get(found.skill.category, 3), not works,
                        SIGNAL_BEFORE_FILTER.get(found.skill.category, 0), position, order)
                out.append(_Candidate(proposal, rank, skills=[name]))
                fired.skills.setdefault(source, []).append(FiredSkill(
                    name, found.skill.category, _metrics_read(found.values),
                    _effect(proposal.proposal.get("backtest"))))
        fired.any, fired.actionable = bool(seen), bool(out)
        return out

    def _skill_proposal(
        self, view: View, frontier: str, source: str, diagnosis: dict, found: Match
    ) -> tuple[Proposal, bool]:
        skill = found.skill
        # Names the trigger read but the diagnosis did not measure (null) say nothing.
        fired = ", ".join(f"{k}={_fmt(v)}" for k, v in found.values.items() if v is not None)
        alerts = [a["name"] for a in diagnosis.get("alerts") or []]
        who = source if source == frontier else f"{source} ({view.verdict(source)}, " \
            f"child of {frontier})"
        rationale = f"{skill.title}: trigger `{skill.trigger}` fired on {who} ({fired})."
        changes = found.resolution.changes if found.resolution else ()
        if changes:
            rationale += f" On {frontier}'s recipe it sets {', '.join(map(str, changes))}."
        backtest, works = self._backtest(view, frontier, source, skill)
        if backtest is not None:
            rationale += " " + _backtest_text(backtest)
            if not works:
                rationale += (" It would keep under 30% of the groups in some step "
                              "(over-filtering), so it ranks after untested candidates."
                              if backtest["kind"] == "filter" else
                              " It rescues no dead group, so it ranks after untested "
                              "candidates.")
        criterion = skill.data.get("criterion") or "delta >= 0.0"
        hypothesis = (
            f"If {frontier} applies {skill.name}, then {skill.data.get('expected_effect') or ''}"
            f" (criterion: {criterion}), because its trigger fired on {source}: {fired}."
        )
        meta = {
            "planner": "rules",
            "tokens": 0,
            "frontier": frontier,
            "evidence_version": source,
            "trigger": {"skill": skill.name, "expression": skill.trigger,
                        "values": found.values, "alerts": alerts,
                        **({"bindings": found.bindings} if found.bindings else {})},
            "skill_evidence": {"support": found.support, "against": found.against,
                               "in_domain": found.in_domain, "mean_delta": found.mean_delta},
            "changes": [c.as_dict() for c in changes],
        }
        if backtest is not None:
            meta["backtest"] = backtest
        cited, trace = _retrieved(view, frontier, diagnosis, skill)
        if cited:
            rationale += " Recorded knowledge: " + "; ".join(cited) + "."
        if trace:
            meta["retrieval"] = trace
        return Proposal(frontier, rationale, skills=[skill.name], hypothesis=hypothesis,
                        criterion=criterion, proposal=_plain(meta),
                        bindings={skill.name: found.bindings} if found.bindings else {}), works

    def _backtest(
        self, view: View, frontier: str, source: str, skill: Any
    ) -> tuple[dict | None, bool]:
        """Replay a filter or reward skill on the rollouts that fired it (else the
        frontier's). Returns (numbers or the error, whether it shows an effect)."""
        entry = (skill.entry_point or {}).get("kind")
        patch = skill.patch_for(view.ws.resolved_recipe(frontier, view.states)["domain"]["name"])
        is_filter = entry == "group_filter" or "group_filter" in patch
        is_reward = entry == "reward_component" or "reward" in patch
        if not (is_filter or is_reward):
            return None, True
        errors = []
        for version in dict.fromkeys((source, frontier)):
            try:
                path = version_rollouts(view.ws, version)
                if is_filter:
                    name, params = skill_filter(skill)
                    report = backtest_filter(path, name, params)
                    works = (report["keep_ratio_min_step"] or 0.0) >= 0.3
                else:
                    recipe = view.ws.resolved_recipe(version, view.states)
                    domain = recipe["domain"]
                    component, weight = skill_reward(skill, domain["name"])
                    # A judge's component is asked of the judge the recipe declares.
                    report = backtest_reward(path, component, weight, domain,
                                             judges=(recipe.get("reward") or {}).get("judges"))
                    works = report["rescued_groups"] > 0 or report["dead_groups_before"] == 0
                return {"version": version, "kind": "filter" if is_filter else "reward",
                        **report}, works
            except EvoError as err:
                errors.append(f"{version}: {err.message}")
        return {"error": "; ".join(errors)}, True  # no evidence either way: keep its rank

    # ---- escalation and defaults -------------------------------------------------------

    def _subtractions(self, view: View, frontier: str, escalation: dict,
                      result: PlannerResult) -> list[_Candidate]:
        """Undo one skill applied along the frontier's chain, latest first (an integrity
        fix is kept, with a note)."""
        out = []
        chain = view.chain(frontier)
        for depth, version in enumerate(reversed(chain)):
            parent = view.states[version].parent
            if parent is None:
                continue
            before = view.ws.resolved_recipe(parent, view.states)
            for skill_name in view.applied_skills(version):
                skill = view.applied_skill(version, skill_name)
                if skill is not None and skill.category in NEVER_SUBTRACTED:
                    result.notes.append(f"kept {skill_name} (applied by {version}): an "
                                        f"{skill.category} fix is never subtracted")
                    continue
                # What the skill sets on the parent's recipe (its relative patch resolved
                # there, as when the version was proposed): the values to undo.
                patch = resolve_skill(skill, before).overrides if skill else None
                if not patch:
                    continue
                settings = dotted_settings(revert_overrides(before, patch))
                if not settings:
                    continue
                failed = ", ".join(escalation["failed"])
                rationale = (
                    f"Escalation: {len(escalation['failed'])} consecutive failed versions "
                    f"({failed}) ≥ {escalation['threshold']}. Roll back to the last good "
                    f"version {frontier} and subtract rather than add: undo {skill_name} "
                    f"(applied by {version})."
                )
                proposal = Proposal(
                    frontier, rationale, settings=settings,
                    hypothesis=f"If {skill_name} is removed from {frontier}, then Avg@k holds "
                    f"or rises, because the additions since have all failed and {skill_name} "
                    "may be what they fight.",
                    criterion="delta >= 0.0",
                    proposal={"planner": "rules", "tokens": 0, "frontier": frontier,
                              "subtracts": skill_name},
                )
                rank = (-1, False, depth, 0)
                out.append(_Candidate(proposal, rank, overrides=overrides_key(settings)))
        return out

    def _bundles(self, view: View, frontier: str) -> list[_Candidate]:
        """Merge two single-factor children of the frontier, each supported on its own
        (improvement or mixed evidence), whose changes touch disjoint recipe keys: the
        method's controlled multi-factor option. Ranked before new single factors: both
        halves already showed they do what they were for."""
        supported = [c for c in view.decided_order()
                     if view.states[c].parent == frontier and view.supported(c)
                     and len(view.applied_skills(c)) == 1]
        out = []
        for i, first in enumerate(supported):
            for second in supported[i + 1:]:
                (a,), (b,) = view.applied_skills(first), view.applied_skills(second)
                if a == b or not {a, b} <= view.skills.keys():
                    continue
                keys_a = dotted_keys(view.states[first].spec.get("recipe") or {})
                keys_b = dotted_keys(view.states[second].spec.get("recipe") or {})
                if keys_a & keys_b:
                    continue  # both change the same setting: not separable factors
                halves = "; ".join(
                    f"{v} applied {skill} ({view.outcome(v).replace('_', ' ')}: "
                    f"{(view.states[v].records['decision'].get('outcome') or {}).get('reason')})"
                    for v, skill in ((first, a), (second, b)))
                criteria = [view.skills[k].data.get("criterion") or "delta >= 0.0"
                            for k in (a, b)]
                proposal = Proposal(
                    frontier,
                    f"Bundle (controlled multi-factor): {halves}. Each is supported on its own "
                    f"and they change disjoint settings, so {frontier} applies both.",
                    skills=[a, b],
                    bindings={**view.applied_bindings(first), **view.applied_bindings(second)},
                    hypothesis=f"If {frontier} applies {a} and {b} together, then each keeps "
                    "its effect and Avg@k holds or rises, because they act on disjoint "
                    "settings and each removed its own pathology.",
                    criterion=" && ".join(f"({c})" for c in criteria),
                    proposal={"planner": "rules", "tokens": 0, "frontier": frontier,
                              "move": BUNDLE, "bundles": [first, second]},
                )
                out.append(_Candidate(proposal, (-1, False, 0, len(out)), skills=[a, b]))
        return out

    def _reverts(self, view: View, base: str) -> list[_Candidate]:
        """Undo the change of a version on the base's chain whose gate said revert or
        recorded a regression (promoted by a rule the score did not back, or re-gated)."""
        out = []
        for depth, version in enumerate(reversed(view.chain(base))):
            parent = view.states[version].parent
            if parent is None or not (view.verdict(version) == "revert"
                                      or view.outcome(version) == REGRESSION):
                continue
            before = view.ws.resolved_recipe(parent, view.states)
            settings = dotted_settings(
                revert_overrides(before, view.states[version].spec.get("recipe") or {}))
            if not settings:
                continue
            comparison = view.states[version].records["decision"].get("comparison") or {}
            numbers = (f"Δ {comparison['delta']:+.4f}, CI [{comparison['ci_low']:+.4f}, "
                       f"{comparison['ci_high']:+.4f}]" if comparison else "no comparison")
            changed = view.applied_skills(version) or ["its settings"]
            proposal = Proposal(
                base,
                f"Revert: {version} ({view.verdict(version)}, {numbers}) regressed against "
                f"{parent}; undo its change ({', '.join(changed)}) on {base}, restoring "
                f"{parent}'s values.",
                settings=settings,
                hypothesis=f"If {version}'s change is undone on {base}, then Avg@k rises, "
                f"because {version} scored below {parent}.",
                criterion="delta >= 0.0",
                proposal={"planner": "rules", "tokens": 0, "frontier": base, "move": "revert",
                          "reverts": version},
            )
            out.append(_Candidate(proposal, (-1, False, 1, depth),
                                  overrides=overrides_key(settings)))
        return out

    def _defaults(self, view: View, frontier: str, fired: bool) -> list[_Candidate]:
        state = view.states[frontier]
        recipe = view.ws.resolved_recipe(frontier, view.states)
        why = (f"No skill trigger fired on {frontier}'s diagnosis or its children's"
               if not fired else "Every skill whose trigger fired is already proposed, tried, "
               "refuted or declined")
        meta = {"planner": "rules", "tokens": 0, "frontier": frontier, "default": True,
                "triggers_fired": fired}
        # (settings, rationale, hypothesis, rank): an untrained root without children is
        # trained as is before anything else (its alerts describe the base model, not
        # training: the trained run is the reference); other defaults come after every skill.
        options: list[tuple[list[str], str, str, tuple]] = []
        if state.spec.get("train") is False:
            steps = recipe["grpo"]["steps"]
            lead = f"{why}; " if not fired else ""
            options.append(([], f"{lead}{frontier} is untrained, so the most informative next "
                            f"step is to train its recipe as is ({steps} GRPO steps): the "
                            "trained reference every later intervention is compared with "
                            f"({frontier}'s own alerts describe the base model, not training).",
                            f"If the recipe is trained for {steps} steps, then Avg@k rises "
                            f"over the untrained {frontier}, because GRPO reinforces the "
                            "correct samples the base policy already produces.",
                            (4, False, 0, -1) if view.children(frontier) else (-2, False, 0, 0)))
            seeds = list(recipe.get("seeds") or [0])
            if any(view.failed(c) for c in view.children(frontier)):
                # Its recipe trained as is failed: before anything else is believed about that
                # recipe, one more seed says whether the failure was the seed's.
                options.append(([f"seeds={json.dumps([max(seeds) + 1])}"],
                                f"{why}; {frontier} trained as is failed, so the most "
                                f"informative default is its recipe on another seed (seed "
                                f"{max(seeds) + 1} instead of {seeds}): is the failure the "
                                "seed's or the recipe's?",
                                f"If {frontier}'s recipe trains on seed {max(seeds) + 1}, then "
                                f"Avg@k rises over the untrained {frontier}, because the "
                                "failed run was seed noise.",
                                (4, False, 0, 1)))
        else:
            steps = recipe["grpo"]["steps"]
            if view.has_policy(frontier):
                # Continue the frontier's recorded policy: retraining 2×steps from the base
                # would have to win back the frontier's whole gain before it adds anything.
                # `model.init: parent` is inherited, so a promoted continuation's own
                # "more training" child continues again.
                options.append(([f"model.init={json.dumps('parent')}", f"grpo.steps={steps}"],
                                f"{why}; the most promising default is more training: continue "
                                f"{frontier}'s policy for {steps} more steps instead of "
                                f"retraining {2 * steps} from the base.",
                                f"If {frontier}'s policy trains for {steps} more steps, then "
                                "Avg@k rises over it, because the score was still moving.",
                                (4, False, 0, 0)))
            else:
                options.append(([f"grpo.steps={2 * steps}"],
                                f"{why}; the most promising default is more training: {steps} "
                                f"→ {2 * steps} steps on {frontier}'s recipe.",
                                f"If {frontier} trains for {2 * steps} steps instead of {steps}, "
                                "then Avg@k rises, because the score was still moving.",
                                (4, False, 0, 0)))
            seeds = list(recipe.get("seeds") or [0])
            # A seed rerun repeats the frontier's own training; it must not continue from it.
            rerun = ([f"model.init={json.dumps('base')}"]
                     if init_mode(recipe) == "parent" else [])
            options.append(([*rerun, f"seeds={json.dumps([*seeds, max(seeds) + 1])}"],
                            f"{why}; a second seed on {frontier}'s recipe measures the seed "
                            "spread before any further intervention is believed"
                            + (" (trained from the base: a child cannot repeat "
                               f"{frontier}'s continuation of its own parent)." if rerun
                               else "."),
                            f"If {frontier} is rerun with another seed, then its Avg@k holds "
                            "within the CI, because its gain was real and not seed noise.",
                            (4, False, 0, 1)))
        return [
            _Candidate(Proposal(frontier, rationale, settings=settings, hypothesis=hypothesis,
                                criterion="delta >= 0.0", proposal=dict(meta)),
                       rank, overrides=overrides_key(settings))
            for settings, rationale, hypothesis, rank in options
        ]


# ---- helpers ---------------------------------------------------------------------------


@dataclass
class _Tried:
    """What was tried from one parent: skills, skill sets, canonical settings overrides."""

    skills: set[str]
    sets: set[frozenset[str]]
    overrides: set[str]

    def has(self, candidate: _Candidate) -> bool:
        if len(candidate.skills) > 1:
            return frozenset(candidate.skills) in self.sets
        if candidate.skills:
            return bool(set(candidate.skills) & self.skills)
        return candidate.overrides in self.overrides

    def add(self, candidate: _Candidate) -> None:
        self.skills |= set(candidate.skills)
        self.sets.add(frozenset(candidate.skills))
        self.overrides.add(candidate.overrides)


def _tried(view: View, tried: dict[str, _Tried], candidate: _Candidate) -> _Tried:
    """What was tried from the parent `candidate` forks from (read once per decision)."""
    parent = candidate.proposal.parent
    if parent not in tried:
        children = view.children(parent)
        tried[parent] = _Tried({s for c in children for s in view.applied_skills(c)},
                               {frozenset(view.applied_skills(c)) for c in children},
                               view.tried_overrides(parent))
    return tried[parent]


def _retrieved(
    view: View, frontier: str, diagnosis: dict, skill: Any
) -> tuple[list[str], list[dict]]:
    """What the project's recorded knowledge says about this skill on this evidence (the
    evidence's alerts and metrics, the skill's name): up to `CITED` items besides the skill's
    own library entry, each with its citation, and the search trace for the proposal."""
    domain = view.ws.resolved_recipe(frontier, view.states)["domain"]["name"]
    trace = SearchTrace()
    try:
        found = retrieve(view.ws, query_for(diagnosis, domain, text=skill.name),
                         limit=CITED + 1, trace=trace, states=view.states)
    except EvoError as err:
        # Retrieval informs a proposal; an unreadable listed workspace must not block it.
        return [f"retrieval failed ({err.message})"], trace.as_list()
    cited = [f"{item.title} — {item.cite()}" for item in found
             if not (item.kind == "skill" and item.title == skill.name)][:CITED]
    return cited, trace.as_list()


def _metrics_read(values: dict[str, Any]) -> frozenset[str]:
    """The metric names a trigger read (`trend.x` reads x; the alert list and the recipe
    are not metrics)."""
    names = {k.removeprefix("trend.").removeprefix("keyed.") for k in values}
    return frozenset(n for n in names if n != "alerts" and not n.startswith("recipe."))


def _effect(backtest: dict | None) -> float | None:
    """A backtest's effect as the share of the dead groups it fixes (a filter drops them, a
    reward component rescues them); None without a backtest."""
    if not backtest or "error" in backtest:
        return None
    if backtest["kind"] == "reward":
        return backtest.get("rescue_ratio")
    before = backtest.get("dead_group_ratio_before")
    after = backtest.get("dead_group_ratio_after")
    if before is None or after is None:
        return None
    return (before - after) / before if before > 0 else 0.0


def _backtest_text(report: dict) -> str:
    if "error" in report:
        return f"No backtest possible ({report['error']})."
    if report["kind"] == "filter":
        return (
            f"Backtest on {report['version']}'s {report['groups']} train groups: keeps "
            f"{_pct(report['keep_ratio'])} (lowest step {_pct(report['keep_ratio_min_step'])}), "
            f"dead-group ratio {_fmt(report['dead_group_ratio_before'])} → "
            f"{_fmt(report['dead_group_ratio_after'])}, reward spread "
            f"{_fmt(report['reward_spread_before'])} → {_fmt(report['reward_spread_after'])}."
        )
    return (
        f"Backtest on {report['version']}'s {report['rollouts']} train rollouts "
        f"(+{report['weight']:g} × {report['component']}): dead groups "
        f"{report['dead_groups_before']} → {report['dead_groups_after']} "
        f"({_pct(report['rescue_ratio'])} rescued), reward spread "
        f"{_fmt(report['reward_spread_before'])} → {_fmt(report['reward_spread_after'])}."
    )


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _plain(value: Any) -> Any:
    """YAML-safe plain values (numpy scalars → float, tuples → lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return value
