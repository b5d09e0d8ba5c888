"""Untrusted text (rollout fields, harness names) printed by the CLI: Rich markup in it is
shown, not interpreted, and terminal control sequences never reach the terminal raw."""

from __future__ import annotations

import pyarrow.parquet as pq

from evotrainer.evidence.synthetic import rollout_table

HOSTILE_GROUP = "[/bold]g\x1b]8;;http://evil/\x07x\x1b[2J\x00[red]"


def test_diagnose_prints_hostile_rollout_ids_as_text(cli, tmp_path):
    # Every group has one reward: the dead-group alert fires and cites these group ids.
    rows = [dict(step=1, group_id=f"{HOSTILE_GROUP}{g}", sample_idx=i, reward=1.0)
            for g in range(4) for i in range(4)]
    path = tmp_path / "rollouts.parquet"
    pq.write_table(rollout_table(rows), path)
    result = cli("diagnose", "--rollouts", str(path))
    assert result.code == 0, result.err
    assert "Traceback" not in result.err
    assert "\x1b" not in result.out and "\x07" not in result.out and "\x00" not in result.out
    assert "[/bold]gx[red]" in result.out  # the markup is shown literally, escapes removed
