"""One comparison with the parent (at the harness's gate.alpha) for diagnosis, gate and
harness backtest; one null-safe CEL evaluation; reviewable diagnosis records."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from standin import converge
from standin import propose as train

from evotrainer.control.reconcile import load_context
from evotrainer.diagnosis.diagnose import diagnose, diagnosis_document
from evotrainer.diagnosis.harness import parse_harness, resolve_harness
from evotrainer.diagnosis.sql import ReadOnlyQuery
from evotrainer.errors import EvoError
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.gate.decision import decide
from evotrainer.gate.harness_backtest import backtest_harness
from evotrainer.store.cel import evaluate_unless_null
from evotrainer.store.workspace import Workspace


@pytest.fixture
def recorded(workspace, standin) -> Workspace:
    train(workspace, "v1", standin_skill=0.65)
    converge(workspace)
    return workspace


def _revision(ws: Workspace, name: str, **changes):
    doc = yaml.safe_load((ws.root / "harness_revisions" / "h0.yaml").read_text())
    for key, value in changes.items():
        doc[key] = value(doc) if callable(value) else value
    doc["name"] = name
    path = ws.root / "harness_revisions" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return parse_harness(doc, source=str(path))


def test_the_gate_decides_at_the_harness_alpha(recorded) -> None:
    ctx = load_context(recorded)
    state = ctx.states["v1"]
    at_95 = decide(recorded, ctx.states, state, ctx.harness)["comparison"]
    loose = _revision(recorded, "h50", gate=lambda d: {**d["gate"], "alpha": 0.5})
    at_50 = decide(recorded, ctx.states, state, loose)["comparison"]
    assert at_95["confidence"] == pytest.approx(0.95) and at_50["confidence"] == 0.5
    # Same delta, a narrower interval: the revision's alpha reached the bootstrap.
    assert at_50["delta"] == pytest.approx(at_95["delta"], abs=1e-6)
    assert at_95["ci_low"] < at_50["ci_low"] <= at_50["ci_high"] < at_95["ci_high"]


def test_the_gate_reads_the_comparison_the_diagnosis_recorded(recorded) -> None:
    ctx = load_context(recorded)
    state = ctx.states["v1"]
    recorded_comparison = state.records["diagnosis"]["comparison"]
    assert recorded_comparison["confidence"] == pytest.approx(0.95)
    decision = decide(recorded, ctx.states, state, ctx.harness)
    assert decision["comparison"] == recorded_comparison
    metrics = state.records["diagnosis"]["metrics"]
    assert metrics["delta_ci_low"]["value"] == recorded_comparison["ci_low"]


def test_backtest_diagnoses_compare_with_the_parent_like_reconcile(recorded) -> None:
    # A revision with one more comparison metric: the backtest re-diagnoses every version,
    # and the new metric of v1 (a child) must be computed, not null.
    h1 = _revision(
        recorded,
        "h1",
        metrics=lambda d: [
            *d["metrics"],
            {"name": "parent_avg", "layer": "version", "split": "val", "comparison": "mean_a"},
        ],
    )
    report = backtest_harness(recorded, h1, "h0")
    values = {r["version"]: r["new_metric_values"]["parent_avg"] for r in report["versions"]}
    parent_avg = load_context(recorded).states["v1"].records["diagnosis"]["comparison"]["mean_a"]
    assert values["v0"] is None  # the root has no parent
    assert values["v1"] == pytest.approx(parent_avg, abs=1e-6)


def _leaky_val_only() -> dict:
    rows = [
        {"split": "val", "task_id": f"t{i}", "correct": 1.0, "reward": 1.0,
         "tool_calls": ["reveal 3"] if i < 2 else ["check 5"]}
        for i in range(8)
    ]
    return diagnose(rollout_table(rows), None, resolve_harness("h0"))


def test_an_alert_records_the_value_of_the_metric_that_fired_it() -> None:
    diagnosis = _leaky_val_only()
    assert diagnosis["metrics"]["leak_ratio"] is None  # no train rollouts (a warm start)
    [leak] = [a for a in diagnosis["alerts"] if a["name"] == "leak"]
    assert leak["metric"] == "val_leak_ratio"
    assert leak["value"] == pytest.approx(0.25)
    assert leak["layer"] == "behavior" and leak["severity"] == "critical"


def test_a_diagnosis_record_puts_alerts_first_and_series_last() -> None:
    document = diagnosis_document(_leaky_val_only(), "v0")
    keys = list(document)
    assert keys.index("alerts") < keys.index("metrics") and keys[-1] == "series"
    text = yaml.safe_dump(document, sort_keys=False)
    assert text.index("alerts:") < text.index("metrics:") < text.index("series:")


def test_null_metrics_never_decide() -> None:
    assert evaluate_unless_null("x > 1.0", {"x": None}) is None
    assert evaluate_unless_null("x > 1.0", {}) is None
    assert evaluate_unless_null("x > 1.0 || y > 1.0", {"x": None, "y": 2.0}) is True
    assert evaluate_unless_null("parent.x > 1.0", {"parent": {}}) is None
    assert evaluate_unless_null("x > 1.0 && y > 1.0", {"x": None, "y": 2.0}) is None
    # A broken expression over known values still fails loudly, params included.
    with pytest.raises(EvoError):
        evaluate_unless_null("x > 'a'", {"x": 2.0})
    with pytest.raises(EvoError):
        evaluate_unless_null("x > params.typo", {"x": 2.0, "params": {"limit": 1.0}})


def test_harness_queries_are_bounded_in_memory_and_threads() -> None:
    # An alert's sample.where is harness text run as SQL: one that collects every rollout's
    # text into a single value (40 MB here) fails at the limit, naming the alert, instead of
    # taking the machine's memory (a real string_agg reached 8.5 GB).
    doc = yaml.safe_load(Path(resolve_harness("h0").source).read_text())
    doc["name"] = "greedy"
    doc["alerts"] = [{
        "name": "always", "metric": "reward_mean", "severity": "warning", "when": "true",
        "sample": {"where": "(SELECT length(string_agg(repeat(a.prompt, 4), ',')) "
                            "FROM all_rollouts a, range(100000)) > 0", "limit": 1},
    }]
    doc.pop("early_stop", None)  # h0's early-stop rules name alerts this harness dropped
    harness = parse_harness(doc, source="greedy.yaml")
    table = rollout_table([{"prompt": "p" * 100, "reward": 1.0}])
    with pytest.raises(EvoError) as caught:
        diagnose(table, None, harness, memory_limit="16MB")
    assert "more than the 16MB" in caught.value.message
    assert caught.value.field == "alerts.always.sample.where"
    assert caught.value.where == "greedy.yaml"
    # The same query within a larger limit succeeds: the limit, not the query, refused it.
    [alert] = diagnose(table, None, harness, memory_limit="256MB")["alerts"]
    assert alert["examples"] == ["v0/0/train/1/t0/0"]

    connection = ReadOnlyQuery(table, None, "train", memory_limit="16MB", threads=1)
    _, [row] = connection.query(
        "SELECT current_setting('threads'), current_setting('temp_directory')", {}, field="x"
    )
    assert row == (1, "")  # one thread; nothing spills to disk
    connection.close()


def test_connections_sharing_the_database_see_only_their_own_rows_and_survive_a_timeout():
    # Every ReadOnlyQuery is a connection to one locked database: its views and temp tables are
    # its own, a query past its time is interrupted with a one-line error, and the other
    # connections (and later ones) go on working.
    mine = rollout_table([{"reward": 1.0}, {"reward": 1.0}])
    theirs = rollout_table([{"reward": 0.0}])
    first = ReadOnlyQuery(mine, None, "train", timeout_s=0.2)
    second = ReadOnlyQuery(theirs, None, "train", timeout_s=0.2)
    try:
        assert first.query("SELECT count(*), sum(reward) FROM rollouts", {}, field="x")[1] == [
            (2, 2.0)
        ]
        assert second.query("SELECT count(*) FROM groups", {}, field="x")[1] == [(1,)]
        assert first.query("SELECT count(*) FROM rollouts", {}, field="x")[1] == [(2,)]
        with pytest.raises(EvoError, match="ran longer than 0.2 s"):
            second.query("SELECT sum(hash(range)) FROM range(1000000000000)", {}, field="slow")
        assert first.query("SELECT count(*) FROM groups", {}, field="x")[1] == [(1,)]
        assert second.query("SELECT sum(reward) FROM rollouts", {}, field="x")[1] == [(0.0,)]
    finally:
        first.close()
        second.close()
    third = ReadOnlyQuery(theirs, None, "train")
    assert third.query("SELECT count(*) FROM rollouts", {}, field="x")[1] == [(1,)]
    third.close()


def test_a_forked_child_opens_databases_of_its_own():
    """The databases open when the process forks run their queries on worker threads the
    child does not have: the child's harness queries and SQL parses go to databases of its
    own (and finish), the inherited ones are set aside, and the parent's keep working."""
    import os

    from evotrainer.diagnosis import sql

    table = rollout_table([{"reward": 1.0}, {"reward": 0.0}])
    query = ReadOnlyQuery(table, None, "train", threads=2)
    assert query.query("SELECT count(*) FROM rollouts", {}, field="x")[1] == [(2,)]
    query.close()
    assert sql._parse("SELECT reward FROM rollouts") is not None
    inherited = dict(sql._DATABASES)
    assert None in inherited
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it ran, and leave without the parent's handlers
        try:
            child = ReadOnlyQuery(table, None, "train", threads=2)
            rows = child.query("SELECT sum(reward) FROM rollouts", {}, field="x")[1]
            parsed = sql._parse("SELECT sum(reward) FROM rollouts") is not None
            own = all(con is not inherited.get(key) for key, con in sql._DATABASES.items())
            os.write(write, f"{rows} {parsed} {own} {len(sql._INHERITED)}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        assert answer.read() == f"[(1.0,)] True True {len(inherited)}"
    os.waitpid(pid, 0)
    again = ReadOnlyQuery(table, None, "train", threads=2)
    assert again.query("SELECT count(*) FROM rollouts", {}, field="x")[1] == [(2,)]
    again.close()
    assert inherited == sql._DATABASES


def test_a_second_diagnosis_of_the_same_evidence_reads_back_the_queries_it_shares(
        monkeypatch) -> None:
    """`diagnose(queries=)`: a diagnosis under a second revision runs only the metric
    queries the first did not run with the same params (an alert's examples are looked for
    by each), and equals its diagnosis made alone; a query whose params differ runs again
    and reads them."""
    import dataclasses

    import pyarrow as pa

    from evotrainer.diagnosis.diagnose import ROLLOUT_ID_SQL
    from evotrainer.diagnosis.harness import Metric
    from evotrainer.evidence.synthetic import random_rollouts

    table = random_rollouts(600, steps=6)
    val = random_rollouts(80, steps=2, seed=2)
    table = pa.concat_tables([table, val.set_column(
        val.schema.get_field_index("split"), "split", pa.array(["val"] * 80))])
    h0, h2 = resolve_harness("h0"), resolve_harness("h2")
    run: list[str] = []
    query = ReadOnlyQuery.query
    monkeypatch.setattr(ReadOnlyQuery, "query",
                        lambda self, sql, params, **kw: (run.append(sql),
                                                         query(self, sql, params, **kw))[1])

    def metric_queries() -> set[str]:
        made = {sql for sql in run if ROLLOUT_ID_SQL not in sql}
        del run[:]
        return made

    alone = diagnose(table, None, h2)
    alone_queries = metric_queries()
    shared: dict = {}
    diagnose(table, None, h0, queries=shared)
    h0_queries = metric_queries()
    _same_diagnosis(diagnose(table, None, h2, queries=shared), alone)
    h2_queries = metric_queries()
    assert h2_queries and h2_queries == alone_queries - h0_queries
    # The same text binding another value is another query.
    scaled = Metric("scaled_reward", "behavior", "train",
                    sql="SELECT avg(reward) * $scale AS value FROM rollouts")
    once, twice = (dataclasses.replace(h0, metrics=(*h0.metrics, scaled),
                                       params={**h0.params, "scale": scale})
                   for scale in (1.0, 2.0))
    first = diagnose(table, None, once, queries=shared)
    metric_queries()
    second = diagnose(table, None, twice, queries=shared)
    again = metric_queries()  # the query that binds $scale (fused with others) alone
    assert len(again) == 1 and "$scale" in again.pop()
    assert second["metrics"]["scaled_reward"] == \
        pytest.approx(2 * first["metrics"]["scaled_reward"])


def _same_diagnosis(one: dict, other: dict) -> None:
    """Equal, numbers to the last few bits: DuckDB sums in parallel, so one query run twice
    may differ there."""
    assert one.keys() == other.keys()
    for key in one:
        if key == "series":
            assert one[key].keys() == other[key].keys()
            for name, points in one[key].items():
                assert [x for p in points for x in p] == pytest.approx(
                    [x for p in other[key][name] for x in p]), name
        elif key in ("metrics", "trends"):
            assert one[key] == pytest.approx(other[key]), key
        else:
            assert one[key] == other[key], key
