"""Budgets that bind: `autonomy.max_gpu_hours` is accounted from the run
records (GPUs the job asked for × the hours it held them, every attempt counted) and a job
that asks for GPUs is not launched once it is spent; the plan says which budget and how
much is spent. Real: the workspace, reconcile and its jobs (the stand-in engine as a real
subprocess, tests/standin.py); the job runs under the `verl` backend's name, so the GPUs
are the ones its rendered config would ask for."""

from __future__ import annotations

import json

import pytest
import yaml
from standin import StandinBackend, propose, standin_settings

from evotrainer.backends.local import LocalBackend
from evotrainer.backends.verl import VerlBackend
from evotrainer.control.observe import recipe_steps, within_budget
from evotrainer.control.reconcile import Reconciler, load_context, plan
from evotrainer.control.versions import approve, new_version
from evotrainer.errors import EvoError
from evotrainer.report.views import collect
from evotrainer.store.recipe import deep_merge
from evotrainer.store.records import RunRecord, ended_run
from evotrainer.store.workspace import PROJECT_FILE, Workspace

pytestmark = pytest.mark.usefixtures("standin")


class StandinOnGpus(StandinBackend):
    """The stand-in engine's job under the `verl` backend's name, asking for the GPUs a verl
    job of the same recipe asks for."""

    name = "verl"
    resources = VerlBackend.resources


@pytest.fixture(autouse=True)
def standin_under_verls_name(monkeypatch):
    """A job of the `verl` backend is the stand-in engine's (checks included)."""
    from evotrainer.backends import BACKEND_TYPES

    monkeypatch.setitem(BACKEND_TYPES, "verl", StandinOnGpus)


def set_project(ws: Workspace, recipe: dict | None = None, **autonomy) -> Workspace:
    """The project with `recipe` merged into its recipe and `autonomy` set, v0 approved
    again (its approval binds the recipe it resolves to)."""
    path = ws.root / PROJECT_FILE
    data = yaml.safe_load(path.read_text())
    data["recipe"] = deep_merge(data["recipe"], recipe or {})
    data["autonomy"] = {**(data.get("autonomy") or {}), **autonomy}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    fresh = Workspace(ws.root)
    approve(fresh, "v0", by="tester")
    return fresh


def gpu_project(ws: Workspace, budget: float, **recipe) -> Workspace:
    """Jobs under the verl backend's name asking for 2 GPUs on one node."""
    verl = {"backend": "verl", "verl": {"n_gpus_per_node": 2}}
    return set_project(ws, deep_merge(verl, recipe), max_gpu_hours=budget)


def verl_reconciler(ws: Workspace) -> Reconciler:
    return Reconciler(ws, log=lambda _: None)


def launched(ws: Workspace) -> list[str]:
    return sorted(p.parent.parent.name for p in ws.artifact_root.glob("*/evo-*/job.json"))


def plans_by_name(ws: Workspace) -> dict:
    ctx = load_context(ws)
    return {p.version: p for p in plan(ctx)}


def test_a_spent_gpu_budget_refuses_the_launch_and_says_so(workspace):
    ws = gpu_project(workspace, budget=0)
    v0 = plans_by_name(ws)["v0"]
    assert v0.action is None
    assert "autonomy.max_gpu_hours (0) is spent" in v0.as_dict()["reason"]
    assert "asks for 2 GPU(s)" in v0.as_dict()["reason"]

    plans = verl_reconciler(ws).run()
    assert launched(ws) == [] and ws.version("v0").run is None
    assert "max_gpu_hours" in {p.version: p for p in plans}["v0"].note

    # Raised, the same version launches.
    ws = set_project(ws, max_gpu_hours=10)
    verl_reconciler(ws).run(wait=True, poll_s=0.05)
    run = ws.version("v0").run
    assert run.succeeded and run.resources == {"nodes": 1, "gpus_per_node": 2, "gpus": 2}
    assert launched(ws) == ["v0"]


def gpu_version(ws: Workspace, name: str, **params) -> None:
    """A version of 4 steps whose own recipe moves it to the verl backend's name, on 2 GPUs."""
    new_version(ws, name, "v0", rationale="test", settings=[
        *standin_settings(**params), "backend=verl", "verl.n_gpus_per_node=2", "grpo.steps=4"])
    approve(ws, name, by="tester")


