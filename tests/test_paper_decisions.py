"""The paper's decisions that hang on one rule, skill or definition, each on a hand-made case
from the paper's figures: the echo-trapped branch (h2's behaviour audit), the Coding path's
skills (shaped CR on pass_fraction, the Dual-Level filter, on verl too), the IF-judge rescue,
StdGroupFilter's Math transfer, the bundling rule's second clause and ADiv."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from standin import converge
from standin import propose as train

from evotrainer.agent.planners.base import BUNDLE, Proposal, View, policy_violation
from evotrainer.backends.verl_reward import compute_score
from evotrainer.control.versions import new_version
from evotrainer.diagnosis.catalogue import catalogue
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import parse_harness, resolve_harness
from evotrainer.domains import get_domain, make_domain
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.gate.harness_backtest import diff_harness
from evotrainer.gate.rules import gate_verdict
from evotrainer.skills.replay import backtest_filter, backtest_reward, skill_reward
from evotrainer.skills.skill import load_library, match, resolve_skill
from evotrainer.store.recipe import deep_merge
from evotrainer.store.specs import load_yaml

LIBRARY = load_library()
EXAMPLES = Path(__file__).resolve().parent.parent / "evotrainer" / "examples"
# SWE-4B, D.4: BC% 29.71 -> 33.28 on 77 tasks, a gain the paired bootstrap calls significant.
GAIN = {"delta": 0.0357, "ci_low": 0.0114, "ci_high": 0.0601, "p_bootstrap": 0.004}


def paper_recipe(name: str) -> dict:
    return load_yaml((EXAMPLES / f"{name}.yaml").read_bytes(), name)["recipe"]


def episodes(turns: list[int], correct: list[float]) -> pa.Table:
    """Train rollouts in groups of 4, each with its turns and correctness; a rollout over 60
    turns repeats one terminal call (the echo trap's signature)."""
    rows = []
    for i, (t, c) in enumerate(zip(turns, correct, strict=True)):
        calls = ["run_in_terminal pytest"] * t if t > 60 else [
            "read_file a.py", "search_replace a.py", "run_in_terminal pytest"]
        rows.append(dict(step=1, task_id=f"t{i // 4}", sample_idx=i % 4, reward=c, correct=c,
                         turns=t, tool_calls=calls))
    return rollout_table(rows)


def swe4b(echo: int, other_turns: int, n: int = 160) -> pa.Table:
    """n rollouts: `echo` failing ones of 200 turns, the rest at `other_turns`, a third right."""
    turns = [200] * echo + [other_turns] * (n - echo)
    correct = [0.0] * echo + [float(i % 3 == 0) for i in range(n - echo)]
    return episodes(turns, correct)


# ---- 1. the echo-trapped branch --------------------------------------------------------


def test_the_echo_trapped_branch_is_promoted_by_h0_and_h1_and_pruned_by_h2():
    parent = swe4b(echo=5, other_turns=31)  # 36.3 turns (the paper: 36-37)
    branch = swe4b(echo=40, other_turns=35)  # 76.3 turns, 40 of 160 echo-trapped
    for name, verdict, rule in (("h0", "promote", "significant_gain"),
                                ("h1", "promote", "significant_gain"),
                                ("h2", "prune", "behaviour_degeneration")):
        harness = resolve_harness(name)
        before, after = diagnose(parent, None, harness), diagnose(branch, None, harness)
        assert 36.0 <= before["metrics"]["turns_mean"] <= 37.0
        assert after["metrics"]["turns_mean"] == pytest.approx(76.3, abs=0.1)
        assert after["metrics"]["echo_trap_ratio"] == pytest.approx(0.25)
        # The echo trap is a warning in every revision: h2's rule, not an alert, decides.
        assert [a["severity"] for a in after["alerts"] if a["name"] == "echo_trap"] == [
            "warning"]
        result = gate_verdict(harness, after, GAIN,
                              {k: v for k, v in before["metrics"].items()})
        assert (result["verdict"], result["rule"]) == (verdict, rule), name


@pytest.mark.parametrize(("metrics", "parent", "verdict"), [
    # A gain with turns that grow but stay under the echo line is promoted.
    ({"turns_mean": 45.0, "echo_trap_ratio": 0.03}, {"turns_mean": 30.0,
                                                     "echo_trap_ratio": 0.03}, "promote"),
    # Long episodes the parent already ran are no inflation.
    ({"turns_mean": 70.0, "echo_trap_ratio": 0.04}, {"turns_mean": 65.0,
                                                     "echo_trap_ratio": 0.04}, "promote"),
    # A jump in degenerate trajectories alone prunes (the paper's 23 -> 194).
    ({"turns_mean": 38.0, "echo_trap_ratio": 0.25}, {"turns_mean": 36.5,
                                                     "echo_trap_ratio": 0.03}, "prune"),
    # Repeated calls at a short horizon (h1's echo_repeat_ratio) count as degenerate too.
    ({"turns_mean": 6.0, "echo_trap_ratio": 0.0, "echo_repeat_ratio": 0.3},
     {"turns_mean": 6.0, "echo_trap_ratio": 0.0, "echo_repeat_ratio": 0.05}, "prune"),
    # Single-turn evidence (turns null) never decides the rule.
    ({"turns_mean": None, "echo_trap_ratio": 0.0}, {"turns_mean": None,
                                                    "echo_trap_ratio": 0.0}, "promote"),
])
def test_h2_prunes_only_behavioural_degeneration_against_the_parent(metrics, parent, verdict):
    diagnosis = {"metrics": {"echo_repeat_ratio": 0.0, **metrics}, "alerts": []}
    assert gate_verdict(resolve_harness("h2"), diagnosis, GAIN, parent)["verdict"] == verdict


def test_h2_is_h1_plus_the_gate_rule():
    h1, h2 = resolve_harness("h1"), resolve_harness("h2")
    diff = diff_harness(h1, h2)
    assert h2.parent == "h1"
    assert diff["gate_rules"] == {"added": ["behaviour_degeneration"], "removed": [],
                                  "changed": {}}
    assert diff["metrics"] == {"added": [], "removed": [], "changed": {}}
    assert diff["alerts"] == {"added": [], "removed": [], "changed": {}}
    assert set(diff["params"]) == {"inflated_turns", "turn_inflation", "degenerate_jump"}
    # After the integrity block, before any score rule.
    assert [r.name for r in h2.gate_rules][:3] == ["integrity_alert", "behaviour_degeneration",
                                                   "leak_closed"]


# ---- 2. the Coding path from skills ----------------------------------------------------


def test_shaped_correctness_binds_code_pass_fraction_on_paper_code():
    recipe = paper_recipe("paper-code")
    resolution = resolve_skill(LIBRARY["shaped-correctness"], recipe)
    components = {c["name"]: c["weight"] for c in resolution.overrides["reward"]["components"]}
    assert components == {"correctness": 0.5, "pass_fraction": 0.5}
    assert set(components) <= set(get_domain("code").components)
    assert skill_reward(LIBRARY["shaped-correctness"], "code") == ("pass_fraction", 0.5)
    # Elsewhere the skill keeps `partial`.
    assert skill_reward(LIBRARY["shaped-correctness"], "swe") == ("partial", 0.5)


def test_version_new_with_shaped_correctness_on_the_code_domain(workspace):
    new_version(workspace, "v1", "v0", rationale="shaped CR",
                settings=['domain.name="code"', "domain.params=null", "domain.train_size=9",
                          "domain.val_size=4", "grpo.prompts_per_step=8"])
    new_version(workspace, "v2", "v1", rationale="Coding v8", skills=["shaped-correctness"])
    weights = {c["name"]: c["weight"]
               for c in workspace.resolved_recipe("v2")["reward"]["components"]}
    assert weights == {"correctness": 0.5, "pass_fraction": 0.5}


def code_groups() -> pa.Table:
    """Coding groups of 4 under a binary reward: all-wrong groups whose pass fractions differ
    (the shaped CR rescues them), one all-wrong with none passing, one half right."""
    layouts = {"near": [0.25, 0.5, 0.75, 0.5], "near2": [0.2, 0.4, 0.4, 0.6],
               "none": [0.0] * 4, "half": [1.0, 0.5, 1.0, 0.5]}
    rows = []
    for group, fractions in layouts.items():
        for i, f in enumerate(fractions):
            c = float(f == 1.0)
            rows.append(dict(task_id=group, sample_idx=i, reward=c, correct=c,
                             reward_components=[("correctness", c), ("pass_fraction", f)]))
    return rollout_table(rows)


def test_the_shaped_cr_backtest_reads_pass_fraction():
    component, weight = skill_reward(LIBRARY["shaped-correctness"], "code")
    report = backtest_reward(code_groups(), component, weight, "code")
    assert (report["dead_groups_before"], report["dead_groups_after"]) == (3, 1)
    assert report["rescued_groups"] == 2


def test_the_dual_level_filter_is_proposed_after_std_group_filter():
    """Coding v9: StdGroupFilter installed, 8% of responses still cut: the Dual-Level filter
    fires; without the filter installed, or with few cut, it does not."""
    skill = LIBRARY["dual-level-filter"]
    recipe = deep_merge(paper_recipe("paper-code"), {"group_filter": {
        "name": "std_group_filter", "params": {}}})
    diagnosis = {"metrics": {"dead_group_ratio": {"value": 0.24}, "truncation_rate":
                             {"value": 0.08}, "echo_trap_ratio": {"value": 0.0}},
                 "alerts": []}
    names = [m.skill.name for m in match(LIBRARY, diagnosis, domain="code", recipe=recipe,
                                         patch_base=recipe)]
    assert "dual-level-filter" in names
    assert "zero-std-filter" not in names  # a filter is installed: it would only lose ground
    assert resolve_skill(skill, recipe).overrides["group_filter"]["name"] == "dual_level"
    bare = paper_recipe("paper-code")
    assert "dual-level-filter" not in [m.skill.name for m in match(
        LIBRARY, diagnosis, domain="code", recipe=bare, patch_base=bare)]
    few = {**diagnosis, "metrics": {**diagnosis["metrics"], "truncation_rate": {"value": 0.03}}}
    assert "dual-level-filter" not in [m.skill.name for m in match(
        LIBRARY, few, domain="code", recipe=recipe, patch_base=recipe)]
    # Once installed, StdGroupFilter no longer fires either (it is level 2).
    dual = deep_merge(recipe, resolve_skill(skill, recipe).overrides)
    assert "std-group-filter" not in [m.skill.name for m in match(
        LIBRARY, diagnosis, domain="code", recipe=dual, patch_base=dual)]


def test_dual_level_drops_truncated_code_before_the_group_test():
    # A group whose spread comes only from a truncated member: level 1 takes it out, and
    # the group is then dead; StdGroupFilter alone keeps it.
    rows = [dict(task_id="g", sample_idx=i, reward=r, correct=r, truncated=t, turns=1)
            for i, (r, t) in enumerate([(0.0, True), (1.0, False), (1.0, False),
                                        (1.0, False)])]
    rows += [dict(task_id="h", sample_idx=i, reward=float(i % 2), correct=float(i % 2),
                  truncated=False, turns=1) for i in range(4)]
    table = rollout_table(rows)
    std = backtest_filter(table, "std_group_filter", {})
    dual = backtest_filter(table, "dual_level", {})
    assert std["kept_groups"] == 2 and dual["kept_groups"] == 1


def test_single_turn_code_on_verl_gets_level_one(tmp_path):
    config = tmp_path / "reward.json"
    config.write_text(json.dumps({
        "domain": {"name": "code", "params": {}},
        "reward": {"components": [{"name": "correctness", "weight": 1.0}]},
        "group_filter": {"name": "dual_level", "params": {}}}))
    task = make_domain({"name": "code"}).task_at(0)
    info = {"task_id": task.task_id, "meta": json.dumps(task.meta), "index": 0,
            "split": "train"}
    cut = "```python\na, b = map(int, input().split())\nprint(a +"
    marked = compute_score(task.data_source, cut, task.answer, info, config_path=str(config))
    assert (marked["evo_excluded"], marked["evo_exclusion"]) == (1.0, "truncated")
    whole = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    kept = compute_score(task.data_source, whole, task.answer, info, config_path=str(config))
    assert kept["evo_excluded"] == 0.0


def test_std_group_filter_evidence_credits_v10_to_the_dual_level_filter():
    std = [e["version"] for e in LIBRARY["std-group-filter"].evidence]
    assert "code-4b/v10" not in std and "code-4b/v9" in std
    assert [e["version"] for e in LIBRARY["dual-level-filter"].evidence] == ["code-4b/v10"]


# ---- 3. the IF-judge rescue ------------------------------------------------------------


def judged_groups() -> pa.Table:
    """The paper's v4 backtest: 40 groups of 8, 20 CR-dead, 9 of those with IF verdicts
    that differ (the judge rescues them)."""
    rows = []
    for g in range(40):
        for i in range(8):
            if g < 4:
                c, judge = 1.0, 1.0
            elif g < 11:
                c, judge = 0.0, 1.0
            elif g < 20:
                c, judge = 0.0, float(i % 3 != 1)
            else:
                c, judge = float(i % 2 == 0), 1.0
            rows.append(dict(task_id=f"g{g}", sample_idx=i, reward=c, correct=c,
                             reward_components=[("correctness", c), ("judge:if", judge)]))
    return rollout_table(rows)


def test_the_if_judge_skill_adds_the_recipes_judge_where_one_is_declared():
    recipe = deep_merge(paper_recipe("paper-swe"), {"reward": {"judges": [
        {"name": "if", "preset": "instruction_following", "endpoint": "http://127.0.0.1:9/v1",
         "model": "judge"}]}})
    diagnosis = {"metrics": {"dead_group_ratio": {"value": 0.5}}, "alerts": []}
    names = [m.skill.name for m in match(LIBRARY, diagnosis, domain="swe", recipe=recipe,
                                         patch_base=recipe)]
    assert "instruction-following-judge" in names and "aux-continuous-reward" not in names
    overrides = resolve_skill(LIBRARY["instruction-following-judge"], recipe).overrides
    assert {"name": "judge:if", "weight": 0.1} in overrides["reward"]["components"]
    component, weight = skill_reward(LIBRARY["instruction-following-judge"], "swe")
    report = backtest_reward(judged_groups(), component, weight, "swe")
    assert (report["groups"], report["dead_groups_before"], report["rescued_groups"]) == (
        40, 20, 9)
    assert report["rescue_ratio"] == pytest.approx(0.45)


def test_without_a_judge_the_aux_reward_adds_partial():
    recipe = paper_recipe("paper-swe")
    diagnosis = {"metrics": {"dead_group_ratio": {"value": 0.55}}, "alerts": []}
    names = [m.skill.name for m in match(LIBRARY, diagnosis, domain="swe", recipe=recipe,
                                         patch_base=recipe)]
    assert "aux-continuous-reward" in names and "instruction-following-judge" not in names


# ---- 4. StdGroupFilter's trigger, ADiv and the bundling rule ---------------------------


def dead_share(dead: int, groups: int = 100) -> pa.Table:
    rows = []
    for g in range(groups):
        rewards = [1.0] * 4 if g < dead else [1.0, 0.0, 1.0, 0.0]
        rows += [dict(task_id=f"g{g}", sample_idx=i, reward=r, correct=r)
                 for i, r in enumerate(rewards)]
    return rollout_table(rows)


@pytest.mark.parametrize(("dead", "fires"), [(21, True), (31, True), (13, False)])
def test_std_group_filter_fires_at_the_math_transfer(dead, fires):
    # Math: StdGroupFilter transferred at DGR about 0.21 and took it to 0.13; Coding at 0.31.
    recipe = paper_recipe("paper-math")
    diagnosis = diagnose(dead_share(dead), None, resolve_harness("h2"))
    assert diagnosis["metrics"]["dead_group_ratio"] == pytest.approx(dead / 100)
    assert diagnosis["metrics"]["reward_spread"] > 0.05  # no weak-signal alert to lean on
    names = [m.skill.name for m in match(LIBRARY, diagnosis, domain="math", recipe=recipe,
                                         patch_base=recipe)]
    assert ("std-group-filter" in names) is fires


def adiv(table: pa.Table) -> float:
    """The catalogue's advantage_diversity over `table`, in a revision of its own."""
    [entry] = [e for e in catalogue() if e.metric["name"] == "advantage_diversity"]
    doc = {"apiVersion": "evotrainer/v1", "kind": "HarnessRevision", "name": "adiv",
           "metrics": [entry.metric]}
    return diagnose(table, None, parse_harness(doc))["metrics"]["advantage_diversity"]


def test_adiv_is_advantage_diversity_on_the_coding_v10_case():
    """Coding v10: DGR 0.18, ADiv 0.63 over groups of 4 under the shaped CR: 18 dead groups,
    30 with four distinct advantages, 47 with three, 5 with two."""
    layouts = ([[1.0] * 4] * 18 + [[1.0, 0.6, 0.8, 0.7]] * 30 + [[1.0, 0.6, 0.8, 0.8]] * 47
               + [[1.0, 0.0, 1.0, 0.0]] * 5)
    rows = [dict(task_id=f"g{g}", sample_idx=i, reward=r, correct=float(r == 1.0))
            for g, rewards in enumerate(layouts) for i, r in enumerate(rewards)]
    table = rollout_table(rows)
    assert diagnose(table, None, resolve_harness("h2"))["metrics"][
        "dead_group_ratio"] == pytest.approx(0.18)
    assert adiv(table) == pytest.approx(0.63)
    # Answers do not enter it: the same rewards with every response distinct read the same.
    distinct = rollout_table([{**r, "response": f"answer {n}"} for n, r in enumerate(rows)])
    assert adiv(distinct) == pytest.approx(0.63)


def test_one_adiv_definition():
    adivs = [e.metric["name"] for e in catalogue() if "ADiv" in e.metric["description"]
             and not e.metric["description"].startswith("Answer diversity (not")]
    assert adivs == ["advantage_diversity"]
    [entry] = [e for e in catalogue() if e.metric["name"] == "advantage_diversity"]
    assert entry.metric["layer"] == "signal"


@pytest.mark.usefixtures("standin")
def test_a_bundle_whose_interaction_is_tested_passes_the_policy(workspace):
    train(workspace, "v1", standin_skill=0.65)
    converge(workspace)
    bundle = Proposal("v1", "both", skills=["temperature-raise", "zero-std-filter"],
                      hypothesis="If both, then more.", criterion="delta >= 0.0",
                      proposal={"planner": "anthropic", "tokens": 0, "move": BUNDLE})
    refusal = policy_violation(View.load(workspace), bundle)
    assert refusal and "would test the interaction" in refusal
    # Each half also runs alone from v1: the bundle against each half tests the interaction.
    new_version(workspace, "v2", "v1", rationale="half", skills=["temperature-raise"])
    assert "zero-std-filter" in policy_violation(View.load(workspace), bundle)
    new_version(workspace, "v3", "v1", rationale="half", skills=["zero-std-filter"])
    assert policy_violation(View.load(workspace), bundle) is None
    # A half alone from another parent tests nothing about this bundle.
    elsewhere = Proposal("v0", "both", skills=bundle.skills, hypothesis="If both, then more.",
                         criterion="delta >= 0.0", proposal=bundle.proposal)
    assert policy_violation(View.load(workspace), elsewhere) is not None

