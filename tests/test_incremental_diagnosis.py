"""Incremental diagnosis of a growing run equals the full diagnosis and only recomputes the
rows of (split, seed, step) keys that changed."""

from __future__ import annotations

import dataclasses

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from evotrainer.diagnosis import analyzers
from evotrainer.diagnosis.analyzers import Analyzer
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import Metric, resolve_harness
from evotrainer.diagnosis.incremental import (
    DiagnosisState,
    _combinable,
    _combine,
    _from_histograms,
    _key_codes,
    _sql_partials,
    diagnose_incremental,
    diagnose_prefixes,
)
from evotrainer.diagnosis.sql import ReadOnlyQuery
from evotrainer.errors import EvoError
from evotrainer.evidence.synthetic import random_rollouts

H0 = resolve_harness("h0")


def _run(rows: int = 2400) -> pa.Table:
    """Two seeds, train and val rows interleaved by step, as a live run writes them."""
    train = pa.concat_tables(
        [random_rollouts(rows, steps=12, seed=s).set_column(1, "seed", pa.array([s] * rows))
         for s in (0, 1)]
    )
    val = random_rollouts(rows // 4, steps=12, seed=7)
    val = val.set_column(val.schema.get_field_index("split"), "split",
                         pa.array(["val"] * val.num_rows))
    both = pa.concat_tables([train, val])
    order = pc.sort_indices(both, [("step", "ascending"), ("split", "ascending")])
    return both.take(order)


def _assert_same(incremental: dict, full: dict) -> None:
    assert incremental["metrics"].keys() == full["metrics"].keys()
    for name, value in full["metrics"].items():
        expected = value if value is None else pytest.approx(value, rel=1e-9, abs=1e-12)
        assert incremental["metrics"][name] == expected, name
    assert incremental["series"].keys() == full["series"].keys()
    for name, points in full["series"].items():
        got = incremental["series"][name]
        assert [s for s, _ in got] == [s for s, _ in points], name
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-9), name
    assert incremental["alerts"] == full["alerts"]
    assert incremental["gaps"] == full["gaps"]
    assert incremental["trends"] == pytest.approx(full["trends"], rel=1e-6)


def _grown_like_full(table: pa.Table, harness, cuts: tuple[int, ...]) -> tuple[dict, object]:
    """`table` grown to each of `cuts` rows, diagnosed incrementally and in full at each:
    the two must agree. Returns the last full diagnosis and the incremental state."""
    state = None
    for end in cuts:
        grown = table.slice(0, end)
        incremental, state = diagnose_incremental(grown, None, harness, state)
        full = diagnose(grown, None, harness)
        _assert_same(incremental, full)
    return full, state


