"""What makes a diagnosis cost about a scan keeps its results: metric queries that read the
same rows run as one query and give what each gives alone (errors included), and the tool-call
analyzers' two ways of finding distinct (name, args) pairs agree."""

from __future__ import annotations

import dataclasses

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from same_diagnosis import assert_same

from evotrainer.diagnosis import diagnose as diagnose_module
from evotrainer.diagnosis.analyzers import echo_repeat, echo_trap, leak, max_same_tool_streak
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import Metric, resolve_harness
from evotrainer.diagnosis.sql import fusable_query
from evotrainer.errors import EvoError
from evotrainer.evidence.schema import TOOL_CALL
from evotrainer.evidence.synthetic import random_rollouts, rollout_table

H0 = resolve_harness("h0")


def _tables() -> dict[str, pa.Table]:
    val = random_rollouts(40, steps=2, seed=2)
    val = val.set_column(val.schema.get_field_index("split"), "split", pa.array(["val"] * 40))
    return {
        "random": random_rollouts(600, steps=6),
        "train and val": pa.concat_tables([random_rollouts(300, steps=3), val]),
        "only val (empty train split)": val,
        "one row": rollout_table(
            [dict(reward=1.0, correct=1.0, turns=3, tool_calls=["bash ls"], mean_logprob=-0.2)]
        ),
        "no tool calls": rollout_table(
            [dict(step=1 + i // 4, group_id=f"g{i // 2}", reward=float(i % 3), turns=2 + i)
             for i in range(16)]
        ),
        "empty call lists, single turn": rollout_table(
            [dict(step=1 + i // 4, group_id=f"g{i // 2}", reward=float(i % 2), tool_calls=[],
                  turns=1) for i in range(16)]
        ),
    }


@pytest.mark.parametrize("harness", ["h0", "h1"])
@pytest.mark.parametrize("name", list(_tables()))
def test_fused_queries_give_what_each_query_gives_alone(name, harness, monkeypatch):
    table = _tables()[name]
    revision = resolve_harness(harness)
    fused = diagnose(table, None, revision)
    monkeypatch.setattr(diagnose_module, "fusable_query", lambda sql: None)
    alone = diagnose(table, None, revision)
    assert_same(fused, alone)



def test_h0_queries_that_read_the_same_rows_share_a_key():
    keys: dict[str, list[str]] = {}
    for metric in H0.metrics:
        if metric.sql and (query := fusable_query(metric.sql)):
            keys.setdefault(query.key, []).append(metric.name)
    groups = sorted(sorted(names) for names in keys.values() if len(names) > 1)
    assert [
        "correct_rate", "length_reward_corr", "mean_logprob", "response_tokens_mean",
        "reward_mean", "truncation_rate", "turns_mean",
    ] in groups
    assert ["dead_group_ratio", "reward_spread"] in groups
    assert ["turns_max", "turns_p90"] in groups


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT step, avg(reward) AS value FROM rollouts GROUP BY ROLLUP (step) ORDER BY step",
        "SELECT avg(reward) AS value FROM rollouts LIMIT 1",
        "SELECT avg(r.reward) AS value FROM rollouts r",
        "WITH x AS (SELECT * FROM rollouts) SELECT avg(reward) AS value FROM x",
        "SELECT avg(reward) AS value FROM rollouts JOIN groups USING (seed, step, group_id)",
        "SELECT step, avg(reward) AS value FROM rollouts GROUP BY step",
        "SELECT avg(reward) AS v FROM rollouts",
        "SELECT DISTINCT avg(reward) AS value FROM rollouts",
        "SELECT avg(reward) AS value FROM rollouts HAVING count(*) > 1",
        "SELECT 1 AS __evotrainer_fused_0, avg(reward) AS value FROM rollouts",
    ],
)
def test_other_query_shapes_run_alone(sql):
    assert fusable_query(sql) is None


def _with_metrics(*extra: Metric):
    return dataclasses.replace(H0, metrics=H0.metrics + extra)


def test_a_failing_query_reports_its_own_error_not_the_fused_one():
    table = _tables()["random"]
    broken = Metric(
        name="broken", layer="signal", split="train",
        sql="SELECT step, avg(no_such_column) AS value FROM rollouts GROUP BY ROLLUP (step)",
    )
    with pytest.raises(EvoError) as err:
        diagnose(table, None, _with_metrics(broken))
    assert err.value.field == "metrics.broken"
    assert "no_such_column" in err.value.message


