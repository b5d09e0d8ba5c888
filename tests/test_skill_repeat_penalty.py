"""repeat-penalty: fires on h0's echo alert, and its `no_repeat` component gives an all-failing
toolenv group whose rollouts loop to different extents the reward spread correctness lacks."""

from __future__ import annotations

import yaml

from evotrainer.control.scaffold import EXAMPLES_DIR
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.domains import make_domain
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.skills.replay import backtest_reward, skill_reward
from evotrainer.skills.skill import load_library, match, resolve_skill
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.recipe import resolve

SKILL = "repeat-penalty"
LIBRARY = load_library(builtin_dir("skills"))
DOMAIN = {"name": "toolenv", "train_size": 256, "val_size": 64}


def _echo_group() -> list[dict]:
    """One toolenv task, four failing rollouts: two loop on one compare, two search and miss."""
    domain = make_domain(DOMAIN)
    task = domain.split(DOMAIN["train_size"], DOMAIN["val_size"])[0][0]
    lo = task.meta["lo"]
    wrong = lo if int(task.answer) != lo else lo + 1
    loop = f"?{lo};>;" * 6
    responses = [loop, loop, f"?{lo};>;={wrong};", f"={wrong};"]
    rows = []
    for i, response in enumerate(responses):
        actions = response.split(";")[::2][:-1]
        calls = [{"name": "compare", "args": a[1:]} for a in actions if a.startswith("?")]
        score = domain.score(task, response, calls)
        rows.append(
            dict(
                step=1,
                task_id=task.task_id,
                group_id="g",
                sample_idx=i,
                response=response,
                reward=score.correct,
                correct=score.correct,
                turns=len(actions),
                tool_calls=calls,
                reward_components=list(score.components.items()),
            )
        )
    return rows


def test_fires_on_the_echo_alert_of_looping_rollouts():
    table = rollout_table(_echo_group())
    doc = diagnose(table, None, resolve_harness("h1"))
    assert doc["metrics"]["echo_repeat_ratio"] == 0.5
    assert "echo_trap" in [a["name"] for a in doc["alerts"]]
    assert SKILL in [m.skill.name for m in match(LIBRARY, doc, domain="toolenv")]
    assert SKILL not in [m.skill.name for m in match(LIBRARY, doc, domain="arith")]


def test_its_component_rescues_an_all_failing_group_and_keeps_correctness_whole():
    skill = LIBRARY[SKILL]
    toolenv = resolve(yaml.safe_load((EXAMPLES_DIR / "toolenv.yaml").read_text())["recipe"], [])
    # no_repeat joins at 0.5 beside correctness, which the patch leaves whole.
    assert resolve_skill(skill, toolenv).overrides == {
        "reward": {"components": [{"name": "no_repeat", "weight": 0.5}]}}
    component, weight = skill_reward(skill)
    report = backtest_reward(rollout_table(_echo_group()), component, weight, DOMAIN)
    assert (report["dead_groups_before"], report["rescued_groups"]) == (1, 1)
    # The looping rollouts now score below the ones that searched and missed: a spread.
    assert report["reward_spread_after"] > 0.0