def test_a_run_grown_in_three_chunks_diagnoses_like_the_full_run(monkeypatch):
    table = _run()
    seen: list[int] = []
    leak = analyzers.ANALYZERS["leak"]
    monkeypatch.setitem(analyzers.ANALYZERS, "leak", Analyzer(
        leak.name, leak.columns, lambda t, p: (seen.append(t.num_rows), leak.fn(t, p))[1]))
    # Cuts fall inside a step: the step a run is still writing is recomputed next time.
    cuts = [table.num_rows * 2 // 5 + 3, table.num_rows * 3 // 4 + 5, table.num_rows]
    state = None
    for end in cuts:
        grown = table.slice(0, end)
        seen.clear()
        incremental, state = diagnose_incremental(grown, None, H0, state)
        full = diagnose(grown, None, H0)
        _assert_same(incremental, full)
        train_leak_rows = seen[0]
        assert train_leak_rows < pc.sum(pc.equal(grown.column("split"), "train")).as_py() or (
            end == cuts[0]
        )
    # The last diagnosis only looked at the train rows of the steps that grew.
    previous = table.slice(0, cuts[1])
    last_step = pc.max(previous.column("step")).as_py()
    fresh = table.filter(pc.and_(pc.equal(table.column("split"), "train"),
                                 pc.greater_equal(table.column("step"), last_step)))
    assert train_leak_rows == fresh.num_rows


@pytest.mark.parametrize(
    "seeds, steps",
    [
        ([0, 0, 1, 1, None], [1, 2, 1, 2, 2]),
        ([3, 3, 3, None, None], [None, -5, None, 7, None]),
        ([0, 0, 2**40, 0], [10**9, 1, 10**9, 10**9]),  # sparse: far apart keys
        ([], []),
    ],
)
def test_row_keys_count_as_a_group_by_seed_and_step_does(seeds, steps):
    rows = pa.table({"seed": pa.array(seeds, pa.int64()), "step": pa.array(steps, pa.int64())})
    codes, keys, counts = _key_codes(rows)
    grouped = rows.group_by(["seed", "step"]).aggregate([([], "count_all")])
    expected = dict(zip(zip(grouped.column("seed").to_pylist(), grouped.column("step").to_pylist(),
                            strict=True), grouped.column("count_all").to_pylist(), strict=True))
    assert {key: int(counts[code]) for code, key in keys.items()} == expected
    assert [keys[c] for c in codes] == list(zip(seeds, steps, strict=True))


def test_a_state_of_another_harness_or_rewritten_steps_is_not_trusted():
    table = _run(800)
    _, state = diagnose_incremental(table, None, H0)
    # A step rewritten with a different row count is recomputed, not reused.
    shrunk = table.filter(pc.not_equal(table.column("sample_idx"), 0))
    again, _ = diagnose_incremental(shrunk, None, H0, state)
    _assert_same(again, diagnose(shrunk, None, H0))
    state.harness_digest = "sha256:other"
    other, _ = diagnose_incremental(table, None, H0, state)
    _assert_same(other, diagnose(table, None, H0))


def test_only_metrics_whose_partials_combine_are_incremental():
    kinds = {m.name: _combinable(m)[0] for m in H0.metrics}
    assert kinds["reward_mean"] == kinds["dead_group_ratio"] == kinds["leak_ratio"] == "mean"
    assert kinds["tool_type_entropy"] == "entropy"
    # Quantiles, maxima and a subquery of one integer column: from its histogram per key.
    assert kinds["turns_mean"] == kinds["turns_p90"] == kinds["turns_max"] == "histogram"
    assert kinds["length_reward_corr"] == "moments"
    # A join: recomputed over every row.
    assert kinds["avg_at_k"] is None


def test_means_of_the_same_rows_share_one_query_and_a_failing_one_reports_itself(monkeypatch):
    table = _run(800)
    queries: list[str] = []
    real = ReadOnlyQuery.query

    def spy(self, sql, params, *, field):
        queries.append(sql)
        return real(self, sql, params, field=field)

    monkeypatch.setattr(ReadOnlyQuery, "query", spy)
    _, state = diagnose_incremental(table.slice(0, 1500), None, H0)
    queries.clear()
    grown, _ = diagnose_incremental(table, None, H0, state)
    _assert_same(grown, diagnose(table, None, H0))
    partial_queries = [q for q in queries if "GROUP BY seed, step" in q]
    # The means of train rollouts, those of train groups, the turns histogram (for
    # turns_mean, turns_p90 and turns_max), the correlation's moments, the entropy of calls.
    assert len(partial_queries) == 5, partial_queries
    broken = Metric(
        name="broken", layer="signal", split="train",
        sql="SELECT step, avg(no_such_column) AS value FROM rollouts GROUP BY ROLLUP (step)",
    )
    harness = dataclasses.replace(H0, metrics=(*H0.metrics, broken))
    with pytest.raises(EvoError) as err:
        diagnose_incremental(table, None, harness, state)
    assert err.value.field == "metrics.broken"


@pytest.mark.parametrize("seed", range(6))
def test_values_from_histograms_are_duckdbs_to_the_bit(seed):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 400))
    # Few distinct values (a histogram's case), nulls, and at times only ones (single-turn).
    high = 2 if seed == 0 else int(rng.integers(2, 60))
    turns = rng.integers(1, high, rows).tolist()
    turns = [None if rng.random() < 0.1 else t for t in turns]
    steps = rng.integers(1, 6, rows)
    table = pa.table({"seed": pa.array([0] * rows), "step": pa.array(steps), "turns": turns})
    queries = [m.sql for m in H0.metrics if m.name in ("turns_mean", "turns_p90", "turns_max")]
    queries += [
        f"SELECT quantile_cont(turns, {q}) AS value FROM rollouts"
        for q in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.999, 1.0)
    ]
    queries += [
        "SELECT step, CASE WHEN min(turns) >= 2 THEN sum(turns)::DOUBLE END AS value "
        "FROM rollouts GROUP BY ROLLUP (step)",
        "SELECT step, count(turns)::DOUBLE AS value FROM rollouts GROUP BY ROLLUP (step)",
    ]
    con = duckdb.connect()
    con.register("rollouts", table)
    histograms: dict = {}
    for (s, step), value in zip(zip([0] * rows, steps.tolist(), strict=True), turns, strict=True):
        if value is not None:
            histograms.setdefault((s, step), {}).setdefault(value, 0)
            histograms[s, step][value] += 1
    for sql in queries:
        assert _combinable(Metric(name="m", layer="behavior", split="train", sql=sql))[0] == (
            "histogram"
        ), sql
        value, points = _from_histograms(sql, histograms)
        result = con.execute(sql).fetchall()
        if len(result[0]) == 1:
            assert value == result[0][0] and points == [], sql
        else:
            assert value == next(v for st, v in result if st is None), sql
            assert points == sorted([st, v] for st, v in result if st is not None and v is not None)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT quantile_disc(turns, 0.9) AS value FROM rollouts",
        "SELECT max(turns) + max(step) AS value FROM rollouts",
        "SELECT max(turns)::DOUBLE AS value FROM rollouts WHERE correct = 1",
        "SELECT (SELECT max(turns) FROM all_rollouts) AS value FROM rollouts",
        "SELECT quantile_cont(turns, $q) AS value FROM rollouts",
        "SELECT avg(DISTINCT turns) AS value FROM rollouts",
        "SELECT step, avg(DISTINCT turns) AS value FROM rollouts GROUP BY ROLLUP (step)",
        "SELECT avg(turns) AS value FROM rollouts WHERE turns > 1 GROUP BY seed",
        "SELECT avg(turns) AS value FROM rollouts WHERE (turns > 1",
        "SELECT max(turns) AS value FROM groups",
    ],
)
def test_other_queries_are_not_computed_from_histograms(sql):
    assert _combinable(Metric(name="m", layer="behavior", split="train", sql=sql))[0] is None