def test_a_query_of_many_rows_fused_with_aggregates_is_refused_as_alone():
    # `SELECT reward AS value` returns a row per rollout: fused with an aggregate it would not
    # even bind, and alone it is refused for its row count; that refusal is what the user sees.
    table = _tables()["random"]
    rows = Metric(name="rows", layer="signal", split="train",
                  sql="SELECT reward AS value FROM rollouts")
    with pytest.raises(EvoError) as err:
        diagnose(table, None, _with_metrics(rows))
    assert err.value.field == "metrics.rows"
    assert "returned 600 rows" in err.value.message


def _leak_by_definition(calls, tools, patterns):
    import re

    if calls is None:
        return np.nan
    return float(any(
        (c["name"] or "") in tools
        or any(re.search(p, f"{c['name'] or ''} {c['args'] or ''}") for p in patterns)
        for c in calls
    ))


def test_leak_with_more_distinct_pairs_than_a_table_can_mark():
    # Every call a new name and new args: too many possible pairs to mark in a table, so the
    # pairs are hashed; both ways must give the definition's answer.
    rows = [
        [{"name": f"tool{i}", "args": f"git log {i}" if i % 7 == 0 else f"ls {i}"},
         {"name": "reveal" if i % 11 == 0 else f"other{i}", "args": None}]
        for i in range(300)
    ] + [None, []]
    params = {"leak_tools": ["reveal"], "leak_patterns": [r"\bgit (log|show)\b"]}
    table = pa.table({"tool_calls": pa.array(rows, pa.list_(TOOL_CALL))})
    want = [_leak_by_definition(c, ["reveal"], params["leak_patterns"]) for c in rows]
    np.testing.assert_array_equal(leak(table, params), want)
    np.testing.assert_array_equal(max_same_tool_streak(table, params)[:300], np.ones(300))


# h0's echo_trap_ratio as the query it was first shipped as (the method's definition).
ECHO_SQL = """
SELECT avg(CASE WHEN turns > $echo_turns AND correct = 0 THEN 1.0 ELSE 0.0 END) AS value
FROM rollouts WHERE turns IS NOT NULL"""
# h1's echo_repeat_ratio as a per-row list query (h1's echo sample filter has this rule).
REPEAT_SQL = """
SELECT avg(CASE WHEN correct = 0
    AND coalesce(list_bool_or(list_transform(range(1, len(tool_calls) - $echo_repeats + 2),
      lambda i: len(list_distinct(tool_calls[i:i + $echo_repeats - 1])) = 1)), false)
  THEN 1.0 ELSE 0.0 END) AS value
FROM rollouts WHERE tool_calls IS NOT NULL"""


@pytest.mark.parametrize("name", sorted(_tables()))
@pytest.mark.parametrize("repeats", [1, 2, 3])
def test_echo_analyzers_give_what_their_queries_give(name, repeats):
    table = _tables()[name]
    params = {"echo_turns": 4, "echo_repeats": repeats}
    con = duckdb.connect()
    con.register("rollouts", table)
    for sql, analyzer in ((ECHO_SQL, echo_trap), (REPEAT_SQL, echo_repeat)):
        expected = con.execute(sql, {k: v for k, v in params.items() if f"${k}" in sql})
        expected = expected.fetchone()[0]
        got = analyzer(table, params)
        if expected is None:  # no row with the data it reads
            assert np.isnan(got).all()
        else:
            assert np.nanmean(got) == pytest.approx(expected, abs=1e-12)


def _runs_table() -> pa.Table:
    """Calls with runs of one name or one (name, args) pair inside rows and across row
    boundaries, null names and args, rows without call data."""
    rng = np.random.default_rng(4)
    rows: list[list[dict] | None] = []
    for i in range(400):
        if i % 13 == 0:
            rows.append(None)
            continue
        rows.append([
            {"name": None if rng.random() < 0.05 else str(rng.choice(["a", "b"])),
             "args": None if rng.random() < 0.05 else str(rng.choice(["x", "y"]))}
            for _ in range(int(rng.integers(0, 7)))
        ])
    return pa.table({
        "tool_calls": pa.array(rows, pa.list_(TOOL_CALL)),
        "turns": pa.array(rng.integers(1, 9, 400)),
        "correct": pa.array((rng.random(400) < 0.4).astype(float)),
    })


