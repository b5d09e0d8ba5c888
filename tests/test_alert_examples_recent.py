"""An alert's examples are first looked up in a copy of the latest steps' rows; a `where` must
still mean what it means over the whole view (its subqueries read every row)."""

from __future__ import annotations

import dataclasses

import pytest

from evotrainer.diagnosis.diagnose import ROLLOUT_ID_SQL, _Run
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.diagnosis.sql import ReadOnlyQuery
from evotrainer.evidence.synthetic import rollout_table

H0 = resolve_harness("h0")


def _table(top_step: int):
    # 40 steps of 8 rollouts, rewards 0.5 everywhere but one rollout of `top_step` (1.0).
    return rollout_table(
        [
            dict(
                step=step,
                group_id=f"g{g}",
                sample_idx=i,
                reward=1.0 if (step, g, i) == (top_step, 0, 0) else 0.5,
                correct=0.0,
            )
            for step in range(1, 41)
            for g in range(4)
            for i in range(2)
        ]
    )


def _full_query(table, where: str) -> list[str]:
    sandbox = ReadOnlyQuery(table, None, "train")
    try:
        _, rows = sandbox.query(
            f"SELECT {ROLLOUT_ID_SQL} FROM rollouts WHERE ({where}) "
            "ORDER BY step DESC, seed, group_id, sample_idx LIMIT 5",
            {},
            field="test",
        )
    finally:
        sandbox.close()
    return [r[0] for r in rows]


@pytest.mark.parametrize(
    "where",
    [
        # Over the latest steps alone the max is 0.5 and every recent row would match.
        "reward >= (SELECT max(reward) FROM rollouts)",
        "reward >= (SELECT max(r.reward) FROM rollouts r WHERE r.step <= rollouts.step)",
        "NOT EXISTS (SELECT 1 FROM rollouts r WHERE r.reward > rollouts.reward)",
    ],
)
@pytest.mark.parametrize("top_step", [1, 40])
def test_examples_subqueries_read_the_whole_view(where, top_step):
    table = _table(top_step)
    alert = dataclasses.replace(H0.alerts[0], sample_where=where, sample_split=None)
    metric = H0.metric(alert.metric)
    assert metric.split == "train"
    run = _Run(table, None, H0, 60.0)
    try:
        found = run._examples(alert, metric)
    finally:
        run.close()
    want = _full_query(table, where)
    assert found == want
    if where.startswith("reward >= (SELECT max(reward)"):
        assert found == [f"v0/0/train/{top_step}/g0/0"]