def test_the_gpu_hours_of_the_runs_so_far_spend_the_budget(workspace, cli):
    """Within a budget of 1e-4 GPU-hours: v0 is a CPU job (no GPU-hour); v1 launches (none
    spent yet) and trains 4 steps of 0.5 s, at least one recorded second on 2 GPUs, which
    spends the budget; v2, waiting for the one job slot meanwhile, is then refused, and
    the plan says why."""
    ws = set_project(workspace, max_gpu_hours=1e-4)
    gpu_version(ws, "v1", standin_step_s=0.5)
    gpu_version(ws, "v2", standin_skill=0.5)
    verl_reconciler(ws).run(wait=True, poll_s=0.05)
    run = ws.version("v1").run
    assert run.succeeded and run.gpus == 2 and run.usage["wall_hours"] >= 1 / 3600
    # (recorded to 6 significant digits, as every float of a record)
    assert run.usage["gpu_hours"] == pytest.approx(2 * run.usage["wall_hours"], rel=1e-5)
    assert ws.version("v2").run is None and launched(ws) == ["v0", "v1"]
    v2 = plans_by_name(ws)["v2"]
    assert v2.action is None and "autonomy.max_gpu_hours (0.0001) is spent" in v2.note
    assert f"{run.usage['gpu_hours']:.3g} GPU-hours recorded" in v2.note

    # The spend per version, as lineage and the report show it.
    rows = {row["name"]: row for row in json.loads(
        cli("-C", str(ws.root), "lineage", "--json").out)}
    assert rows["v1"]["spend"] == {"steps": 4, "wall_hours": run.usage["wall_hours"],
                                   "gpu_hours": run.usage["gpu_hours"], "planner_tokens": 0}
    assert rows["v0"]["spend"]["gpu_hours"] == rows["v2"]["spend"]["gpu_hours"] == 0
    assert f"{run.usage['gpu_hours']:.3g} GPU-h" in cli("-C", str(ws.root), "lineage").out
    site = collect(ws)
    assert site.gpu_hours_spent == run.usage["gpu_hours"] and site.gpu_hours_budget == 1e-4


def test_a_cpu_job_spends_no_gpu_hours_and_launches_under_any_budget(workspace):
    ws = set_project(workspace, max_gpu_hours=0)
    propose(ws, "v1", standin_skill=0.5)
    Reconciler(ws, log=lambda _: None).run(wait=True, poll_s=0.05)
    for name in ("v0", "v1"):
        run = ws.version(name).run
        assert run.succeeded and run.gpus == 0 and run.usage["gpu_hours"] == 0
        assert run.started_at and "wall_hours" in run.usage  # its wall-clock time is kept


def test_the_gpus_are_the_rendered_configs_nodes_times_gpus_per_node():
    assert LocalBackend().resources({"backend": "local"})["gpus"] == 0
    verl = {"backend": "verl", "verl": {"nnodes": 2, "n_gpus_per_node": 4}}
    assert VerlBackend().resources(verl) == {"nodes": 2, "gpus_per_node": 4, "gpus": 8}
    # A Hydra override is what verl runs with: it wins over the section's setting.
    verl["verl"]["overrides"] = {"trainer.n_gpus_per_node": 8}
    assert VerlBackend().resources(verl)["gpus"] == 16
    assert VerlBackend().resources({"backend": "verl"})["gpus"] == 1  # verl's defaults


RUN = {"state": "Failed", "attempt": 2, "job_id": "evo-v1-a2-0123456789",
       "backend": "verl", "artifact_dir": "x", "created_at": "2026-01-01T10:00:00+00:00",
       "resources": {"nodes": 1, "gpus_per_node": 4, "gpus": 4}}


def test_the_spend_counts_every_attempt_and_a_running_job_until_now():
    ended = ended_run(RUN, "2026-01-01T11:30:00+00:00")
    assert ended["started_at"] == RUN["created_at"]  # never seen running: from submission
    assert ended["usage"] == {"wall_hours": 1.5, "gpu_hours": 6.0}
    earlier = [{"attempt": 1, "gpu_hours": 2.0, "wall_hours": 0.5}]
    run = RunRecord.from_record({**ended, "attempts": earlier})
    assert run.gpu_hours_spent() == 8.0 and run.wall_hours_spent() == 2.0
    # Running: its hours so far count; the clock is read at `now`.
    running = RunRecord.from_record({**RUN, "state": "Running",
                                     "started_at": "2026-01-01T10:00:00+00:00"})
    assert running.gpu_hours("2026-01-01T10:15:00+00:00") == 1.0


@pytest.mark.parametrize("usage", [{"gpu_hours": -1}, {"gpu_hours": "lots"},
                                   {"wall_hours": True}])
def test_a_malformed_usage_is_named_not_a_traceback(usage):
    with pytest.raises(EvoError) as err:
        RunRecord.from_record({**RUN, "usage": usage}, "evo/v1:runs/v1/run.yaml")
    assert err.value.field.startswith("usage.") and "non-negative number" in err.value.message


def test_the_step_budget_counts_every_seed_a_version_would_train(workspace):
    """10 steps on two seeds are 20 steps of the budget: a version that would train them
    fits under max_total_steps 20, not under 15."""
    ws = set_project(workspace, {"seeds": [0, 1], "grpo": {"steps": 10}})
    new_version(ws, "v1", "v0", rationale="train as is")
    for budget, fits in ((15, False), (20, True)):
        ws = set_project(ws, max_total_steps=budget)
        ctx = load_context(ws)
        assert recipe_steps(ctx, ctx.states["v1"]) == 20
        assert within_budget(ctx, ctx.states["v1"]) is fits
