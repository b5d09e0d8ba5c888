"""lr-down-on-collapse: fires on the signature of a diverged run (reward falling, groups all
wrong, log-probability falling) and not on a task that is only too hard or a sampler too cold;
the diagnoses are those of the autonomy gym's lr_collapse, too_hard and cold setups."""

from __future__ import annotations

from evotrainer.skills.skill import load_library, match, resolve_skill
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.recipe import BASE_RECIPE, deep_merge

SKILL = "lr-down-on-collapse"


def diagnosis(reward: tuple[float, float], all_wrong: tuple[float, float],
              logprob: tuple[float, float]) -> dict:
    """(value, trend per step) of the three metrics the trigger reads."""
    metric = lambda v: {"value": v[0], "layer": "signal", "trend": v[1]}  # noqa: E731
    return {"alerts": [{"name": "dead_groups"}], "metrics": {
        "reward_mean": metric(reward), "all_wrong_group_ratio": metric(all_wrong),
        "all_correct_group_ratio": metric((0.0, 0.0)), "dead_group_ratio": metric(all_wrong),
        "mean_logprob": metric(logprob)}}


def fired(doc: dict) -> list[str]:
    return [m.skill.name for m in match(load_library(builtin_dir("skills")), doc, domain="arith")]


def test_a_diverged_run_gets_the_default_learning_rate_back():
    collapse = diagnosis((0.0102, -0.00149), (0.978, 0.0032), (-3.81, -0.0127))
    assert SKILL in fired(collapse)
    skill = load_library(builtin_dir("skills"))[SKILL]
    # The gym's 1e-2 comes back to the engine's default 1e-4 (a tenth, at most 1e-4) ...
    collapsed = deep_merge(BASE_RECIPE, {"grpo": {"lr": 1.0e-2}})
    assert resolve_skill(skill, collapsed).overrides == {"grpo": {"lr": BASE_RECIPE["grpo"]["lr"]}}
    # ... and a learning rate already under the default is lowered too, never raised to it.
    small = deep_merge(BASE_RECIPE, {"grpo": {"lr": 1.0e-6}})
    assert resolve_skill(skill, small).overrides == {"grpo": {"lr": 1.0e-7}}


def test_a_task_too_hard_or_a_sampler_too_cold_is_not_a_collapse():
    too_hard = diagnosis((0.124, 0.00116), (0.588, -0.00206), (-1.45, 0.00985))
    cold = diagnosis((0.499, -0.00031), (0.367, 0.00161), (-0.147, 0.00135))
    all_wrong_but_learning = diagnosis((0.02, 0.0004), (0.95, -0.001), (-2.0, 0.002))
    for doc in (too_hard, cold, all_wrong_but_learning):
        assert SKILL not in fired(doc)
