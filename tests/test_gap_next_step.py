"""Gap (c), no next step, from an untrained root whose training failed: the root has no train
rollouts to measure, so a catalogue metric explains the stall when its alert fires on every
stalled child; among those, the one whose alert lets a library skill offer a step not yet
taken ranks first (the gap is that nothing selects the next intervention). The values are
the catalogue's on the autonomy gym's idle setup, v1 on the embedded engine (seed 0): the
reward audit's at full size, the others at `--quick`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from evotrainer.agent.planners.revisions import _discrimination
from evotrainer.control.scaffold import EXAMPLES_DIR
from evotrainer.diagnosis.catalogue import catalogue
from evotrainer.diagnosis.gaps import no_next_step
from evotrainer.skills.skill import load_library
from evotrainer.store.recipe import deep_merge, resolve

TOOLENV = resolve(yaml.safe_load(Path(EXAMPLES_DIR, "toolenv.yaml").read_text())["recipe"], [])
# The idle setup's reward: partial credit already on, and the term that pays quitting.
PLANTED = deep_merge(TOOLENV, {"reward": {"components": [
    {"name": "partial", "weight": 0.5}, {"name": "efficiency", "weight": 0.5}]}})
# The reward audit on v1's train rollouts: each weighted component's correlation with
# correctness (the efficiency term pays an answer alone, so it falls as episodes fail).
ALIGNMENT = {"partial": 0.300, "efficiency": -0.104}
# v1 as the probe revision measured it; v0, untrained, measured nothing on the train split.
MEASURED = {"v1": {"idle_failure_rate": 0.763, "mid_band_mass": 0.136,
                   "response_length_p90_budget": 4.0, "tool_limit_ratio": 0.0,
                   "unclosed_think_ratio": 0.0, "failed_turns_inflation": 0.951,
                   "reward_alignment": ALIGNMENT["efficiency"]}}
KEYED = {"v1": {"reward_alignment": ALIGNMENT}}
ENTRIES = {e.metric["name"]: e for e in catalogue()}


class StalledRoot:
    """What the planner's View answers for an untrained root v0 with one failed child v1,
    whose h0 diagnosis has no alert."""

    def __init__(self, recipe: dict[str, Any], tried: list[str] | None = None) -> None:
        self.skills = load_library()
        self.tried = tried or []
        self.states = {"v0": SimpleNamespace(parent=None, records={}),
                       "v1": SimpleNamespace(parent="v0", records={
                           "diagnosis": {"metrics": {}, "alerts": []}})}
        self.ws = SimpleNamespace(resolved_recipe=lambda name, states=None: recipe)

    def chain(self, name: str) -> list[str]:
        return ["v0"] if name == "v0" else ["v0", name]

    def children(self, name: str) -> list[str]:
        return ["v1"] if name == "v0" else []

    def applied_skills(self, name: str) -> list[str]:
        return self.tried if name == "v1" else []

    def refuted_skills(self, name: str) -> dict[str, str]:
        return {skill: "v1" for skill in self.tried}


def ranked(view: StalledRoot, values: dict = MEASURED) -> dict[str, tuple]:
    gap = no_next_step("v0", False, ["v1"])
    out = {}
    for name in MEASURED["v1"]:
        score, why = _discrimination(view, gap, "v0", ENTRIES[name], values, KEYED)
        out[name] = (score, why)
    return out


def test_the_alert_that_lets_a_skill_act_ranks_first():
    scores = ranked(StalledRoot(PLANTED))
    # Four alerts explain the stall on v1; only the reward audit's makes a skill offer a step
    # (idle_failure's, act-before-answering, would add partial credit, which is on already).
    stalls = sorted(n for n, (score, _) in scores.items() if score and score[0])
    assert stalls == ["idle_failure_rate", "mid_band_mass", "response_length_p90_budget",
                      "reward_alignment"]
    best = max(scores, key=lambda n: scores[n][0])
    assert best == "reward_alignment"
    assert scores[best][0] > max(scores[n][0] for n in stalls if n != best)
    assert "lower-misaligned-reward would offer a next step" in scores[best][1]
    assert f"would fire on v1 ({ALIGNMENT['efficiency']:.3g})" in scores[best][1]
    assert "would offer" not in scores["idle_failure_rate"][1]
    # A metric whose alert does not fire on the stalled child does not explain the stall.
    assert scores["tool_limit_ratio"][0][0] is False


def test_a_step_already_taken_opens_nothing():
    # The same evidence after v1 applied the fix (refuted there): the audit still explains
    # the stall but no longer selects anything, so it ranks as the other alerts do.
    scores = ranked(StalledRoot(PLANTED, tried=["lower-misaligned-reward"]))
    assert scores["reward_alignment"][0] == scores["mid_band_mass"][0] == (True, False, 1.0)
    # Without the term, partial credit is what is missing: act-before-answering opens.
    plain = ranked(StalledRoot(TOOLENV))
    assert "act-before-answering would offer" in plain["idle_failure_rate"][1]


def test_a_stalled_child_under_the_threshold_explains_nothing():
    calm = {"v1": {**MEASURED["v1"], "idle_failure_rate": 0.05}}
    scores = ranked(StalledRoot(PLANTED), calm)
    assert scores["idle_failure_rate"][0][:2] == (False, False)
    # Nothing measured at all (no train rollouts anywhere): no metric discriminates.
    assert ranked(StalledRoot(PLANTED), {})["idle_failure_rate"][0] is None