def test_a_correlation_from_co_moments_is_duckdbs_and_its_state_survives_json():
    rng = np.random.default_rng(3)
    rows = 3000
    x = rng.integers(10, 900, rows).astype(float) * 1e3  # large means: cancellation-prone
    y = 0.001 * x + rng.normal(0, 5, rows)
    x[::17], y[::23] = np.nan, np.nan
    steps = rng.integers(1, 8, rows)
    steps[steps == 7] = 6  # step 6: many rows; one step below with a constant side
    x[steps == 1] = 5.0
    table = pa.table(
        {"seed": rng.integers(0, 3, rows), "step": steps,
         "x": pa.array(x, from_pandas=True), "y": pa.array(y, from_pandas=True)}
    )
    sql = "SELECT step, corr(x, y) AS value FROM rollouts GROUP BY ROLLUP (step)"
    kind, partial_sql = _combinable(Metric(name="c", layer="behavior", split="train", sql=sql))
    con = duckdb.connect()
    con.register("rollouts", table)
    partials = _sql_partials(kind, con.execute(partial_sql).fetchall())
    state = DiagnosisState("h", {}, {"c": partials})
    partials = DiagnosisState.from_json(state.to_json()).partials["c"]
    value, points = _combine(kind, partials)
    result = con.execute(sql).fetchall()
    expected = next(v for s, v in result if s is None)
    assert value == pytest.approx(expected, rel=1e-12)
    wanted = sorted([s, v] for s, v in result if s is not None and not np.isnan(v))
    assert [s for s, _ in points] == [s for s, _ in wanted] and 1 not in [s for s, _ in points]
    assert [v for _, v in points] == pytest.approx([v for _, v in wanted], rel=1e-12)


def _tampered(table: pa.Table) -> pa.Table:
    """`table` with a `tampered` reward component on two rows of three, 1 on one in 17."""
    components = pa.array(
        [[] if i % 3 == 0 else [("tampered", float(i % 17 == 0))] for i in range(table.num_rows)],
        table.schema.field("reward_components").type,
    )
    return table.set_column(table.schema.get_field_index("reward_components"),
                            "reward_components", components)


