"""The gate against what main would lose: a version whose parent is not on main is decided
against main's frontier, its parent comparison recorded beside it under the family's
correction. Score tables are made by hand in the shape the autonomy gym measured: v2 = v0 + a
fix, inconclusive against v0; v3 continues the unpromoted v2, no better than v2 yet clearly
better than v0."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from standin import converge
from standin import propose as train

from evotrainer.commands.lineage import describe
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.gate import decision
from evotrainer.gate.decision import decide, replaced_frontier
from evotrainer.store.lineage import lineage_rows
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")

TASKS = 40


def table(per_task: np.ndarray) -> pa.Table:
    """A score table: two samples per task, each scoring the task's mean."""
    rows = [(0, f"t{i}", "arith", s, float(np.clip(m, 0.0, 1.0)))
            for i, m in enumerate(per_task) for s in range(2)]
    seed, task, source, sample, correct = map(list, zip(*rows, strict=True))
    return pa.table({"seed": seed, "task_id": task, "data_source": source,
                     "sample_idx": sample, "correct": correct})


def issue_shape() -> dict[str, pa.Table]:
    """v0 ≈ 0.25; v2 = v0 + 0.11 with a wide per-task spread (inconclusive); v3 = v0 + 0.12
    with a narrow one (significant against v0, inside the noise against v2)."""
    rng = np.random.default_rng(7)
    v0 = rng.uniform(0.1, 0.4, TASKS)
    v2 = v0 + 0.11 + rng.normal(0.0, 0.45, TASKS)
    v3 = v0 + 0.12 + rng.normal(0.0, 0.06, TASKS)
    return {"v0": table(v0), "v2": table(v2), "v3": table(v3)}


@pytest.fixture
def lineage(workspace: Workspace, monkeypatch) -> Workspace:
    """v0 on main, v2 (from v0) gated and not promoted, v3 trained on v2; the gate then reads
    the hand-made tables."""
    train(workspace, "v2", standin_skill=0.3)
    converge(workspace)
    assert workspace.version("v2").records["decision"]["verdict"] != "promote"
    train(workspace, "v3", parent="v2", standin_skill=0.3)
    converge(workspace)
    tables = issue_shape()
    monkeypatch.setattr(decision, "recorded_scores", lambda ws, name: tables[name])
    return workspace


def redecide(ws: Workspace, name: str) -> dict:
    states = ws.versions()
    return decide(ws, states, states[name], resolve_harness("h0", ws.root))


def test_a_fix_on_main_s_frontier_is_decided_against_its_parent_alone(lineage):
    states = lineage.versions()
    assert replaced_frontier(lineage, states, states["v2"]) is None  # v0 is on main
    v2 = redecide(lineage, "v2")
    assert v2["verdict"] == "inconclusive"
    assert v2["comparison"]["ci_low"] < 0 < v2["comparison"]["ci_high"]
    assert "against_main" not in v2 and "family" not in v2


def test_a_version_on_an_unpromoted_parent_is_promoted_on_what_main_would_lose(lineage):
    states = lineage.versions()
    assert replaced_frontier(lineage, states, states["v3"]) == "v0"
    v3 = redecide(lineage, "v3")
    assert v3["verdict"] == "promote"
    main = v3["against_main"]
    assert main["version"] == "v0" and main["verdict"] == "promote"
    assert main["comparison"]["delta"] == pytest.approx(0.12, abs=0.03)
    assert main["comparison"]["ci_low"] > 0
    # The parent comparison is recorded beside it, inside the noise, both at alpha / 2.
    parent = v3["comparison"]
    assert parent["ci_low"] < 0 < parent["ci_high"]
    members = v3["family"]["members"]
    assert set(members) == {"parent", "frontier"}
    assert members["parent"]["version"] == "v2" and members["frontier"]["version"] == "v0"
    assert members["parent"]["verdict"] == "inconclusive"
    assert parent["confidence"] == pytest.approx(0.975)
    assert main["comparison"]["confidence"] == pytest.approx(0.975)
    # The reason and the outcome name both comparisons.
    assert v3["reason"].startswith("against main's frontier v0 (its parent v2 is not on main)")
    assert "against its parent v2" in v3["reason"]
    assert v3["outcome"]["kind"] == "improvement"
    assert "main's frontier v0" in v3["outcome"]["reason"]
    assert "against its parent v2 (not on main)" in v3["outcome"]["reason"]


def test_a_version_on_an_unpromoted_parent_that_main_would_lose_by_is_not_promoted(
        lineage, monkeypatch):
    tables = issue_shape()
    rng = np.random.default_rng(3)
    # v3 clearly above v2 but not above v0: promoting it would hand main nothing better.
    v0 = np.array(tables["v0"].column("correct").to_pylist()[::2])
    tables["v2"] = table(v0 - 0.2 + rng.normal(0.0, 0.03, TASKS))
    tables["v3"] = table(v0 + rng.normal(0.0, 0.03, TASKS))
    monkeypatch.setattr(decision, "recorded_scores", lambda ws, name: tables[name])
    v3 = redecide(lineage, "v3")
    assert v3["family"]["members"]["parent"]["verdict"] == "promote"
    assert v3["against_main"]["verdict"] == "inconclusive"
    assert v3["verdict"] == "inconclusive"


def test_the_loop_records_the_decision_against_main(workspace):
    """Reconcile's own gate (no hand-made tables): a child of an unpromoted version carries
    `against_main` naming main's frontier, and a child of the frontier does not."""
    train(workspace, "v1", standin_skill=0.3)
    converge(workspace)
    assert workspace.version("v1").records["decision"]["verdict"] != "promote"
    train(workspace, "v2", parent="v1", standin_skill=0.3)
    converge(workspace)
    v1 = workspace.version("v1").records["decision"]
    v2 = workspace.version("v2").records["decision"]
    assert "against_main" not in v1
    assert v2["against_main"]["version"] == "v0"
    assert set(v2["family"]["members"]) == {"parent", "frontier"}
    # What a user reads shows the comparison the verdict came from, and against whom.
    rows = {r.name: r for r in lineage_rows(workspace)}
    main_comparison = v2["against_main"]["comparison"]
    assert rows["v2"].against == "v0" and rows["v1"].against == "v0"
    assert rows["v2"].delta == main_comparison["delta"]
    assert rows["v2"].ci == (main_comparison["ci_low"], main_comparison["ci_high"])
    assert rows["v2"].against_mean == main_comparison["mean_a"]
    assert "vs v0" in describe(rows["v2"]) and "vs" not in describe(rows["v1"])


def test_a_baseline_re_gated_off_main_still_stands_for_main(lineage, monkeypatch):
    """Re-gated under a newly adopted harness, the baseline's branch moves past main until
    reconcile promotes it again: in that window its children's children are still decided
    against it."""
    monkeypatch.setattr(decision, "merged_into_main", lambda ws: set())
    states = lineage.versions()
    assert replaced_frontier(lineage, states, states["v3"]) == "v0"
    assert replaced_frontier(lineage, states, states["v2"]) is None  # v0 is its parent
    assert redecide(lineage, "v3")["against_main"]["version"] == "v0"
