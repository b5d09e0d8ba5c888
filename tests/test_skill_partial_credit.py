"""partial-credit-on-stall: fires on a clean run that stalled on its binary reward, and on
nothing else (a leaky run, a run whose reward still climbs, a mostly solved or untrained one)."""

from __future__ import annotations

import yaml

from evotrainer.control.scaffold import EXAMPLES_DIR
from evotrainer.skills.skill import load_library, match, resolve_skill
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.recipe import resolve

SKILL = "partial-credit-on-stall"


def diagnosis(*, alerts=(), all_wrong=0.14, all_correct=0.05, reward_trend=0.0014) -> dict:
    """The shape of toolenv's clean close-leak rerun (v2) as h0 diagnoses it."""
    return {
        "alerts": [{"name": a} for a in alerts],
        "metrics": {
            "all_wrong_group_ratio": {"value": all_wrong, "layer": "signal", "trend": 0.0},
            "all_correct_group_ratio": {"value": all_correct, "layer": "signal", "trend": 0.0},
            "dead_group_ratio": {"value": all_wrong + all_correct, "layer": "signal",
                                 "trend": 0.0},
            "reward_mean": {"value": 0.45, "layer": "score", "trend": reward_trend},
        },
    }


def fired(doc: dict, domain: str = "toolenv") -> list[str]:
    return [m.skill.name for m in match(load_library(builtin_dir("skills")), doc, domain=domain)]


def test_fires_on_a_clean_stalled_run_and_adds_the_partial_component():
    assert SKILL in fired(diagnosis())
    skill = load_library(builtin_dir("skills"))[SKILL]
    toolenv = resolve(yaml.safe_load((EXAMPLES_DIR / "toolenv.yaml").read_text())["recipe"], [])
    # partial joins at 0.5; correctness stays whole (the patch does not touch it).
    assert resolve_skill(skill, toolenv).overrides == {
        "reward": {"components": [{"name": "partial", "weight": 0.5}]}}


def test_never_fires_on_a_leak_a_climbing_reward_or_an_untrained_run():
    assert SKILL not in fired(diagnosis(alerts=["leak"]))  # close the leak first
    assert SKILL not in fired(diagnosis(reward_trend=0.01))  # still learning
    assert SKILL not in fired(diagnosis(all_wrong=0.02, all_correct=0.3))  # mostly solved
    assert SKILL not in fired(diagnosis(reward_trend=None))  # untrained: no reward trend
    assert SKILL not in fired(diagnosis(), domain="arith")  # evidence only on toolenv