def _longest_run(items: list) -> int:
    best = run = 1
    for before, item in zip(items, items[1:], strict=False):
        run = run + 1 if item == before else 1
        best = max(best, run)
    return best


@pytest.mark.parametrize("form", ["plain", "coded", "sliced", "coded slice", "two chunks"])
def test_run_analyzers_give_their_definition_on_every_form_of_calls(form):
    from evotrainer.evidence.io import encode_tool_calls

    whole = _runs_table()
    table = {
        "plain": whole,
        "coded": encode_tool_calls(whole),
        "sliced": whole.slice(37, 300),
        "coded slice": encode_tool_calls(whole.slice(37, 300)),
        "two chunks": pa.concat_tables([whole.slice(0, 150), whole.slice(150)]),
    }[form]
    rows = whole.slice(37, 300) if "slice" in form else whole
    calls = rows.column("tool_calls").to_pylist()
    names = [None if c is None else [x["name"] or "" for x in c] for c in calls]
    pairs = [None if c is None else [(x["name"] or "", x["args"] or "") for x in c]
             for c in calls]
    streak = [_longest_run(n) if n else np.nan for n in names]
    np.testing.assert_array_equal(max_same_tool_streak(table, {}), streak)
    correct = rows.column("correct").to_pylist()
    turns = rows.column("turns").to_pylist()
    np.testing.assert_array_equal(
        echo_trap(table, {"echo_turns": 6}),
        [float(ok == 0 and t > 6) for ok, t in zip(correct, turns, strict=True)],
    )
    for repeats in (1, 2, 3, 4):
        want = [
            np.nan if p is None else float(ok == 0 and bool(p) and _longest_run(p) >= repeats)
            for ok, p in zip(correct, pairs, strict=True)
        ]
        np.testing.assert_array_equal(echo_repeat(table, {"echo_repeats": repeats}), want)


@pytest.mark.parametrize(
    "mask",
    [
        np.ones(300, bool),
        np.zeros(300, bool),
        np.arange(300) > 250,  # a growing run's newest rows
        np.arange(300) < 3,
        (np.arange(300) // 7) % 2 == 0,  # many runs: filtered, not sliced
        np.random.default_rng(0).random(300) < 0.5,
        np.ones(1, bool),
        np.zeros(0, bool),
    ],
)
def test_rows_where_takes_the_rows_a_filter_takes(mask):
    from evotrainer.diagnosis.sql import rows_where

    table = pa.table({"x": np.arange(len(mask))})
    assert rows_where(table, mask).column("x").to_pylist() == np.flatnonzero(mask).tolist()
    assert rows_where(table, pa.array(mask)).num_rows == int(mask.sum())


def test_an_analyzer_failing_on_its_thread_reports_itself_in_harness_order(monkeypatch):
    # Analyzers run on a second thread beside the queries: a failing one still names its
    # metric, and a query failing earlier in the harness is the error reported instead.
    from evotrainer.diagnosis.analyzers import ANALYZERS, Analyzer

    def refuse(table, params):
        raise EvoError("echo_repeats must be at least 1")

    monkeypatch.setitem(ANALYZERS, "refusing", Analyzer("refusing", ("tool_calls",), refuse))
    failing = Metric(name="failing", layer="behavior", split="train", analyzer="refusing")
    table = _tables()["random"]
    with pytest.raises(EvoError) as err:
        diagnose(table, None, _with_metrics(failing))
    assert err.value.field == "metrics.failing"
    assert "echo_repeats" in err.value.message
    broken = Metric(
        name="broken", layer="signal", split="train",
        sql="SELECT step, avg(no_such_column) AS value FROM rollouts GROUP BY ROLLUP (step)",
    )
    harness = _with_metrics(broken)
    harness = dataclasses.replace(harness, metrics=(*harness.metrics, failing))
    with pytest.raises(EvoError) as err:
        diagnose(table, None, harness)
    assert err.value.field == "metrics.broken"
