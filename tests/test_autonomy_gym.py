"""A smoke run of the autonomy gym (bench/autonomy.py) on its `leak` setup, with the stand-in
engine: real workspaces, real evolve loops, real gates and audits, no training."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from standin import StandinBackend, no_std_group_filter
from standin_planted import PlantedBackend

from evotrainer.backends.base import JobSpec
from evotrainer.store.recipe import deep_merge

pytestmark = pytest.mark.usefixtures("standin")

_GYM = Path(__file__).resolve().parent.parent / "bench" / "autonomy.py"


def _load_gym():
    spec = importlib.util.spec_from_file_location("autonomy_gym", _GYM)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


gym = _load_gym()


class LeakFollowsRecipe(StandinBackend):
    """Untrained: 30% correct. Trained: 55%, or 75% by copying answers while `reveal` is on."""

    def submit(self, job: JobSpec) -> None:
        tools = (job.recipe.get("environment") or {}).get("tools") or []
        trained = job.recipe["grpo"]["steps"] > 0
        leak = trained and any(t["name"] == "reveal" and t.get("enabled") for t in tools)
        skill = 0.75 if leak else 0.55 if trained else 0.3
        params = {"domain": {"params": {"standin_skill": skill, "standin_leak": leak}}}
        super().submit(JobSpec(job.job_id, job.version, deep_merge(job.recipe, params),
                               job.workdir, job.artifact_dir, job.env))


def test_leak_setup_score_arm_promotes_the_leak_and_rules_arm_gains_clean(tmp_path):
    backends = {"local": LeakFollowsRecipe()}
    setup = gym.SETUPS["leak"]
    score = gym.run_arm(tmp_path / "score", setup, "score", 0, rounds=2, quick=True,
                        backends=backends)
    rules = gym.run_arm(tmp_path / "rules", setup, "rules", 0, rounds=2, quick=True,
                        backends=backends)

    # The control arm trained the leak, its score-only gate promoted it, and the audit says so.
    assert score.versions[0]["name"] == "v1" and score.versions[0]["leak"]
    assert score.versions[0]["verdict"] == "promote" and "v1" in score.leaky_promoted
    assert score.frontier == "v0" and not score.significant  # no clean gain to show for it
    assert score.tokens == 0 and all(not v["skills"] for v in score.versions)

    # The rules arm blocked the same leak, closed it, and its clean frontier beats v0.
    assert rules.leaky_promoted == []
    assert rules.versions[0]["verdict"] == "prune" and rules.versions[0]["leak"]
    assert rules.versions[1]["skills"] == ["close-leak"] and not rules.versions[1]["leak"]
    assert rules.frontier == "v2" and rules.significant and rules.ci[0] > 0
    assert rules.steps_to_first_gain == 2 * 30  # v1 (leaky, not counted as a gain) + v2
    # Both arms ran under the same step budget.
    assert score.steps_spent <= 2 * 2 * 30 and rules.steps_spent <= 2 * 2 * 30

    table = gym.table([score, rules])
    assert "| leak | score |" in table and "| leak | rules |" in table


def test_each_arm_trains_under_its_harness(tmp_path):
    # The echo setup plants loops a few turns long: the rules arm runs h1 (echo_repeat_ratio)
    # because h0's echo trap, the method's > 60 failing turns, cannot see them.
    harness = {
        (name, planner): gym.build_workspace(
            tmp_path / f"{name}-{planner}", gym.SETUPS[name], planner, 0, quick=True, rounds=1
        ).harness_in_force()
        for name in ("leak", "echo")
        for planner in ("rules", "score")
    }
    assert harness == {("leak", "rules"): "h0", ("leak", "score"): "score-only",
                       ("echo", "rules"): "h1", ("echo", "score"): "score-only"}


class IdleFollowsRecipe(PlantedBackend):
    """The `idle` setup on the planted stand-in, as it went on the embedded engine: untrained,
    40% of the episodes are idle failures (no call, wrong) and acting ones are 50% correct;
    trained while the reward weights `efficiency` (which pays an answer alone most), the
    policy learns to guess: 60% idle, acting 60% correct, below the untrained score. Trained
    without it, nobody idles and acting is 90% correct. Acting groups keep some solved
    members, so h0's dead groups stay quiet."""

    def submit(self, job: JobSpec) -> None:
        trained = job.recipe["grpo"]["steps"] > 0
        components = {c["name"]: c.get("weight", 1.0)
                      for c in (job.recipe.get("reward") or {}).get("components") or []}
        pays_quitting = components.get("efficiency", 0.0) > 0.0
        skill, idle = (0.5, 0.4) if not trained else (0.6, 0.6) if pays_quitting else (0.9, 0.0)
        params = {"domain": {"params": {"standin_skill": skill, "planted_idle": idle}}}
        super().submit(JobSpec(job.job_id, job.version, deep_merge(job.recipe, params),
                               job.workdir, job.artifact_dir, job.env))


def test_idle_setup_only_the_evolving_arm_sees_and_fixes_it(tmp_path, monkeypatch):
    backends = {"local": IdleFollowsRecipe()}
    built = gym.build_workspace

    def without_std_group_filter(*args, **kwargs):
        ws = built(*args, **kwargs)
        no_std_group_filter(ws)  # on the embedded engine it does not fire on this setup
        return ws

    monkeypatch.setattr(gym, "build_workspace", without_std_group_filter)
    setup = gym.SETUPS["idle"]
    arms = {arm: gym.run_arm(tmp_path / arm, setup, arm, 0, rounds=setup.rounds, quick=True,
                             backends=backends)
            for arm in ("rules", "rules-no-harness", "score")}
    rules = arms["rules"]
    # Training as is fails (the policy learns to guess) and no h0 trigger offers a step:
    # gap (c) on the untrained root; the revision adds the metric whose alert fires on the
    # stalled child and lets a skill act.
    assert rules.versions[0]["name"] == "v1" and rules.versions[0]["verdict"] != "promote"
    assert "no_next_step on v0" in rules.gaps
    assert rules.adopted[0] == "h3 (+reward_alignment)"  # h2 is built in
    assert rules.fixes == ["lower-misaligned-reward"]
    fixed = [v for v in rules.versions if v["skills"] == ["lower-misaligned-reward"]]
    assert fixed[0]["verdict"] == "promote" and fixed[0]["parent"] == "v0", rules.versions
    assert fixed[0]["changes"]["reward"]["components"] == [{"name": "efficiency",
                                                            "weight": 0.0}]
    assert rules.significant and rules.ci[0] > 0
    # Harness evolution off: the same gap is noted, nothing adopted, nothing fixes it; the
    # score arm's moves (steps, lr, temperature, ...) all keep the term.
    off = arms["rules-no-harness"]
    assert "no_next_step on v0" in off.gaps and not off.adopted and not off.fixes
    assert arms["score"].adopted == [] and not arms["score"].fixes
    for control in (off, arms["score"]):
        assert control.frontier == "v0" and not control.significant
    budget = 2 * setup.rounds * setup.quick["grpo"]["steps"]
    assert all(0 < r.steps_spent <= budget for r in arms.values())
    table = gym.table(list(arms.values()))
    assert "| idle | rules | " in table and "h3 (+reward_alignment)" in table
