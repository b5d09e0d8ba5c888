"""Diagnose a version's evidence with a harness revision.

A rollout id is `version/seed/split/step/group_id/sample_idx`: stable across re-ingests and
enough to find the row again in the version's rollout table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from evotrainer.diagnosis.analyzers import ANALYZERS, call_table, mean_by_step
from evotrainer.diagnosis.declared import AnalyzerRefused, AnalyzerRuns, run_declared
from evotrainer.diagnosis.harness import Alert, HarnessRevision, Level, Metric
from evotrainer.diagnosis.sql import (
    MEMORY_LIMIT,
    READS_CALLS,
    READS_GROUPS,
    ReadOnlyQuery,
    finite,
    fusable_query,
    fused_query,
    fused_value,
    keyed_result,
    metric_result,
    query_columns,
    rows_where,
    sql_params,
)
from evotrainer.errors import EvoError
from evotrainer.evidence.io import (
    encode_tool_calls,
    file_digest,
    is_verl_dump,
    read_rollouts,
    rollout_files,
    table_digest,
    val_scores,
)
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.store import cel


class ConnectionFactory(Protocol):
    """A read-only query connection over other rows of a split (an increment's new ones), with
    the diagnosis's limits."""

    def __call__(
        self, split: str, rows: pa.Table, calls: Callable[[], pa.Table]
    ) -> ReadOnlyQuery: ...


class Increment(Protocol):
    """What a diagnosis asks of an incremental pass (diagnosis/incremental.py builds one):
    a metric's value and series from carried partials, or None to compute it in full."""

    def metric(
        self, metric: Metric, rows: pa.Table, view: pa.Table, connect: ConnectionFactory
    ) -> tuple[float | None, list[list[float]]] | None: ...

    def combines(self, metric: Metric) -> bool:
        """Whether `metric` is computed from partials (so `diagnose` leaves it to `metric`)."""
        ...

    def close(self) -> None: ...


# A query's (columns, rows) by its split, its text and the params it binds, as JSON.
QueryRows = dict[tuple[str | None, str, str], tuple[list[str], list]]

# An alert's examples are looked for in the latest steps holding 1/256, then 1/16 of the rows,
# before all of them.
_EXAMPLE_WINDOWS = (256, 16)
ROLLOUT_ID_SQL = "concat_ws('/', version, seed, split, step, group_id, sample_idx) AS id"


def diagnose(
    rollouts: pa.Table | str | Path,
    steps: pa.Table | None,
    harness: HarnessRevision,
    parent_scores: pa.Table | None = None,
    *,
    scores: pa.Table | None = None,
    split: str = "train",
    timeout_s: float = 60.0,
    memory_limit: str = MEMORY_LIMIT,
    evidence_digest: str | None = None,
    increment: Increment | None = None,
    parent_comparison: dict | None = None,
    queries: QueryRows | None = None,
) -> dict:
    """Compute every metric, series, trend and alert of `harness` over the evidence.

    `parent_scores` (a per-task score table) feeds the version-layer comparison metrics,
    against `scores`, the candidate's recorded score table (default: its latest validation
    rollouts). `split` labels the rows of a verl dump folder. Each harness query runs within
    `timeout_s` and `memory_limit`. `evidence_digest` spares hashing evidence whose digest the
    caller holds. `increment` (see incremental.diagnose_incremental, which passes it) computes
    the metrics that combine from per-step partials from the new rows only.
    `parent_comparison`, the comparison with the parent where the caller holds it (the same
    gate procedure over the same score tables), stands for computing it. `queries` holds the
    rows of the queries an earlier diagnosis of the same evidence ran (a backtest diagnoses
    each version under two revisions): a metric's query that binds the same params is read
    back from it, and each one run is added."""
    # The evidence digest is hashed, and the analyzers run, on other threads while the
    # queries run: sha256, Arrow's IPC writer, numpy and DuckDB release the GIL, so each
    # costs little wall time beside the others instead of adding its whole pass to them.
    with ThreadPoolExecutor(max_workers=2) as background:
        digest: Future[str] | None = None
        if isinstance(rollouts, (str, Path)):
            path = Path(rollouts)
            files = sorted(path.glob("*.jsonl")) if is_verl_dump(path) else rollout_files(path)
            if evidence_digest is None:
                digest = background.submit(file_digest, files)
            needs_scores = parent_scores is not None and scores is None
            table = read_rollouts(
                path,
                split=split,
                columns=columns_read(harness, needs_scores),
                encoded_calls=True,
            )
        else:
            if evidence_digest is None:
                digest = background.submit(table_digest, rollouts, steps)
            # Calls coded as a Parquet file's are read: the analyzers start from the codes and
            # DuckDB converts codes, not every call's strings, for each query of the calls.
            # An increment codes only the rows it analyzes.
            table = rollouts if increment else encode_tool_calls(rollouts)
        run = _Run(table, steps, harness, timeout_s, memory_limit, increment, queries)
        try:
            if increment is None:  # an increment's analyzers see few rows: no thread needed
                run.start_analyzers(background)
            comparison = parent_comparison
            if comparison is None and parent_scores is not None:
                candidate = scores if scores is not None else val_scores(table)
                if candidate.num_rows:
                    # The one comparison with the parent, under the harness's gate procedure:
                    # the version-layer metrics read it and the gate decides on it.
                    comparison = harness.procedure.compare(parent_scores, candidate)
            metrics: dict[str, float | None] = {}
            series: dict[str, list[list[float]]] = {}
            gaps: list[dict[str, str]] = []
            for metric in harness.metrics:
                value, points, gap = run.metric(metric, comparison)
                metrics[metric.name] = value
                if metric.series:
                    series[metric.name] = points
                if value is None:
                    gaps.append(
                        {"metric": metric.name, "reason": gap or "not computable from the evidence"}
                    )
            alerts = [fired for alert in harness.alerts if (fired := run.alert(alert, metrics))]
            if digest is not None:
                evidence_digest = digest.result()
        finally:
            run.close()
    return {
        "harness": {"name": harness.name, "digest": harness.digest},
        "evidence_digest": evidence_digest,
        "versions": _versions(table.column("version")),
        "metrics": metrics,
        "layers": {m.name: m.layer for m in harness.metrics},
        "trends": {name: _slope(points) for name, points in series.items()},
        "series": series,
        # Only a revision with keyed metrics has the section: a diagnosis under one without
        # them reads as it always did.
        **({"keyed": run.keyed} if run.keyed else {}),
        "alerts": alerts,
        "gaps": gaps,
        "comparison": comparison,
    }


# What a diagnosis reads of every harness: the split and version of each row, and a rollout
# id's parts (alert examples).
_BASE_COLUMNS = ("version", "split", "seed", "step", "group_id", "sample_idx")
# The rollout columns the `groups` and `calls` views are made of (sql.GROUPS_SQL, call_table).
_GROUPS_READ = ("seed", "step", "group_id", "reward", "correct")
_CALLS_READ = ("seed", "step", "tool_calls")


def columns_read(harness: HarnessRevision, scores: bool = False) -> list[str] | None:
    """The rollout columns a diagnosis with `harness` reads (`scores`: and the validation
    score table, val_scores), or None for all of them: its queries' column references, as
    DuckDB parses them, the columns its metrics require and its analyzers declare."""
    everything = tuple(ROLLOUT_SCHEMA.names)
    read = set(_BASE_COLUMNS)
    if scores:
        read |= {"task_id", "data_source", "correct"}
    queries = [m.sql for m in harness.metrics if m.sql] + [
        f"SELECT 1 FROM rollouts WHERE ({a.sample_where})"
        for a in harness.alerts
        if a.sample_where is not None
    ]
    for sql in queries:
        named = query_columns(sql, everything)
        if named is None:
            return None
        read |= named
        read |= set(_GROUPS_READ) if READS_GROUPS.search(sql) else set()
        read |= set(_CALLS_READ) if READS_CALLS.search(sql) else set()
    for metric in harness.metrics:
        read |= set(metric.requires)
        if metric.analyzer in ANALYZERS:
            read |= set(ANALYZERS[metric.analyzer].columns)
    for declared in harness.analyzers:
        read |= set(declared.inputs) | {"step"}  # run_declared keys rows by step
        if declared.where is not None:
            named = query_columns(f"SELECT 1 FROM rollouts WHERE ({declared.where})", everything)
            if named is None:
                return None
            read |= named
    return [name for name in everything if name in read]


def diagnosis_document(diagnosis: dict, version: str | None = None) -> dict:
    """The `runs/<version>/diagnosis.yaml` document (kind: Diagnosis); `version` defaults to
    the rollouts' version label(s). Ordered for a reviewer: alerts and gaps first, then the
    comparison and the metric values; the per-step series, by far the longest part, last."""
    return {
        "apiVersion": "evotrainer/v1",
        "kind": "Diagnosis",
        "version": version or ",".join(diagnosis["versions"]),
        "harness": dict(diagnosis["harness"]),
        "evidence_digest": diagnosis["evidence_digest"],
        "alerts": diagnosis["alerts"],
        "gaps": diagnosis["gaps"],
        **({"comparison": diagnosis["comparison"]} if diagnosis.get("comparison") else {}),
        "metrics": {
            name: {
                "value": value,
                "layer": diagnosis["layers"][name],
                "trend": diagnosis["trends"].get(name),
            }
            for name, value in diagnosis["metrics"].items()
        },
        **({"keyed": diagnosis["keyed"]} if diagnosis.get("keyed") else {}),
        "series": diagnosis["series"],
    }


def _versions(column: pa.ChunkedArray) -> list[str]:
    """The distinct version labels, sorted: a run's rows almost always carry one, which a
    comparison with the first row finds without hashing every row."""
    if len(column) and column.null_count == 0:
        first = column[0]
        if pc.all(pc.equal(column, first)).as_py():
            return [first.as_py()]
    return sorted(v for v in pc.unique(column).to_pylist() if v is not None)


def _slope(points: list[list[float]]) -> float | None:
    if len({step for step, _ in points}) < 2:
        return None
    steps, values = np.array(points, dtype=float).T
    return float(np.polyfit(steps, values, 1)[0])


def fired_level(
    harness: HarnessRevision, alert: Alert, metrics: dict[str, float | None]
) -> Level | None:
    """The level `alert` fires at over `metrics`: the first of its levels (most severe
    first) whose condition holds, or None."""
    variables = {**metrics, "params": harness.params}
    for i, level in enumerate(alert.levels):
        field = f"alerts.{alert.name}.levels[{i}].when"
        if cel.holds(level.when, variables, where=harness.source, field=field):
            return level
    return None


class _Run:
    """One diagnosis: read-only query connections and split tables, made on first use."""

    def __init__(
        self,
        table: pa.Table,
        steps: pa.Table | None,
        harness: HarnessRevision,
        timeout_s: float,
        memory_limit: str = MEMORY_LIMIT,
        increment: Increment | None = None,
        queries: QueryRows | None = None,
    ) -> None:
        self.table, self.steps, self.harness = table, steps, harness
        self.increment = increment
        self.queries = queries
        self.timeout_s, self.memory_limit = timeout_s, memory_limit
        self.connections: dict[str | None, ReadOnlyQuery] = {}
        self.masks = {split: pc.equal(table.column("split"), split) for split in ("train", "val")}
        self.split_rows = {split: pc.sum(mask).as_py() or 0 for split, mask in self.masks.items()}
        self.rows: dict[str, pa.Table] = {}
        self.views: dict[str, pa.Table] = {}
        self.recorded: dict[tuple[str, str], int] = {}
        self.floors: dict[ReadOnlyQuery, list[int]] = {}
        # Metric name: its query's (columns, rows), from a query fused with others; and the
        # (split, key) of each fused query tried.
        self.fused: dict[str, tuple[list[str], list]] = {}
        self.fusions: set[tuple[str, str]] = set()
        # Metric name: its analyzer's (value, points), computed on another thread.
        self.analyzed: dict[str, Future[tuple[float | None, list[list[float]]]]] = {}
        # The declared analyzers' results and time budget, for this diagnosis.
        self.declared_runs = AnalyzerRuns(harness.name)
        # Keyed metric name: {key: value}, what the diagnosis records under `keyed`.
        self.keyed: dict[str, dict[str, float | None]] = {}

    def start_analyzers(self, pool: ThreadPoolExecutor) -> None:
        """Run the analyzer metrics on `pool` while the queries run here; `metric` collects
        each result, or its error, in harness order as before. The views are made here first,
        so both threads share them."""
        for metric in self.harness.metrics:
            # A declared analyzer queries this thread's connection: it runs here, in `metric`.
            if metric.analyzer in ANALYZERS and self.split_rows[metric.split]:
                self._view(metric.split)
                self.analyzed[metric.name] = pool.submit(self._analyzer, metric)

    def connection(self, split: str | None) -> ReadOnlyQuery:
        if split not in self.connections:
            self.connections[split] = self._connect(
                split,
                None if split is None else self._rows(split),
                # The analyzers' flattened calls, so the split's calls are flattened once.
                None if split is None else lambda: call_table(self._view(split)),
            )
        return self.connections[split]

    def _connect(
        self, split: str | None, rows: pa.Table | None, calls: Callable[[], pa.Table] | None
    ) -> ReadOnlyQuery:
        """A connection whose `rollouts` are `rows`, with this diagnosis's limits."""
        return ReadOnlyQuery(
            self.table,
            self.steps,
            split,
            timeout_s=self.timeout_s,
            memory_limit=self.memory_limit,
            rows=rows,
            calls=calls,
        )

    def close(self) -> None:
        for pending in self.analyzed.values():
            pending.cancel()
        for connection in self.connections.values():
            connection.close()
        if self.increment is not None:
            self.increment.close()

    def metric(
        self, metric: Metric, comparison: dict | None
    ) -> tuple[float | None, list[list[float]], str | None]:
        """(value, series points, gap reason when the value is null)."""
        if metric.comparison:
            if comparison is None:
                return None, [], "no parent scores to compare with"
            return finite(comparison[metric.comparison]), [], None
        if not self.split_rows[metric.split]:
            return None, [], f"no {metric.split} rollouts"
        if metric.requires:
            missing = self._unrecorded(metric.split, metric.requires)
            if missing:
                return None, [], f"{', '.join(missing)} not recorded in {metric.split} rollouts"
        field = f"metrics.{metric.name}"
        try:
            if metric.keyed:  # its rows are keys, not steps: nothing to combine or fuse
                columns, rows = self._query(
                    metric.split, metric.sql, self.harness.metric_params(metric), metric.name
                )
                self.keyed[metric.name] = keyed_result(columns, rows)
                values = [v for v in self.keyed[metric.name].values() if v is not None]
                return (min(values) if values else None), [], None
            combined = self.increment and self.increment.metric(
                metric, self._rows(metric.split), self._view(metric.split), self._connect
            )
            if combined:
                value, points = combined
            elif metric.sql:
                value, points = self._sql(metric)
            elif (declared := self.harness.declared(metric.analyzer)) is not None:
                value, points = run_declared(
                    declared,
                    self.connection(metric.split),  # the analyzer's rows.split (harness.py)
                    {**self.harness.params, **metric.analyzer_params},
                    timeout_s=self.timeout_s,
                    memory_limit=self.memory_limit,
                    runs=self.declared_runs,
                )
            elif metric.name in self.analyzed:
                value, points = self.analyzed.pop(metric.name).result()
            else:
                value, points = self._analyzer(metric)
        except AnalyzerRefused as err:  # this machine cannot isolate it: a gap, not a stop
            return None, [], err.message
        except EvoError as err:
            raise EvoError(
                err.message, where=self.harness.source, field=field, hint=err.hint
            ) from None
        return value, points, None

    def _unrecorded(self, split: str, columns: tuple[str, ...]) -> list[str]:
        if any(c not in self.table.column_names for c in columns):
            # Not a canonical table: let DuckDB name what is wrong.
            sql = "SELECT " + ", ".join(f"count({c})" for c in columns) + " FROM rollouts"
            _, rows = self.connection(split).query(sql, {}, field="requires")
            return [c for c, n in zip(columns, rows[0], strict=True) if n == 0]
        return [c for c in columns if self._recorded(split, c) == 0]

    def _recorded(self, split: str, column: str) -> int:
        """Non-null values of `column` in `split` (SQL count(column)), counted in Arrow: a
        DuckDB count would first convert the column, which for tool_calls is every call."""
        if (split, column) not in self.recorded:
            values = self.table.column(column)
            if self.split_rows[split] == self.table.num_rows:
                count = len(values) - values.null_count
            else:
                count = pc.sum(pc.and_(self.masks[split], pc.is_valid(values))).as_py() or 0
            self.recorded[split, column] = count
        return self.recorded[split, column]

    def _sql(self, metric: Metric) -> tuple[float | None, list[list[float]]]:
        if metric.name not in self.fused:
            self._fuse(metric)
        if metric.name in self.fused:
            columns, rows = self.fused.pop(metric.name)
        else:
            columns, rows = self._query(
                metric.split, metric.sql, self.harness.metric_params(metric), metric.name
            )
        return metric_result(columns, rows)

    def _query(
        self, split: str, sql: str, params: dict[str, Any], field: str
    ) -> tuple[list[str], list]:
        """A metric query's (columns, rows): read back from `queries` where a diagnosis of
        the same evidence ran the same text binding the same params (its rows depend on
        nothing else), else run and added there."""
        try:
            key = (split, sql, json.dumps({name: params.get(name) for name in sql_params(sql)},
                                          sort_keys=True))
        except TypeError:  # a param JSON cannot tell apart from others: run every time
            key = None
        if self.queries is None or key is None:
            return self.connection(split).query(sql, params, field=field)
        if key not in self.queries:
            self.queries[key] = self.connection(split).query(sql, params, field=field)
        return self.queries[key]

    def _fuse(self, metric: Metric) -> None:
        """Run `metric`'s query as one with those of every other metric of its split that reads
        the same rows alike (sql.fusable_query), so they cost one pass over the rows, not one
        each, and keep each one's (columns, rows) as its own query returns them. Where the
        fused query fails, each metric runs alone and reports its own error."""
        # A fused query binds the revision's params: a metric with its own runs alone.
        shape = metric.sql and not metric.params and fusable_query(metric.sql)
        if not shape or (metric.split, shape.key) in self.fusions:
            return
        self.fusions.add((metric.split, shape.key))
        members = [metric] + [
            other
            for other in self.harness.metrics
            if other is not metric
            and other.sql
            and not other.params
            and other.split == metric.split
            and (query := fusable_query(other.sql))
            and query.key == shape.key
            and self._runs_sql(other)
        ]
        if len(members) < 2:
            return
        try:
            columns, rows = self._query(
                metric.split,
                fused_query([fusable_query(m.sql) for m in members]),
                self.harness.params,
                metric.name,
            )
        except EvoError:
            return
        stepped = columns[0] == "step"
        if not stepped and len(rows) != 1:
            return  # not one aggregate row: each query says what is wrong with it
        for i, member in enumerate(members):
            at = columns.index(fused_value(i))
            self.fused[member.name] = (
                (["step", "value"], [(row[0], row[at]) for row in rows])
                if stepped
                else (["value"], [(row[at],) for row in rows])
            )

    def _runs_sql(self, metric: Metric) -> bool:
        """Whether `metric` reaches its query (see `metric`): rows to read, its required
        columns recorded, and no increment computing it from partials."""
        return (
            not metric.comparison
            and not metric.keyed
            and bool(self.split_rows[metric.split])
            and not (metric.requires and self._unrecorded(metric.split, metric.requires))
            and not (self.increment and self.increment.combines(metric))
        )

    def _rows(self, split: str) -> pa.Table:
        """The split's rows (zero-copy slices where it can), for its connection and analyzers."""
        if split not in self.rows:
            self.rows[split] = rows_where(self.table, self.masks[split])
        return self.rows[split]

    def _view(self, split: str) -> pa.Table:
        """The split's rows for analyzers and the `calls` view: one table object per split, so
        they share work keyed on it (see analyzers._calls)."""
        if split not in self.views:
            columns = ["split", "seed", "step"]
            for metric in self.harness.metrics:
                if metric.analyzer in ANALYZERS:
                    columns += [c for c in ANALYZERS[metric.analyzer].columns if c not in columns]
            if "tool_calls" in self.table.column_names and "tool_calls" not in columns:
                columns.append("tool_calls")
            self.views[split] = self._rows(split).select(columns)
        return self.views[split]

    def _analyzer(self, metric: Metric) -> tuple[float | None, list[list[float]]]:
        spec = ANALYZERS[metric.analyzer]
        view = self._view(metric.split)
        params = {**self.harness.params, **metric.analyzer_params}
        values = np.asarray(spec.fn(view, params), dtype=float)
        return mean_by_step(view.column("step").to_numpy(), values)

    def alert(self, alert: Alert, metrics: dict[str, float | None]) -> dict | None:
        level = fired_level(self.harness, alert, metrics)
        if level is None:
            return None
        metric = self.harness.metric(alert.metric)
        fired_on = self._fired_on(alert, level.when, metrics)
        return {
            "name": alert.name,
            "metric": fired_on,
            "layer": metric.layer,
            "severity": level.severity,
            "value": metrics[fired_on],
            "threshold": level.threshold,
            "message": alert.message,
            "examples": self._examples(alert, metric),
        }

    def _fired_on(self, alert: Alert, when: str, metrics: dict[str, float | None]) -> str:
        """The metric whose value alone makes `when` hold (the alert's own metric first), so
        `leak_ratio > 0.0 || val_leak_ratio > 0.0` firing on validation rollouts records
        val_leak_ratio and its value; the alert's metric when no single one suffices."""
        read = cel.names(when) & metrics.keys()
        for name in sorted(read, key=lambda n: (n != alert.metric, when.find(n))):
            if metrics[name] is None:
                continue
            alone = {**metrics, **{other: None for other in read - {name}}}
            if cel.evaluate_unless_null(when, {**alone, "params": self.harness.params}) is True:
                return name
        return alert.metric

    def _examples(self, alert: Alert, metric: Metric) -> list[str]:
        if alert.sample_where is None or alert.sample_limit <= 0:
            return []
        split = alert.sample_split or metric.split
        connection = self.connection(None if split == "all" else split)
        field = f"alerts.{alert.name}.sample.where"

        def sample(source: str) -> list[str]:
            sql = (
                f"SELECT {ROLLOUT_ID_SQL} FROM {source} WHERE ({alert.sample_where}) "
                f"ORDER BY step DESC, seed, group_id, sample_idx LIMIT {alert.sample_limit}"
            )
            try:
                _, rows = connection.query(sql, self.harness.params, field=field)
            except EvoError as err:
                raise EvoError(
                    err.message, where=self.harness.source, field=field, hint=err.hint
                ) from None
            return [r[0] for r in rows]

        # The examples are the latest matching rows, and `where` only decides row by row (SQL
        # allows no aggregate or window there; a subquery sees the whole view either way), so
        # when the latest steps alone hold `limit` matches they are the answer: try those
        # first, in windows 16 times larger each, rather than evaluate an expensive `where`
        # on every row.
        for floor in self._recent_floors(connection):
            found = sample(connection.recent_rows(floor))
            if len(found) == alert.sample_limit:
                return found
        return sample("rollouts")

    def _recent_floors(self, connection: ReadOnlyQuery) -> list[int]:
        """The lowest steps of the fewest latest steps holding 1/256 and 1/16 of the view's
        rows (each once, and none that is every step), counted once per view."""
        if connection not in self.floors:
            # Rows per step, latest first (Arrow counts them without a query).
            counts = pc.value_counts(pc.drop_null(connection.split_table.column("step")))
            rows = sorted(
                zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(),
                    strict=True),
                reverse=True,
            )
            total = sum(n for _, n in rows)
            floors: list[int] = []
            for share in _EXAMPLE_WINDOWS:
                seen = 0
                for step, n in rows[:-1]:
                    seen += n
                    if seen * share >= total:
                        floors += [int(step)] if int(step) not in floors else []
                        break
            self.floors[connection] = floors
        return self.floors[connection]
