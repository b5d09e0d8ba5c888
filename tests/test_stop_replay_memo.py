"""Early-stop replays kept between `harness diff` runs: the same revision over the same
recorded run is read back, never replayed again; another revision is replayed."""

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
