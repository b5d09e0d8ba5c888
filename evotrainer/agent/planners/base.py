"""The planner interface: read-only views of the workspace in, proposals out.

Three planners implement it (`rules`, `anthropic`, and `score`, the score-only control arm).
They see the same `View` — the lineage, the frontier, its diagnosis and the skill library
(`score` reads only verdicts and Avg@k) — and return `Proposal`s (new policy
versions) and `HarnessProposal`s (new harness revisions). Writing them is not the
planner's job: `write_proposals` turns each into an unapproved `evo/<name>` branch (or a
harness revision file committed on main), so every planner's output is reviewed the same
way, with `git diff evo/PARENT..evo/NAME`.

The proposal policy is enforced there too (`policy_violation`), whichever planner proposed:
a skill known to hurt (negative) is never proposed, a skill this lineage refuted is not
proposed again, a version changes one factor unless it is a bundle of independently
supported single-factor fixes (the method's controlled multi-factor option), and a failed
version is never forked. A proposal that breaks it is refused, with the reason in the
result's notes.

A version whose outcome is mixed evidence (it removed the pathology it was proposed for,
its score gain inside the CI: gate/outcomes.py) is not failed: its skill is not
refuted, and proposals build on it (`proposal_base`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import yaml

from evotrainer.control.versions import new_version, parse_assignment
from evotrainer.diagnosis.harness import HarnessRevision, parse_harness, resolve_harness
from evotrainer.errors import EvoError
from evotrainer.gate.counterfactual import family_of
from evotrainer.gate.outcomes import MIXED, SUPPORTED
from evotrainer.skills.library import workspace_library
from evotrainer.skills.skill import Skill
from evotrainer.store.builtin import harness_file
from evotrainer.store.checkpoints import CHECKPOINT, is_dropped
from evotrainer.store.git import PRUNED_TAG_PREFIX
from evotrainer.store.lineage import main_frontier, merged_into_main, tree_order
from evotrainer.store.recipe import canonical_json, set_dotted
from evotrainer.store.records import NO_GAIN, JobState
from evotrainer.store.specs import load_yaml, schema_modeline
from evotrainer.store.workspace import VersionState, Workspace

PLANNERS = ("rules", "score", "anthropic")
DEFAULT_ESCALATE_AFTER = 3
# `proposal.move` of a controlled multi-factor version: the one exception to one factor.
BUNDLE = "bundle"


@dataclass
class Proposal:
    """One candidate policy version: a single factor on top of `parent`."""

    parent: str
    rationale: str
    skills: list[str] = field(default_factory=list)
    settings: list[str] = field(default_factory=list)  # dotted KEY=VALUE recipe overrides
    # skill: {variable: value} its trigger bound (Skill.bind), for the skills that bind
    bindings: dict[str, dict[str, Any]] = field(default_factory=dict)
    hypothesis: str | None = None
    criterion: str | None = None
    proposal: dict[str, Any] = field(default_factory=dict)  # planner, tokens, backtest, ...
    name: str | None = None  # assigned when written


@dataclass
class HarnessProposal:
    """A new harness revision (a full HarnessRevision document) and its backtest."""

    document: dict[str, Any]
    rationale: str
    backtest: dict[str, Any] | None = None
    gap: dict[str, Any] | None = None  # the diagnostic gap it answers (diagnosis/gaps.py)

    @property
    def name(self) -> str:
        return self.document["name"]


@dataclass
class PlannerResult:
    proposals: list[Proposal] = field(default_factory=list)
    harness: list[HarnessProposal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was declined or skipped, and why
    tokens: int = 0


class Planner(Protocol):
    name: str

    def propose(self, view: View, max_proposals: int) -> PlannerResult: ...


# ------------------------------------------------------------------------------ the view


@dataclass
class View:
    """What a planner may read: git state, derived once per decision."""

    ws: Workspace
    states: dict[str, VersionState]
    pruned: set[str]
    harness: HarnessRevision
    skills: dict[str, Skill]

    @classmethod
    def load(cls, ws: Workspace) -> View:
        return cls(
            ws=ws,
            states=ws.versions(),
            pruned=set(ws.git.tags(PRUNED_TAG_PREFIX)),
            harness=resolve_harness(ws.harness_in_force(), ws.root),
            skills=workspace_library(ws),
        )

    @property
    def autonomy(self) -> dict[str, Any]:
        return self.ws.project.get("autonomy") or {}

    @property
    def planner_config(self) -> dict[str, Any]:
        return self.ws.project.get("planner") or {}

    def verdict(self, name: str) -> str | None:
        return (self.states[name].records.get("decision") or {}).get("verdict")

    def run_state(self, name: str) -> str | None:
        return (self.states[name].records.get("run") or {}).get("state")

    def has_policy(self, name: str) -> bool:
        """Trained, with its policy recorded and not dropped: a child can continue it
        (`model.init: parent`)."""
        state = self.states[name]
        run = state.records.get("run") or {}
        artifact = (run.get("artifacts") or {}).get(CHECKPOINT)
        return (state.spec.get("train") is not False and run.get("state") == JobState.SUCCEEDED
                and bool(artifact) and not is_dropped(artifact))

    def outcome(self, name: str) -> str | None:
        """The gate's outcome (improvement, regression, mixed_evidence,
        insufficient_evidence); None before the gate, or for a decision recorded before
        outcomes were."""
        decision = self.states[name].records.get("decision") or {}
        return (decision.get("outcome") or {}).get("kind")

    def failed(self, name: str) -> bool:
        """Did not beat its parent: pruned, reverted, inconclusive, or the job failed — except
        mixed evidence, which removed what it was proposed for and is not refuted."""
        if self.outcome(name) == MIXED and self.verdict(name) == "inconclusive":
            return False
        return self.verdict(name) in NO_GAIN or (
            self.run_state(name) == JobState.FAILED and self.verdict(name) is None
        )

    def supported(self, name: str) -> bool:
        """Its outcome supports building on it: an improvement, or mixed evidence."""
        return self.outcome(name) in SUPPORTED and name not in self.pruned

    def proposal_base(self, frontier: str) -> str:
        """Where proposals fork: the frontier, or the latest mixed-evidence version grown
        from it (followed down while each builds on the last): the planner builds on a fix
        that removed its pathology instead of going back to the frontier."""
        base = frontier
        while True:
            mixed = [c for c in self.decided_order()
                     if self.states[c].parent == base and self.outcome(c) == MIXED
                     and not self.failed(c) and c not in self.pruned]
            if not mixed:
                return base
            base = mixed[-1]

    def frontier(self) -> str:
        """Main's frontier (its latest promotion, else its baseline); the first root while
        main holds neither, so the first proposals start from the baseline being gated."""
        frontier = main_frontier(self.states, merged_into_main(self.ws))
        if frontier is not None:
            return frontier
        roots = [n for n in tree_order(self.states) if self.states[n].parent is None]
        if not roots:
            raise EvoError("no root version", hint="run `evotrainer init DIR` to get v0")
        return roots[0]

    def chain(self, name: str) -> list[str]:
        return [s.name for s in self.ws.chain(name, self.states)]

    def children(self, name: str) -> list[str]:
        return [n for n in tree_order(self.states) if self.states[n].parent == name]

    def decided_order(self) -> list[str]:
        """Gated or failed non-root versions, oldest decision first."""
        out = []
        for name, state in self.states.items():
            if state.parent is None:
                continue
            decision = state.records.get("decision") or {}
            run = state.records.get("run") or {}
            when = decision.get("decided_at") or (
                run.get("finished_at") if run.get("state") == JobState.FAILED else None
            )
            if when:
                out.append((when, name))
        return [name for _, name in sorted(out)]

    def failure_streak(self) -> list[str]:
        """The versions decided since the last promotion, all failed (oldest first)."""
        streak: list[str] = []
        for name in self.decided_order():
            streak = [*streak, name] if self.failed(name) else []
        return streak

    def escalate_after(self) -> int:
        return int(self.autonomy.get("escalate_after_failures") or DEFAULT_ESCALATE_AFTER)

    def applied_skills(self, name: str) -> list[str]:
        spec = self.states[name].spec or {}
        return list((spec.get("intervention") or {}).get("skills") or [])

    def applied_bindings(self, name: str) -> dict[str, dict[str, Any]]:
        """{skill: {variable: value}} the version's skills were bound with when proposed."""
        spec = self.states[name].spec or {}
        return dict((spec.get("intervention") or {}).get("bindings") or {})

    def applied_skill(self, name: str, skill: str) -> Skill | None:
        """The library skill `skill` as version `name` applied it (bound as it was bound)."""
        found = self.skills.get(skill)
        bindings = self.applied_bindings(name).get(skill)
        return found.bound(bindings) if found is not None and bindings else found

    def refuted_skills(self, frontier: str) -> dict[str, str]:
        """{skill: version} for skills applied by a failed ancestor of the frontier or a failed
        sibling anywhere along its chain: interventions this lineage already refuted."""
        chain = self.chain(frontier)
        related = set(chain) | {n for n, s in self.states.items() if s.parent in chain}
        refuted: dict[str, str] = {}
        for name in sorted(related):
            if self.failed(name) or name in self.pruned:
                for skill in self.applied_skills(name):
                    refuted.setdefault(skill, name)
        return refuted

    def tried_overrides(self, parent: str) -> set[str]:
        """Canonical recipe overrides of every child of `parent`, whatever its state: the
        same change from the same parent is never proposed twice."""
        return {
            canonical_json((self.states[n].spec or {}).get("recipe") or {})
            for n in self.children(parent)
        }


