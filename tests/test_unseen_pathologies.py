"""The autonomy gym's unseen pathologies (bench/autonomy.py `idle`, `echo_h0`) on planted
stand-in runs: h0 raises no alert and no library skill fires on its diagnosis, while the
catalogue metric a harness revision would add alerts on them — and not on the same run
without the pathology — and a library skill reads that alert (for idle, the reward audit names
the `efficiency` term and the generic skill binds it). Beside them, the idle setup's
`efficiency` reward term."""

from __future__ import annotations

from pathlib import Path

import pytest
from standin import no_std_group_filter, standin_settings
from standin_planted import PlantedBackend, converge

from evotrainer.agent.planners.revisions import _with_metric
from evotrainer.backends import BACKEND_TYPES
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import approve, new_version
from evotrainer.diagnosis.catalogue import catalogue
from evotrainer.diagnosis.diagnose import diagnose, diagnosis_document
from evotrainer.diagnosis.harness import parse_harness, resolve_harness
from evotrainer.skills.library import workspace_library
from evotrainer.skills.replay import version_rollouts
from evotrainer.skills.skill import match
from evotrainer.store.specs import load_yaml
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")

# setup → (planted params, extra settings, the catalogue metric that sees it, its alert, the
# library skill whose trigger reads that alert)
# The idle setup's reward (bench/autonomy.py): correctness, partial credit and the efficiency
# term that pays an answer alone; the audit's alert names that term as the cause.
IDLE_REWARD = ('reward.components=[{"name": "correctness", "weight": 1.0}, '
               '{"name": "partial", "weight": 0.5}, {"name": "efficiency", "weight": 0.5}]')
CASES = {
    "idle": ({"planted_idle": 0.4}, [IDLE_REWARD], "reward_alignment", "misaligned_reward",
             "lower-misaligned-reward"),
    # A quarter of the rollouts loop for 12 calls: h0's same-tool streak (max-turns-cap fires
    # on a mean over 4.0) is 0.25 × 12 + 0.75 × 1 = 3.75. At 40% looping it is 5.4 and h0
    # sees the loops through that streak: this setup is unseen only while loops are rarer.
    "echo_h0": ({"planted_loop": 0.25}, ["environment.max_turns=24"], "tool_limit_ratio",
                "turn_budget", "repeat-penalty-at-turn-limit"),
}
SHARE = {"echo_h0": 0.25}  # the share of looping rollouts planted


def planted_run(tmp_path, monkeypatch, params: dict, settings: list[str]) -> Workspace:
    monkeypatch.setitem(BACKEND_TYPES, "local", PlantedBackend)
    ws = Workspace(init_workspace(tmp_path, "toolenv"))
    # No leak (the stand-in's calls are compares) and a policy half right on the rest.
    new_version(ws, "v1", "v0", rationale="planted",
                settings=standin_settings(standin_skill=0.6, **params) + settings)
    approve(ws, "v1", by="tester")
    converge(ws)
    return ws


def diagnosis_with(ws: Workspace, harness) -> dict:
    rollouts = version_rollouts(ws, "v1").parent
    return diagnosis_document(diagnose(rollouts, None, harness), "v1")


def with_catalogue_metric(ws: Workspace, metric: str):
    """h0 plus one catalogue metric and its alert, as the rules planner writes a revision."""
    [entry] = [e for e in catalogue() if e.metric["name"] == metric]
    source = resolve_harness("h0", ws.root).source
    h0 = load_yaml(Path(source).read_bytes(), source)
    return parse_harness(_with_metric(h0, entry, "h0-plus", ws.resolved_recipe("v1")))


def fired(ws: Workspace, diagnosis: dict) -> list[str]:
    recipe = ws.resolved_recipe("v1")
    return [m.skill.name for m in match(workspace_library(ws), diagnosis, domain="toolenv",
                                        recipe=recipe, patch_base=recipe)]


@pytest.mark.parametrize("setup", sorted(CASES))
def test_h0_cannot_see_it_and_the_catalogue_metric_can(setup, tmp_path, monkeypatch):
    params, settings, metric, alert, skill = CASES[setup]
    ws = planted_run(tmp_path / "planted", monkeypatch, params, settings)
    no_std_group_filter(ws)  # what h0 cannot see here is the planted pathology
    h0 = ws.version("v1").records["diagnosis"]  # reconcile's, with h0
    assert h0["harness"]["name"] == "h0"
    assert h0["alerts"] == []
    assert fired(ws, h0) == []

    seen = diagnosis_with(ws, with_catalogue_metric(ws, metric))
    value = seen["metrics"][metric]["value"]
    if setup == "idle":
        # The audit's lowest correlation with correctness is the efficiency term's, negative:
        # an answer alone earns it whole; partial credit pays what correctness pays.
        assert seen["keyed"][metric] == {"partial": pytest.approx(1.0), "efficiency": value}
        assert value < 0
    else:
        assert value == pytest.approx(SHARE[setup], abs=0.06)
    assert [a["name"] for a in seen["alerts"]] == [alert]
    assert skill in fired(ws, seen)

    clean = planted_run(tmp_path / "clean", monkeypatch, {k: 0.0 for k in params}, settings)
    unseen = diagnosis_with(clean, with_catalogue_metric(clean, metric))
    if setup == "idle":
        # Every clean episode searches alike, so the term has no spread to correlate.
        assert unseen["keyed"][metric]["efficiency"] is None
    else:
        assert unseen["metrics"][metric]["value"] == 0.0
    assert unseen["alerts"] == []


def test_idle_demonstrations_are_planted_only_when_asked():
    import random

    from evotrainer.domains.toolenv import ToolEnvDomain

    def demos(params: dict) -> list:
        domain = ToolEnvDomain(params)
        domain.validate_params()
        return [domain.demonstration(domain.task_at(i), random.Random(i)) for i in range(400)]

    # Absent and 0 draw nothing more: the warm start's demonstrations are today's.
    assert demos({}) == demos({"idle_demo_rate": 0.0})
    assert all(len(d) > 1 for d in demos({}))
    planted = demos({"idle_demo_rate": 0.4})
    idle = [d for d in planted if len(d) == 1]
    assert 0.33 < len(idle) / len(planted) < 0.47
    # An idle demonstration answers at once, a guess inside the task's range: no action.
    assert all(text.startswith("=") and text.endswith(";") and acts for [(text, acts)] in idle)


def test_efficiency_pays_an_answer_alone_most():
    from evotrainer.domains.toolenv import ToolEnvDomain

    domain = ToolEnvDomain({})
    domain.validate_params()
    task = domain.task_at(0)

    def efficiency(response: str) -> float:
        return domain.score(task, response, []).components["efficiency"]

    # 1 / actions: an answer alone earns it all, a search pays for each step, nothing earns 0.
    assert efficiency("=3;") == 1.0
    assert efficiency("?8;<;?4;<;=3;") == pytest.approx(1 / 3)
    assert efficiency("") == 0.0
    # The components the recipe weights are scored as before.
    assert domain.score(task, "?8;<;?4;<;=3;", []).components["no_repeat"] == 1.0
