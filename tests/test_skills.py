"""The skill library: built-in skills are valid and sound, triggers match a diagnosis safely,
search ranks by relevance, and gate outcomes become evidence in the workspace's git history."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from sealing import controller_commit

from evotrainer.backends import get_backend
from evotrainer.contract.filters import check_filter_spec
from evotrainer.control.scaffold import EXAMPLES_DIR
from evotrainer.control.versions import new_version
from evotrainer.diagnosis.catalogue import catalogue
from evotrainer.domains import get_domain
from evotrainer.errors import EvoError
from evotrainer.skills.library import record_evidence
from evotrainer.skills.skill import (
    fires,
    load_library,
    match,
    refusals,
    resolve_skill,
    search,
    trigger_variables,
)
from evotrainer.store import cel, specs
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.recipe import BASE_RECIPE, deep_merge

# The built-in harness h0's contract: what triggers may read.
METRICS = {"avg_at_k", "reward_mean", "dead_group_ratio", "all_correct_group_ratio",
           "all_wrong_group_ratio", "reward_spread", "truncation_rate", "turns_mean", "turns_p90",
           "echo_trap_ratio", "tool_calls_mean", "max_same_tool_streak_mean", "leak_ratio",
           "length_reward_corr", "mean_logprob"}
ALERTS = {"dead_groups", "weak_signal", "truncation", "echo_trap", "abandonment", "leak",
          "overconfidence", "length_gaming"}
# ... and what the metric catalogue adds through the revisions the planner proposes from it
# (a skill answering a pathology h0 cannot see reads the catalogue alert that sees it).
METRICS |= {entry.metric["name"] for entry in catalogue()}
ALERTS |= {entry.alert["name"] for entry in catalogue() if entry.alert}
KEYED = {entry.metric["name"] for entry in catalogue() if entry.metric.get("keyed")}
# A value for each variable a built-in skill binds when its trigger fires.
SAMPLE_BINDINGS = {"component": "efficiency"}
GATE_NAMES = {"delta", "ci_low", "ci_high", "p_value", "parent"}
EMBEDDED = {"arith", "toolenv"}

LIBRARY = load_library()


def diagnosis(alerts: tuple[str, ...] = (), **metrics: float | None) -> dict:
    return {"metrics": {name: {"value": value, "layer": "signal", "trend": None}
                        for name, value in metrics.items()},
            "alerts": [{"name": a, "severity": "warning"} for a in alerts]}


def test_builtin_library_is_seeded_from_the_method() -> None:
    expected = {"std-group-filter", "zero-std-filter", "aux-continuous-reward",
                "shaped-correctness", "raise-length-budget", "clip-higher", "kl-cap",
                "temperature-raise", "max-turns-cap", "close-leak", "group-whitening-only"}
    harmful = {"efficiency-multiplier", "data-downsizing", "iterative-debugging-reward",
               "f2p-progress-reward"}
    assert expected | harmful <= set(LIBRARY)
    assert {n for n, s in LIBRARY.items() if s.negative} >= harmful
    assert not any(LIBRARY[n].negative for n in expected)
    for skill in LIBRARY.values():
        # Every negative skill says why; every paper entry names its source.
        if skill.negative:
            assert skill.negative_evidence, skill.name
        for entry in skill.evidence + skill.negative_evidence:
            assert entry["source"].startswith("paper"), (skill.name, entry)
    rescue = LIBRARY["instruction-following-judge"].evidence[0]  # the paper's IF judge
    assert rescue["version"] == "swe-9b/v8" and rescue["delta"] == pytest.approx(0.0186)


def test_builtin_files_are_in_the_form_evidence_updates_write() -> None:
    # So the first evidence commit on a skill diffs only the new entry.
    for path in sorted(builtin_dir("skills").glob("*.yaml")):
        text = path.read_text()
        data = yaml.safe_load(text)
        assert text == "# yaml-language-server: $schema=../spec/schemas/skill.schema.json\n" \
            + specs.dump(data), path.name


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_recipe_patch_merges_into_a_valid_recipe(name: str) -> None:
    skill = LIBRARY[name]
    if skill.bind:  # what a trigger binds: a component every embedded domain scores
        skill = skill.bound({var: SAMPLE_BINDINGS[var] for var in skill.bind})
    resolution = resolve_skill(skill, BASE_RECIPE)
    recipe = deep_merge(BASE_RECIPE, resolution.overrides)
    doc = specs.Document({"apiVersion": "evotrainer/v1", "kind": "PolicyVersion", "name": "v1",
                          "parent": "v0", "recipe": resolution.overrides},
                         f"skills/{name}.yaml", {})
    assert specs.check(doc, "PolicyVersion") == []
    assert skill.recipe_patch or skill.entry_point, "a skill needs a mechanism"
    if skill.negative:
        return  # toxic mechanisms describe what was tried, not what the engine offers
    check_filter_spec(recipe["group_filter"])
    entry = skill.entry_point
    if entry and entry["kind"] == "group_filter":
        check_filter_spec({"name": entry["name"], "params": entry.get("params") or {}})
    for domain_name in EMBEDDED & set(skill.domains):
        domain = get_domain(domain_name)
        for component in recipe["reward"]["components"]:
            assert component["name"] in domain.components, (name, domain_name)
        if entry and entry["kind"] == "reward_component":
            assert entry["name"] in domain.components
        for tool in (skill.recipe_patch.get("environment") or {}).get("tools", []):
            assert tool["name"] in domain.tools, (name, domain_name)


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_triggers_and_criteria_read_only_known_names(name: str) -> None:
    skill = LIBRARY[name]
    assert skill.trigger
    assert cel.names(skill.trigger) <= METRICS | {"alerts", "trend", "recipe", "keyed"}
    for keyed in re.findall(r"\bkeyed\.(\w+)", skill.trigger):
        assert keyed in KEYED, (name, keyed)
    # A recipe setting a trigger reads exists in every resolved recipe (a typo never fires).
    for path in re.findall(r"\brecipe((?:\.\w+)+)", skill.trigger):
        if path.startswith(".reward.judges"):  # optional (a recipe with a judge): behind has()
            assert "has(recipe.reward.judges)" in skill.trigger, name
            continue
        entry = BASE_RECIPE
        for key in path.lstrip(".").split("."):
            assert isinstance(entry, dict) and key in entry, (name, path)
            entry = entry[key]
    assert set(re.findall(r'"([^"]*)" in alerts', skill.trigger)) <= ALERTS, "unknown alert"
    if skill.data.get("criterion"):
        assert cel.names(skill.data["criterion"]) <= METRICS | GATE_NAMES


def test_null_or_absent_metrics_never_fire_and_never_crash() -> None:
    all_null = diagnosis(**dict.fromkeys(METRICS))
    for diag in (all_null, {"metrics": {}, "alerts": []}):
        assert match(LIBRARY, diag) == []
        assert refusals(LIBRARY, diag) == []


def test_each_positive_skill_fires_on_its_symptom() -> None:
    healthy = {"dead_group_ratio": 0.1, "all_correct_group_ratio": 0.05,
               "all_wrong_group_ratio": 0.05, "reward_spread": 0.3, "truncation_rate": 0.0,
               "echo_trap_ratio": 0.0, "max_same_tool_streak_mean": 1.0, "leak_ratio": 0.0,
               "length_reward_corr": 0.0, "mean_logprob": -0.5}
    assert match(LIBRARY, diagnosis(**healthy)) == []
    symptoms = {
        "std-group-filter": {"dead_group_ratio": 0.4},
        "aux-continuous-reward": {"dead_group_ratio": 0.6},
        "shaped-correctness": {"dead_group_ratio": 0.4, "all_wrong_group_ratio": 0.3},
        "raise-length-budget": {"truncation_rate": 0.3},
        "clip-higher": {"length_reward_corr": 0.5},
        "kl-cap": {"mean_logprob": -0.01},
        "temperature-raise": {"mean_logprob": -0.08},
        "max-turns-cap": {"echo_trap_ratio": 0.2},
        "close-leak": {"leak_ratio": 0.1},
        "group-whitening-only": {"reward_spread": 0.01},
    }
    for skill, metrics in symptoms.items():
        names = [m.skill.name for m in match(LIBRARY, diagnosis(**{**healthy, **metrics}))]
        assert skill in names, (skill, names)


def test_fires_treats_null_like_the_gate_and_reports_broken_triggers() -> None:
    variables = trigger_variables(diagnosis(("leak",), leak_ratio=None))
    assert variables["leak_ratio"] is None and variables["alerts"] == ["leak"]
    assert fires('leak_ratio > 0.0 || "leak" in alerts', variables)  # the non-null branch
    assert not fires("leak_ratio > 0.0", variables)
    assert not fires("unknown_metric > 1.0", variables)
    assert not fires("trend.leak_ratio > 0.0", variables)  # no trend recorded
    with pytest.raises(EvoError, match="failed"):
        fires("2 * reward_spread > 1.0", {"reward_spread": 0.3}, where="skills/x.yaml")


def test_match_ranks_by_evidence_and_never_proposes_harmful_skills() -> None:
    dead = diagnosis(("dead_groups",), dead_group_ratio=0.62, all_wrong_group_ratio=0.5,
                     all_correct_group_ratio=0.1, echo_trap_ratio=0.3, reward_spread=0.02)
    found = match(LIBRARY, dead, domain="toolenv", recipe=BASE_RECIPE)
    names = [m.skill.name for m in found]
    assert names[0] == "std-group-filter"  # four positive entries
    assert {"zero-std-filter", "aux-continuous-reward", "max-turns-cap"} <= set(names)
    assert not any(LIBRARY[n].negative for n in names)
    # What the trigger read: the diagnosis, and the recipe's filter it stands aside for.
    assert {k: found[0].values[k] for k in ("alerts", "dead_group_ratio")} == {
        "alerts": ["dead_groups"], "dead_group_ratio": 0.62}
    # group-only whitening is already the base recipe, and the base recipe has no turn budget
    # for max-turns-cap to lower: listed, with the reason, but after every skill that moves it.
    whitening = next(m for m in found if m.skill.name == "group-whitening-only")
    assert whitening.applied and whitening.no_change == "grpo.normalize_std is already true"
    no_ops = [m.skill.name for m in found if m.applied]
    assert set(no_ops) == {"group-whitening-only", "max-turns-cap"}
    assert [m.skill.name for m in found[-len(no_ops):]] == no_ops
    refused = [m.skill.name for m in refusals(LIBRARY, dead, domain="toolenv")]
    assert "efficiency-multiplier" in refused and "data-downsizing" not in refused
    # Domain applicability: the toolenv leak fix is not offered on arith.
    leaky = diagnosis(("leak",), leak_ratio=0.2)
    assert "close-leak" in [m.skill.name for m in match(LIBRARY, leaky, domain="toolenv")]
    assert "close-leak" not in [m.skill.name for m in match(LIBRARY, leaky, domain="arith")]


def test_in_domain_evidence_ranks_first() -> None:
    dead = diagnosis(dead_group_ratio=0.4)
    in_domain = [m.in_domain for m in match(LIBRARY, dead, domain="swe")]
    assert in_domain == sorted(in_domain, reverse=True) and in_domain[0] == 2  # zero-std
    library = {name: LIBRARY[name] for name in ("std-group-filter", "zero-std-filter")}
    zero = library["zero-std-filter"]
    library["zero-std-filter"] = type(zero)({**zero.data, "evidence": [
        *zero.evidence, {"version": "v3", "domain": "arith", "delta": 0.01}]}, zero.source)
    assert match(library, dead, domain="arith")[0].skill.name == "zero-std-filter"


def test_search_ranks_by_relevance() -> None:
    assert search(LIBRARY, "leak")[0][0].name == "close-leak"
    assert search(LIBRARY, "echo trap turns")[0][0].name == "max-turns-cap"
    top = [s.name for s, _ in search(LIBRARY, "dead groups")[:5]]  # the dead-group rescues
    assert {"std-group-filter", "zero-std-filter", "aux-continuous-reward",
            "instruction-following-judge", "shaped-correctness"} == set(top)
    scores = [score for _, score in search(LIBRARY, "temperature")]
    assert scores == sorted(scores, reverse=True)
    assert search(LIBRARY, "") == [] and search(LIBRARY, "zzzz") == []


# ----------------------------------------------------------------------- workspace evidence


def decision(verdict: str, delta: float = 0.05) -> dict:
    return {"apiVersion": "evotrainer/v1", "kind": "Decision", "version": "v1",
            "verdict": verdict, "harness": {"name": "h0", "digest": "sha256:x"},
            "comparison": {"delta": delta, "ci_low": delta - 0.02, "ci_high": delta + 0.02}}


def skill_on_main(ws, name: str) -> dict:
    return yaml.safe_load(ws.git.read("main", f"skills/{name}.yaml"))


def test_record_evidence_appends_commits_and_is_idempotent(workspace) -> None:
    new_version(workspace, "v1", "v0", rationale="dead groups",
                skills=["std-group-filter", "zero-std-filter"])
    before = skill_on_main(workspace, "std-group-filter")

    changed = record_evidence(workspace, "v1", decision("promote"))
    assert changed == ["std-group-filter", "zero-std-filter"]
    after = skill_on_main(workspace, "std-group-filter")
    assert after["evidence"][:-1] == before["evidence"]
    assert after["evidence"][-1] == {"version": "v1", "domain": "arith", "delta": 0.05,
                                     "ci": [pytest.approx(0.03), pytest.approx(0.07)],
                                     "verdict": "promote", "source": "gate (h0)"}
    head = workspace.git.repo.commit("main")
    assert "Evotrainer-Action: evidence" in head.message
    assert "Evotrainer-Version: v1" in head.message
    raw = workspace.git.read("main", "skills/std-group-filter.yaml").decode()
    assert raw.startswith("# yaml-language-server:")
    specs.load_text(raw, "skills/std-group-filter.yaml", "Skill")

    assert record_evidence(workspace, "v1", decision("promote")) == []
    assert workspace.git.repo.commit("main") == head  # no second commit

    # Re-gated (e.g. a new harness revision): the entry moves, it is not duplicated.
    assert record_evidence(workspace, "v1", decision("prune", -0.04)) == [
        "std-group-filter", "zero-std-filter"]
    moved = skill_on_main(workspace, "std-group-filter")
    assert moved["evidence"] == before["evidence"]
    assert [e["version"] for e in moved["negative_evidence"]] == ["v1"]
    assert record_evidence(workspace, "v1", decision("inconclusive")) == []


def test_record_evidence_ignores_versions_without_skills(workspace) -> None:
    new_version(workspace, "v1", "v0", rationale="a plain change", settings=["grpo.lr=3e-4"])
    assert record_evidence(workspace, "v1", decision("promote")) == []


# ------------------------------------------------------------------------------------- CLI




def test_cli_list_show_search(cli, tmp_path) -> None:
    listed = cli("skills", "list", "--json", cwd=tmp_path)  # not a workspace: built-in
    assert listed.exit_code == 0, listed.output
    assert {row["name"] for row in json.loads(listed.output)} == set(LIBRARY)
    table = cli("skills", "list", "--category", "filter")
    assert "std-group-filter" in table.output and "clip-higher" not in table.output
    assert "known to hurt" in table.output  # data-downsizing is a filter skill
    shown = cli("skills", "show", "kl-cap")
    assert yaml.safe_load(shown.output)["mechanism"]["recipe_patch"]["grpo"]["kl_coef"] == {
        "direction": "raise", "min": 0.002}
    assert json.loads(cli("skills", "show", "kl-cap", "--json").output)["name"] == "kl-cap"
    missing = cli("skills", "show", "nope")
    assert missing.code == 1 and "unknown skill" in missing.err
    found = json.loads(cli("skills", "search", "leak", "--json").output)
    assert found[0]["name"] == "close-leak" and found[0]["score"] > 0
    assert "close-leak" in cli("skills", "search", "leak").output
    assert "no skill mentions" in cli("skills", "search", "zzzz").output


def test_cli_match_reads_the_version_diagnosis(workspace, cli) -> None:
    new_version(workspace, "v1", "v0", rationale="first try")
    diag = {"apiVersion": "evotrainer/v1", "kind": "Diagnosis", "version": "v1",
            "harness": {"name": "h0", "digest": "sha256:x"},
            **diagnosis(("dead_groups",), dead_group_ratio=0.6, echo_trap_ratio=0.3)}
    controller_commit(workspace, "v1", {"runs/v1/diagnosis.yaml": specs.dump(diag).encode()},
                      "diagnose v1")
    out = cli("skills", "match", "v1", "--json", cwd=workspace.root)
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    names = [m["name"] for m in result["matches"]]
    assert names[0] == "std-group-filter" and "max-turns-cap" not in names  # arith: no turns
    assert "efficiency-multiplier" in [m["name"] for m in result["refused"]]
    table = cli("skills", "match", "v1")
    assert "std-group-filter" in table.output and "refused" in table.output
    undiagnosed = cli("skills", "match", "v0")
    assert undiagnosed.code == 1 and "no diagnosis" in undiagnosed.err


def test_each_domain_gets_its_own_patch_and_every_swe_patch_is_a_valid_swe_recipe() -> None:
    close_leak = LIBRARY["close-leak"]
    assert close_leak.patch_for("swe") == {"domain": {"params": {"clear_git_log": True}}}
    assert close_leak.patch_for("toolenv") == close_leak.recipe_patch
    assert close_leak.patch_for(None) == close_leak.recipe_patch
    example = yaml.safe_load((EXAMPLES_DIR / "swe.yaml").read_text())["recipe"]
    swe_recipe = deep_merge(BASE_RECIPE, example)
    for skill in LIBRARY.values():
        if skill.negative or not skill.applies_to("swe") or not skill.domains:
            continue
        recipe = deep_merge(swe_recipe, resolve_skill(skill, swe_recipe).overrides)
        get_backend("local").check(recipe)  # raises EvoError naming the bad field
        tools = (recipe.get("environment") or {}).get("tools") or []
        assert {t["name"] for t in tools} <= set(get_domain("swe").tools), skill.name
