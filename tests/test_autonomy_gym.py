"""A smoke run of the autonomy gym (bench/autonomy.py) on its `leak` setup, with the stand-in
engine: real workspaces, real evolve loops, real gates and audits, no training."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from standin import StandinBackend

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
