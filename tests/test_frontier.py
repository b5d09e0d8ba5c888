"""On main and main's frontier are one fact (store/lineage.py): the planners, reconcile, the
lineage, retention and the report read it alike, also when the first root is not on main and
nothing is promoted yet."""

from __future__ import annotations

import pytest
from standin import converge

from evotrainer.agent.planners.base import View
from evotrainer.control.reconcile import load_context
from evotrainer.control.retention import plan_gc
from evotrainer.report.views import _promoted_path
from evotrainer.store.git import branch_name
from evotrainer.store.lineage import lineage_rows, main_frontier, merged_into_main
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


def test_the_five_agree_when_the_first_root_is_not_on_main_and_nothing_is_promoted(workspace):
    converge(workspace)  # v0 gated `baseline` and merged into main: nothing promoted yet
    # A second root that sorts before v0 ("a0" < "v0") and was never merged into main.
    spec = (workspace.root / "spec/versions/v0.yaml").read_bytes()
    workspace.git.commit_files(branch_name("a0"), {"spec/versions/a0.yaml": spec},
                               "a second root, off main", start="refs/heads/main")
    states = workspace.versions()
    assert {"a0", "v0"} <= states.keys() and states["a0"].parent is None
    assert states["v0"].decision.verdict == "baseline"

    on_main = merged_into_main(workspace)
    assert "v0" in on_main and "a0" not in on_main
    assert main_frontier(states, on_main) == "v0"

    rows = lineage_rows(workspace, states)
    assert rows[0].name == "a0"  # the first root, the one View.frontier used to return
    assert {r.name for r in rows if r.on_main} == on_main & states.keys()
    assert load_context(workspace).on_main == on_main
    assert View.load(workspace).frontier() == "v0"
    assert _promoted_path(rows, workspace, states)[-1] == "v0"
    _, kept = plan_gc(workspace, states)
    assert kept["v0"] == "main's frontier (baseline)"


def test_with_nothing_on_main_the_planner_starts_from_the_first_root(tmp_path, workspace):
    states = workspace.versions()
    assert merged_into_main(workspace) & states.keys() == set()
    assert main_frontier(states, merged_into_main(workspace)) is None
    assert View.load(Workspace(workspace.root)).frontier() == "v0"