def test_h1_grown_in_chunks_diagnoses_like_the_full_run():
    # h1's additions combine from per-step partials too: the integrity means over the rows
    # that carry `tampered` (some do not) and the echo_repeat analyzer.
    h1 = resolve_harness("h1")
    kinds = {m.name: _combinable(m)[0] for m in h1.metrics}
    assert kinds["tampered_ratio"] == kinds["echo_repeat_ratio"] == "mean"
    table = _tampered(_run(1200))
    full, _ = _grown_like_full(
        table, h1, (table.num_rows // 3 + 7, table.num_rows * 2 // 3 + 1, table.num_rows))
    assert full["metrics"]["tampered_ratio"] > 0


def test_catalogue_metrics_and_declared_analyzers_grown_in_chunks_diagnose_like_the_full_run():
    """A revision with every catalogue metric (some combine from partials, the length-budget
    ones carry their own params and are recomputed) and two declared analyzers (always
    recomputed over their declared rows)."""
    from evotrainer.diagnosis.catalogue import catalogue
    from evotrainer.diagnosis.harness import parse_harness

    entries = catalogue()
    doc = {
        "apiVersion": "evotrainer/v1", "kind": "HarnessRevision", "name": "hc",
        "metrics": [dict(e.metric) for e in entries] + [
            {"name": "long_share", "layer": "behavior", "series": True,
             "analyzer": {"name": "long_share"}},
            {"name": "calls_per_turn", "layer": "behavior", "series": True,
             "analyzer": {"name": "calls_per_turn"}},
        ],
        "alerts": [e.alert for e in entries if e.alert],
        "analyzers": [
            {"name": "long_share", "inputs": ["step", "turns"], "output": {"kind": "per_row"},
             "sql": "SELECT step, (turns > 40)::DOUBLE AS value FROM rollouts"},
            {"name": "calls_per_turn", "inputs": ["tool_calls", "turns"],
             "output": {"kind": "per_row"}, "rows": {"where": "turns > 0"},
             "python": "def calls_per_turn(rows, params):\n"
                       "    return [len(c) / t for c, t in zip(rows['tool_calls'], "
                       "rows['turns'])]\n"},
        ],
    }
    harness = parse_harness(doc)
    kinds = {m.name: _combinable(m)[0] for m in harness.metrics}
    assert kinds["long_share"] is kinds["calls_per_turn"] is None  # declared: in full
    assert kinds["response_length_p90_budget"] is None  # its own params
    assert kinds["idle_failure_rate"] == kinds["error_finish_ratio"] == "mean"
    assert kinds["reward_alignment"] is None  # keyed: one value per component, in full
    table = _run(600)
    full, _ = _grown_like_full(table, harness, (table.num_rows // 3 + 7, table.num_rows))
    assert full["metrics"]["calls_per_turn"] > 0


def test_a_mean_over_every_row_combines_without_points():
    """`SELECT avg(e) AS value FROM v WHERE c` (h2's val_tampered_ratio) combines from the
    same per-step partials as a mean by step, and has no per-step points, as in full."""
    h2 = resolve_harness("h2")
    assert _combinable(h2.metric("val_tampered_ratio"))[0] == "mean"
    table = _tampered(_run(1200))
    full, state = _grown_like_full(table, h2, (table.num_rows // 3 + 7, table.num_rows))
    assert full["metrics"]["val_tampered_ratio"] > 0
    assert "val_tampered_ratio" in state.partials


def test_every_prefix_of_a_run_reads_as_its_diagnosis_in_full():
    """diagnose_prefixes: at each recorded step, every metric an early stop of h2 reads
    where a rule counts its critical alerts (leak and tamper ratios of both splits, dead
    groups, the turns histogram, logprobs recorded from step 5 on only) and each series'
    latest point are what `diagnose` computes over the rows up to that step."""
    import dataclasses

    from evotrainer.agent.stop_replay import stop_inputs

    h2 = resolve_harness("h2")
    harness = stop_inputs(dataclasses.replace(h2, early_stop=(*h2.early_stop, dataclasses.replace(
        h2.early_stop[0], name="counted", when="critical_alerts > 1"))))
    table = _tampered(_run(1200))
    logprob = table.schema.get_field_index("mean_logprob")
    table = table.set_column(logprob, "mean_logprob", pc.if_else(
        pc.less(table.column("step"), 5), pa.scalar(None, pa.float64()),
        table.column("mean_logprob")))
    ends = sorted(set(table.column("step").to_pylist()))
    prefixes = diagnose_prefixes(table, None, harness, ends)
    assert prefixes is not None and len(prefixes) == len(ends) > 5
    for end, (metrics, latest) in zip(ends, prefixes, strict=True):
        full = diagnose(table.filter(pc.less_equal(table.column("step"), end)), None, harness)
        assert metrics.keys() == full["metrics"].keys()
        for name, value in full["metrics"].items():
            expected = value if value is None else pytest.approx(value, rel=1e-9, abs=1e-12)
            assert metrics[name] == expected, (end, name)
        assert latest.keys() == {n for n, points in full["series"].items() if points}, end
        for name, point in latest.items():
            assert point == pytest.approx(full["series"][name][-1], rel=1e-9), (end, name)
    assert prefixes[0][0]["mean_logprob"] is None
    assert prefixes[-1][0]["mean_logprob"] is not None
    assert prefixes[-1][0]["val_tampered_ratio"] > 0
    # A metric that does not combine (h0's avg_at_k joins the groups): no prefixes.
    assert diagnose_prefixes(table, None, H0, ends) is None
