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
    connection = ReadOnlyQuery(table, None, "train")
    try:
        _, rows = connection.query(
            f"SELECT {ROLLOUT_ID_SQL} FROM rollouts WHERE ({where}) "
            "ORDER BY step DESC, seed, group_id, sample_idx LIMIT 5",
            {},
            field="test",
        )
    finally:
        connection.close()
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


def test_calls_view_rows_equal_the_flattened_calls_of_a_chunked_table():
    # seed and step of a call are its rollout's, whatever the chunking of the rollouts and
    # with rows without tool-call data in between; SQL reads them as plain BIGINTs.
    import pyarrow as pa

    rows = [
        dict(
            seed=seed,
            step=step,
            group_id=f"g{step}",
            tool_calls=None if step % 3 == 0 else [f"t{i % 2} a{i}" for i in range(step % 4)],
        )
        for seed in (7, 11)
        for step in range(1, 13)
    ]
    table = rollout_table(rows)
    chunked = pa.concat_tables([table.slice(0, 5), table.slice(5, 9), table.slice(14)])
    assert chunked.column("seed").num_chunks == 3
    want = [
        (r["seed"], r["step"], name, args)
        for r in rows
        for name, args in (c.split(" ") for c in r["tool_calls"] or [])
    ]
    connection = ReadOnlyQuery(chunked, None, "train")
    try:
        _, got = connection.query("SELECT seed, step, name, args FROM calls", {}, field="test")
        _, types = connection.query(
            "SELECT typeof(any_value(seed)), typeof(any_value(step)) FROM calls", {}, field="t"
        )
        _, per_step = connection.query(
            "SELECT step, count(*) FROM calls GROUP BY step ORDER BY step", {}, field="test"
        )
    finally:
        connection.close()
    assert got == want
    assert types == [("BIGINT", "BIGINT")]
    counts: dict[int, int] = {}
    for _, step, _, _ in want:
        counts[step] = counts.get(step, 0) + 1
    assert per_step == sorted(counts.items())
