"""Early-stop replays: every recorded step of a run from its prefixes in one pass, stopping
where the step-by-step replay stops; kept between `harness diff` runs, so the same revision
over the same recorded run is read back, never replayed again, and another is replayed."""

from __future__ import annotations

import pytest
import yaml
from standin import converge
from standin import propose as train

from evotrainer.agent import stop_replay
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.store.workspace import Workspace

pytestmark = pytest.mark.usefixtures("standin")


def _revision(ws: Workspace, name: str, threshold: float) -> None:
    """h0 with the collapse stop firing at any dead-group share of at least `threshold`."""
    doc = yaml.safe_load((ws.root / "harness_revisions" / "h0.yaml").read_text())
    doc.update(name=name, parent="h0", early_stop=[
        {**r, "when": f"rows >= params.stop_min_rollouts && latest.dead_group_ratio >= "
                      f"{threshold}"} if r["name"] == "collapse" else r
        for r in doc["early_stop"]])
    (ws.root / "harness_revisions" / f"{name}.yaml").write_text(yaml.safe_dump(doc))


def test_a_replay_is_read_back_for_the_same_revision_and_run(workspace, monkeypatch):
    train(workspace, "v1", standin_skill=0.6)
    converge(workspace)
    _revision(workspace, "h5", 0.0)
    h0, h5 = resolve_harness("h0", workspace.root), resolve_harness("h5", workspace.root)
    first = stop_replay.stop_changes(workspace, h0, h5)
    assert [c["version"] for c in first] == ["v0", "v1"]
    assert all(c["after"]["rule"] == "collapse" for c in first)
    kept = list((workspace.state_dir / "cache" / "backtest").glob("stop-*.json"))
    assert len(kept) == 4  # two versions, two revisions

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed a run replayed before")

    monkeypatch.setattr(stop_replay, "_replay", no_replay)
    assert stop_replay.stop_changes(workspace, h0, h5) == first
    # Another rule is another revision digest: its stops are replayed, not read.
    _revision(workspace, "h6", 0.01)
    with pytest.raises(AssertionError, match="replayed before"):
        stop_replay.stop_changes(workspace, h0, resolve_harness("h6", workspace.root))


def test_an_unreadable_memo_is_replayed(workspace):
    """A memo that is not JSON, or holds no stop record, is not trusted: the run is
    replayed and the diff is the same."""
    train(workspace, "v1", standin_skill=0.6)
    converge(workspace)
    _revision(workspace, "h5", 0.0)
    h0, h5 = resolve_harness("h0", workspace.root), resolve_harness("h5", workspace.root)
    first = stop_replay.stop_changes(workspace, h0, h5)
    assert first
    kept = sorted((workspace.state_dir / "cache" / "backtest").glob("stop-*.json"))
    for i, path in enumerate(kept):
        path.write_text(('{"stop": "collapse"}', "not json", "[]", '{"other": 1}')[i % 4])
    assert stop_replay.stop_changes(workspace, h0, h5) == first


def test_a_replay_from_prefixes_stops_where_the_step_by_step_replay_stops(workspace,
                                                                          monkeypatch):
    """A run of 8 recorded steps and a collapse stop judged on at least 400 rollouts: both
    replays stop at step 5 (480 rollouts; 384 at step 4), the one from prefixes after a
    single diagnosis of the run, the other after one per step. A revision defining its
    metrics alike (another threshold, never reached) is replayed from the same pass."""
    from evotrainer.diagnosis import incremental

    train(workspace, "v1", standin_skill=0.6, standin_train_steps=8)
    converge(workspace)
    doc = yaml.safe_load((workspace.root / "harness_revisions" / "h0.yaml").read_text())
    doc.update(name="h7", parent="h0", params={**doc["params"], "stop_min_rollouts": 400})
    doc["early_stop"] = [{**r, "when": "rows >= params.stop_min_rollouts && "
                                       "latest.dead_group_ratio >= 0.0"}
                         if r["name"] == "collapse" else r for r in doc["early_stop"]]
    (workspace.root / "harness_revisions" / "h7.yaml").write_text(yaml.safe_dump(doc))
    doc["name"] = "h8"
    doc["early_stop"] = [{**r, "when": r["when"].replace(">= 0.0", ">= 2.0")}
                         for r in doc["early_stop"]]
    (workspace.root / "harness_revisions" / "h8.yaml").write_text(yaml.safe_dump(doc))
    harness, never = (stop_replay.stop_inputs(resolve_harness(h, workspace.root))
                      for h in ("h7", "h8"))
    states = workspace.versions()
    recipe = workspace.resolved_recipe("v1", states)
    diagnosed = []
    real = incremental.diagnose_incremental
    monkeypatch.setattr(incremental, "diagnose_incremental",
                        lambda *a, **k: (diagnosed.append(1), real(*a, **k))[1])
    monkeypatch.setattr(stop_replay, "diagnose_incremental", incremental.diagnose_incremental)
    fast, none = stop_replay._replay(workspace, states["v1"], [harness, never], recipe)
    assert none is None
    assert len(diagnosed) == 1
    monkeypatch.setattr(stop_replay, "diagnose_prefixes", lambda *args: None)
    [slow] = stop_replay._replay(workspace, states["v1"], [harness], recipe)
    assert len(diagnosed) == 1 + 5
    assert fast == slow == {"rule": "collapse", "alert": "dead_groups", "step": 5,
                            "steps": 150, "rows": 480}