def fmt(value: Any) -> str:
    """A number as a rationale shows it: three significant digits."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def overrides_key(settings: list[str]) -> str:
    """Canonical recipe overrides of dotted KEY=VALUE settings, comparable with
    `View.tried_overrides`."""
    overrides: dict = {}
    for setting in settings:
        set_dotted(overrides, *parse_assignment(setting))
    return canonical_json(overrides)


def dotted_keys(overrides: dict) -> set[str]:
    """The dotted leaf keys a recipe override sets."""
    return {setting.split("=", 1)[0] for setting in dotted_settings(overrides)}


def revert_overrides(before: Any, patch: Any) -> Any:
    """The override that undoes `patch` on top of `before` (None removes a key; a named
    list entry the patch added is switched off: weight 0 or enabled false)."""
    if isinstance(patch, dict):
        if not isinstance(before, dict):
            return before
        return {k: revert_overrides(before[k], v) if k in before else None
                for k, v in patch.items()}
    if isinstance(patch, list) and all(isinstance(i, dict) and "name" in i for i in patch):
        index = {i["name"]: i for i in before or [] if isinstance(i, dict) and "name" in i}
        out = []
        for item in patch:
            if item["name"] in index:
                out.append({"name": item["name"], **{k: index[item["name"]].get(k)
                                                     for k in item if k != "name"}})
            elif "weight" in item:
                out.append({"name": item["name"], "weight": 0.0})
            elif "enabled" in item:
                out.append({"name": item["name"], "enabled": False})
        return out
    return before


def dotted_settings(override: dict, prefix: str = "") -> list[str]:
    """Dotted KEY=VALUE (JSON values, which YAML reads back) for `new_version`."""
    out = []
    for key, value in override.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += dotted_settings(value, dotted + ".")
        else:
            out.append(f"{dotted}={json.dumps(value)}")
    return out


# ------------------------------------------------------------------------------ policy


def policy_violation(view: View, proposal: Proposal) -> str | None:
    """Why the proposal policy refuses `proposal`, or None when it may be written."""
    parent = proposal.parent
    if parent not in view.states:
        return f"parent {parent!r} is not a version"
    # A rerun of an inconclusive parent on more seeds (planners/evidence.py) adds no factor:
    # it measures the parent again, so it may fork a version the gate left inconclusive.
    rerun = proposal.proposal.get("evidence_for") == parent and view.verdict(parent) == \
        "inconclusive"
    if (view.failed(parent) and not rerun) or parent in view.pruned:
        return (f"parent {parent} failed ({view.verdict(parent) or view.run_state(parent)}): "
                "a failed version is never forked; branch from the frontier "
                f"{view.frontier()}")
    negative = [s for s in proposal.skills if s in view.skills and view.skills[s].negative]
    if negative:
        return f"skill(s) {', '.join(negative)} are known to hurt (negative evidence)"
    refuted = view.refuted_skills(parent)
    again = [s for s in proposal.skills if s in refuted]
    if again:
        return ", ".join(f"{s} was refuted on this lineage by {refuted[s]}" for s in again)
    factors = len(proposal.skills) + (1 if proposal.settings else 0)
    if factors <= 1:
        return None
    if proposal.proposal.get("move") != BUNDLE or proposal.settings:
        return (f"{factors} factors ({', '.join(proposal.skills)}"
                f"{' and settings' if proposal.settings else ''}): one factor per version, "
                "unless a bundle of skills each supported on its own")
    unsupported = [s for s in proposal.skills if not any(
        view.applied_skills(v) == [s] and view.supported(v) for v in view.states)]
    # The method's second clause: "or the interaction itself is tested" — a half not yet
    # supported on its own runs alone from the same parent too, so the gate compares the
    # bundle with each half and the interaction is measured, not assumed.
    untested = [s for s in unsupported if not any(
        view.applied_skills(v) == [s] and view.states[v].parent == parent
        for v in view.states)]
    if untested:
        return (f"bundle of {', '.join(proposal.skills)}: {', '.join(untested)} has no "
                "recorded single-factor version with an improvement or mixed evidence, and "
                f"no single-factor sibling from {parent} that would test the interaction")
    return None


# ------------------------------------------------------------------------------ writing

_NUMBERED = re.compile(r"^(?P<head>[a-z]+)(?P<n>\d+)$")


def next_name(existing: list[str], prefix: str) -> str:
    numbers = [
        int(m["n"]) for name in existing if (m := _NUMBERED.match(name)) and m["head"] == prefix
    ]
    return f"{prefix}{max(numbers, default=0) + 1}"


def write_proposals(ws: Workspace, result: PlannerResult, view: View | None = None) -> list[str]:
    """Create one unapproved branch per version proposal and commit each harness revision
    file on main; return the names written. A proposal the policy refuses is dropped from
    `result.proposals` and the reason noted; proposals that `new_version` rejects (a bad
    setting) fail loudly before anything else is written for them. `view`: the one the
    planner read (else read afresh)."""
    view = view or View.load(ws)
    accepted = []
    broken: set[str] = set()  # families that lost a member: written whole or not at all
    for proposal in result.proposals:
        refusal = policy_violation(view, proposal)
        if refusal:
            result.notes.append(f"refused a proposal from {proposal.parent} "
                                f"({', '.join(proposal.skills) or 'settings'}): {refusal}")
            if family := family_of({"proposal": proposal.proposal}):
                broken.add(family["name"])
        else:
            accepted.append(proposal)
    result.proposals = []
    for proposal in accepted:
        family = family_of({"proposal": proposal.proposal})
        if family and family["name"] in broken:
            result.notes.append(f"dropped {proposal.name} with its family {family['name']}: "
                                "a family is written whole or not at all")
        else:
            result.proposals.append(proposal)
    # A planner may name its proposals (a family's members name each other): others take
    # the next free name around them.
    named = [p.name for p in result.proposals if p.name]
    written = []
    for proposal in result.proposals:
        name = proposal.name or next_name([*ws.versions(), *named], "v")
        new_version(
            ws,
            name,
            proposal.parent,
            rationale=proposal.rationale,
            skills=proposal.skills,
            bindings=proposal.bindings,
            settings=proposal.settings,
            hypothesis=proposal.hypothesis,
            criterion=proposal.criterion,
            proposal=proposal.proposal,
        )
        proposal.name = name
        written.append(name)
    for harness in result.harness:
        written.append(write_harness_revision(ws, harness))
    return written


def write_harness_revision(ws: Workspace, harness: HarnessProposal) -> str:
    """Commit `harness_revisions/<name>.yaml` on main (not in force until adopted)."""
    path = harness_file(harness.name)
    if ws.harness_path(harness.name).exists() or ws.git.read("main", path) is not None:
        raise EvoError(f"harness revision {harness.name!r} already exists", where=path,
                       hint="revisions are never overwritten; pick a new name")
    text = schema_modeline(path, "HarnessRevision") + yaml.safe_dump(
        harness.document, sort_keys=False, allow_unicode=True)
    parse_harness(load_yaml(text, path), source=path)  # never commit an invalid revision
    summary = ""
    if harness.backtest:
        cases = harness.backtest.get("cases") or []
        passed = sum(c["passed"] for c in cases)
        summary = (
            f"\n\nBacktest against {harness.backtest['against']}: "
            f"{len(harness.backtest.get('changed') or [])} version(s) change, "
            f"cases {passed}/{len(cases)} pass."
        )
    if harness.gap:
        summary += f"\n\nGap: {harness.gap['kind']} on {harness.gap['version']}: " \
                   f"{harness.gap['reason']}"
    ws.git.commit_files(
        "main",
        {path: text.encode()},
        f"Propose harness {harness.name}: {harness.rationale}{summary}",
        {"Action": "propose-harness", "Harness": harness.name},
    )
    return harness.name
