"""Incremental diagnosis of a growing run: the work is proportional to the new rows.

Most harness metrics are a mean over rows or groups (`SELECT step, avg(e) ... GROUP BY
ROLLUP (step)`, every analyzer), an entropy of values (`SELECT entropy(e) AS value FROM v`),
a correlation per step (`SELECT step, corr(x, y) ...`) or counts, sums, means, extremes and
quantiles of one integer column (turns_p90, turns_max, turns_mean with its subquery). Their
value over a union of steps combines from per-(seed, step) partials: sum and count for a
mean, value counts for an entropy or an integer column, co-moments for a correlation.
`DiagnosisState` keeps those partials with the row count of each (split, seed, step) they
cover; the next diagnosis recomputes partials only for the (split, seed, step) keys whose row
count changed (new steps, and the step a run was still writing), reuses the rest, and
computes every other metric (a join, a float's quantile) over all rows as `diagnose` does.
The result equals `diagnose`'s: to the bit for an integer column's values, up to the
floating-point order of the sums for a mean, and within about 1e-13 relative for a
correlation (combined co-moments, as DuckDB combines its threads').

The promise holds while rows of a (split, seed, step) only ever get added: a key whose row
count is unchanged is trusted, so rewriting old rows in place needs a fresh state (None).

A state is saved between processes as JSON (`DiagnosisState.to_json` / `from_json`: no
pickle, so a state file can never run code); a live run keeps it under
`.evotrainer/live/<version>/` (control/live.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from evotrainer.diagnosis.analyzers import ANALYZERS, call_table
from evotrainer.diagnosis.harness import HarnessRevision, Metric
from evotrainer.diagnosis.sql import ReadOnlyQuery, fusable_query, rows_where
from evotrainer.errors import EvoError
from evotrainer.evidence.io import encode_tool_calls

if TYPE_CHECKING:
    from evotrainer.diagnosis.diagnose import ConnectionFactory

Key = tuple[int, int]  # (seed, step)

_FLAGS = re.IGNORECASE | re.DOTALL
_MEAN_SQL = re.compile(
    r"^\s*SELECT\s+step\s*,\s*avg\((?P<expr>.*)\)\s+AS\s+value\s+FROM\s+(?P<view>rollouts|groups)"
    r"(?:\s+WHERE\s+(?P<where>.*?))?\s+GROUP\s+BY\s+ROLLUP\s*\(\s*step\s*\)\s*;?\s*$",
    _FLAGS,
)
# A mean over every row, without per-step points (`SELECT avg(e) AS value FROM v WHERE c`): its
# partials are the same; its WHERE may hold no clause that changes the query's shape.
_PLAIN_MEAN_SQL = re.compile(
    r"^\s*SELECT\s+avg\((?P<expr>.*)\)\s+AS\s+value\s+FROM\s+(?P<view>rollouts|groups)"
    r"(?:\s+WHERE\s+(?P<where>.*?))?\s*;?\s*$",
    _FLAGS,
)
_CLAUSE = re.compile(
    r"\b(group|order|limit|offset|having|qualify|window|union|intersect|except)\b", re.IGNORECASE
)
_CORR_SQL = re.compile(
    r"^\s*SELECT\s+step\s*,\s*corr\((?P<args>.*)\)\s+AS\s+value\s+FROM\s+(?P<view>rollouts|groups)"
    r"(?:\s+WHERE\s+(?P<where>.*?))?\s+GROUP\s+BY\s+ROLLUP\s*\(\s*step\s*\)\s*;?\s*$",
    _FLAGS,
)
_ENTROPY_SQL = re.compile(
    r"^\s*SELECT\s+entropy\((?P<expr>.*)\)\s+AS\s+value\s+FROM\s+(?P<view>rollouts|calls)\s*;?\s*$",
    _FLAGS,
)
# A part that reads another relation (a subquery, a join) sees more than its own step's rows.
_READS_RELATION = re.compile(r"\b(select|from|join|all_rollouts|steps)\b", re.IGNORECASE)
# An entropy over more distinct values than this per key is not worth carrying: recompute it.
_MAX_ENTROPY_VALUES = 10_000
# The prefix of a fused partial query's columns: harness SQL may not name it (see _fuse).
_FUSED_ALIAS = "__evotrainer_partial_"


@dataclass
class DiagnosisState:
    """What `diagnose_incremental` carries from one diagnosis of a run to the next: for the
    harness `harness_digest`, the rows seen per (split, seed, step), and each combinable
    metric's partial per (seed, step): (sum, count) for a mean, {value: count} for an
    entropy or an integer column's histogram, (n, mean x, mean y, Sxx, Syy, Sxy) for a
    correlation."""

    harness_digest: str
    rows: dict[str, dict[Key, int]] = field(default_factory=dict)
    partials: dict[str, dict[Key, Any]] = field(default_factory=dict)

    def to_json(self) -> str | None:
        """The state as JSON text; None when an entropy partial counts a value JSON cannot
        carry as it is (a date, a decimal): the next diagnosis then starts afresh, which
        is correct, where a half-saved state would not be."""
        partials: dict[str, list] = {}
        for name, by_key in self.partials.items():
            entries = []
            for (seed, step), partial in by_key.items():
                if isinstance(partial, dict):  # an entropy's {value: count}
                    if not all(_json_exact(v) for v in partial):
                        return None
                    entries.append([seed, step, "counts", [[v, n] for v, n in partial.items()]])
                else:  # a mean's (sum, count) or a correlation's moments
                    kind = "moments" if len(partial) == 6 else "mean"
                    entries.append([seed, step, kind, list(partial)])
            partials[name] = entries
        return json.dumps(
            {
                "harness_digest": self.harness_digest,
                "rows": {
                    split: [[seed, step, n] for (seed, step), n in counts.items()]
                    for split, counts in self.rows.items()
                },
                "partials": partials,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> DiagnosisState | None:
        """A state from `to_json`'s text; None when the text is not one (start afresh)."""
        try:
            data = json.loads(text)
            rows = {
                split: {(seed, step): int(n) for seed, step, n in entries}
                for split, entries in data["rows"].items()
            }
            partials: dict[str, dict[Key, Any]] = {}
            for name, entries in data["partials"].items():
                partials[name] = {
                    (seed, step): (
                        {value: int(n) for value, n in partial}
                        if kind == "counts"
                        else (int(partial[0]), *(float(m) for m in partial[1:]))
                        if kind == "moments"
                        else (float(partial[0]), int(partial[1]))
                    )
                    for seed, step, kind, partial in entries
                }
            return cls(str(data["harness_digest"]), rows, partials)
        except (ValueError, KeyError, TypeError, IndexError):
            return None


def _json_exact(value: Any) -> bool:
    """Whether `value` comes back from JSON as an equal, hashable value of the same type."""
    return value is None or isinstance(value, (str, bool, int, float))


def diagnose_incremental(
    rollouts: pa.Table,
    steps: pa.Table | None,
    harness: HarnessRevision,
    state: DiagnosisState | None = None,
    **options: Any,
) -> tuple[dict, DiagnosisState]:
    """Diagnose `rollouts`, every row the run has so far, reusing `state` from the previous
    diagnosis of the same run (None the first time); return the diagnosis (what `diagnose`
    returns for the same arguments) and the state for the next call. `options` are
    `diagnose`'s keywords (parent_scores, scores, timeout_s, memory_limit, evidence_digest).
    A state made for another harness revision is ignored."""
    from evotrainer.diagnosis.diagnose import diagnose

    if state is None or state.harness_digest != harness.digest:
        state = DiagnosisState(harness.digest)
    increment = Increment(harness, state)
    diagnosis = diagnose(rollouts, steps, harness, increment=increment, **options)
    return diagnosis, increment.next_state()


# A prefix's metrics, and the latest point of each series metric that has one.
Prefix = tuple[dict[str, float | None], dict[str, list[float]]]


def diagnose_prefixes(
    rollouts: pa.Table, steps: pa.Table | None, harness: HarnessRevision, ends: list[int]
) -> list[Prefix] | None:
    """For each step in `ends` (ascending), the metrics `diagnose_incremental` computes over
    the rows up to it (every split's rows with `step <= end`) and each series' latest point
    (what a live look reads of a series), from one pass over the rows: each metric's
    partials per (seed, step) are computed once and merged step by step. A metric comparing
    with a parent is null (there is none). None when a metric does not combine (a join, a
    float's quantile, a keyed or a declared analyzer): diagnose each prefix then."""
    metrics = [m for m in harness.metrics if not m.comparison]
    if any(_combinable(m)[0] is None for m in metrics):
        return None
    rollouts = rollouts.filter(pc.is_valid(rollouts["step"]))  # no prefix holds a null step
    _, state = diagnose_incremental(rollouts, steps, harness)
    prefixes: list[Prefix] = [({m.name: None for m in harness.metrics}, {}) for _ in ends]
    for metric in metrics:
        counted = state.rows.get(metric.split, {})
        partials = state.partials.get(metric.name)
        recorded_from = max((_first_step(rollouts, metric.split, c) for c in metric.requires),
                            key=lambda step: math.inf if step is None else step, default=None)
        if recorded_from is None and metric.requires:
            continue  # a column it requires is never recorded: null at every step
        if partials is None:
            if counted:
                return None  # its split has rows and columns, yet it did not combine
            continue
        kind = _combinable(metric)[0]
        # The first step with a value: rows of its split, and every column it requires.
        first_row = min((step for _, step in counted), default=None)
        start = None if first_row is None else first_row if recorded_from is None else \
            max(first_row, recorded_from)
        by_step: dict[int, list[Any]] = {}
        for (_, step), part in partials.items():
            by_step.setdefault(step, []).append(part)
        pending = sorted(by_step)
        merged: Any = None
        latest: list[float] | None = None
        for end, (values, points) in zip(ends, prefixes, strict=True):
            while pending and pending[0] <= end:
                step = pending.pop(0)
                here = _merged(kind, by_step[step])
                merged = here if merged is None else _merged(kind, [merged, here])
                if kind != "histogram":
                    latest = next(iter(_combine(kind, {(0, step): here})[1]), None) or latest
            if start is None or end < start:
                continue  # no rows of its split yet, or not its required columns
            whole = {(0, None): merged} if merged is not None else {}
            if kind == "histogram":
                value, latest = _latest_histogram(metric.sql, by_step, whole, end)
            else:
                value = _combine(kind, whole)[0]
            values[metric.name] = value
            if metric.series and _per_step(metric) and latest is not None:
                points[metric.name] = latest
    return prefixes


def _merged(kind: str, parts: list[Any]) -> Any:
    """One partial of `kind` for the union of the rows of `parts`."""
    if kind == "mean":
        return (sum(total for total, _ in parts), sum(n for _, n in parts))
    if kind == "moments":
        return _merge_moments(parts)
    return _merge(parts)  # an entropy's or a histogram's value counts


def _latest_histogram(
    sql: str, by_step: dict[int, list[dict]], whole: dict[Key, Any], end: int
) -> tuple[float | None, list[float] | None]:
    """(value, latest point) of a histogram query over the steps up to `end`, `whole` their
    merged histogram: each step's point reads `whole` (a scalar subquery's rows)."""
    everything = whole[0, None] if whole else {}
    value, _ = _from_histograms(sql, {}, everything)
    for step in sorted((s for s in by_step if s <= end), reverse=True):
        _, points = _from_histograms(sql, {(0, step): _merge(by_step[step])}, everything)
        if points:
            return value, points[-1]
        if not _histogram_query(sql)[1]:
            break  # not per step: no points at all
    return value, None


def _first_step(rollouts: pa.Table, split: str, column: str) -> int | None:
    """The first step at which `column` holds a value in `split`'s rows, or None."""
    if column not in rollouts.column_names:
        return None
    holds = pc.and_(pc.equal(rollouts["split"], split), pc.is_valid(rollouts[column]))
    return pc.min(rollouts["step"].filter(holds)).as_py()


class Increment:
    """One incremental diagnosis: the changed rows of each split and the partials of the
    combinable metrics, recomputed for those rows and combined with the carried ones."""

    def __init__(self, harness: HarnessRevision, state: DiagnosisState) -> None:
        self.harness, self.state = harness, state
        self.rows: dict[str, dict[Key, int]] = {}
        self.partials: dict[str, dict[Key, Any]] = {}
        self.changed: dict[str, tuple[pa.Table, pa.Table]] = {}  # split: (rows, analyzer view)
        # split: (_key_codes's row codes and keys, the number of codes)
        self.codes: dict[str, tuple[np.ndarray, dict[int, Key], int]] = {}
        self.connections: dict[str, ReadOnlyQuery] = {}
        # Metric name: its mean partials, from one query with the others of its rows (_fuse);
        # and the (split, view, where) of each such query tried.
        self.fused: dict[str, dict[Key, Any]] = {}
        self.fusions: set[tuple[str, str]] = set()
        # (split, partial SQL): its partials, for metrics that share one (a column's histogram).
        self.counted: dict[tuple[str, str], dict[Key, Any]] = {}
        # (split, partial SQL): the merge of every key's histogram, for the same metrics.
        self.merged: dict[tuple[str, str], dict[int, int]] = {}

    def metric(
        self, metric: Metric, rows: pa.Table, view: pa.Table, connect: ConnectionFactory
    ) -> tuple[float | None, list[list[float]]] | None:
        """(value, series points) of `metric` from partials, or None when it does not combine.
        `rows` and `view` are the split's rows and its analyzer view in the full diagnosis;
        `connect` opens a connection with the diagnosis's limits over the new rows."""
        kind, sql = _combinable(metric)
        if kind is None:
            return None
        split = metric.split
        counts = self._counts(split, rows)
        changed_rows, changed_view = self._changed(split, rows, view, counts)
        if metric.analyzer:
            fresh = _analyzer_partials(metric, changed_view, self.harness.params)
        else:
            if split not in self.connections:
                self.connections[split] = connect(
                    split, changed_rows, lambda: call_table(changed_view)
                )
            if kind == "histogram":
                column = _histogram_query(metric.sql)[0]
                if column not in rows.column_names or not pa.types.is_integer(
                    rows.schema.field(column).type
                ):
                    return None  # a float's histogram is every row: recompute
            if metric.name not in self.fused:
                self._fuse(metric)
            if metric.name in self.fused:
                fresh = self.fused.pop(metric.name)
            else:
                # Metrics of one column's histogram share its query.
                if (split, sql) not in self.counted:
                    connection = self.connections[split]
                    _, result = connection.query(sql, self.harness.params, field=metric.name)
                    self.counted[split, sql] = _sql_partials(kind, result)
                fresh = self.counted[split, sql]
            if kind in ("entropy", "histogram") and any(
                len(v) > _MAX_ENTROPY_VALUES for v in fresh.values()
            ):
                return None
        carried = self.state.partials.get(metric.name, {})
        seen = self.state.rows.get(split, {})
        partials = {
            key: fresh[key] if key in fresh else carried[key]
            for key, n in counts.items()
            if key in fresh or (seen.get(key) == n and key in carried)
        }
        self.partials[metric.name] = partials
        if kind == "histogram":
            if (split, sql) not in self.merged:
                self.merged[split, sql] = _merge(partials.values())
            return _from_histograms(metric.sql, partials, self.merged[split, sql])
        value, points = _combine(kind, partials)
        return value, points if _per_step(metric) else []

    def _fuse(self, metric: Metric) -> None:
        """Compute the mean partials of `metric` and of every other mean of its split over
        the same view in one query, not one pass each: each one's WHERE becomes its
        aggregates' FILTER. Where that query fails, each metric's own query runs and reports
        its own error."""
        rows = _mean_rows(metric)
        if rows is None or (metric.split, rows[1]) in self.fusions:
            return
        self.fusions.add((metric.split, rows[1]))
        members = {
            other.name: other_rows
            for other in self.harness.metrics
            if other.split == metric.split
            and (other_rows := _mean_rows(other)) is not None
            and other_rows[1] == rows[1]
        }
        if len(members) < 2 or any(_FUSED_ALIAS in f"{e} {w}" for e, _, w in members.values()):
            return
        sums = ", ".join(
            f"sum({expr}){only} AS {_FUSED_ALIAS}t{i}, count({expr}){only} AS {_FUSED_ALIAS}n{i}"
            for i, (expr, _, where) in enumerate(members.values())
            for only in [f" FILTER (WHERE {where})" if where else ""]
        )
        sql = f"SELECT seed, step, {sums} FROM {rows[1]} GROUP BY seed, step"
        try:
            _, result = self.connections[metric.split].query(
                sql, self.harness.params, field=metric.name
            )
        except EvoError:
            return
        for i, name in enumerate(members):
            # A key none of whose rows pass the metric's WHERE has n = 0: it adds nothing.
            self.fused[name] = _sql_partials(
                "mean", [(r[0], r[1], r[2 + 2 * i], r[3 + 2 * i]) for r in result]
            )

    def combines(self, metric: Metric) -> bool:
        return _combinable(metric)[0] is not None

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()

    def next_state(self) -> DiagnosisState:
        return DiagnosisState(self.harness.digest, self.rows, self.partials)

    def _counts(self, split: str, rows: pa.Table) -> dict[Key, int]:
        """The split's rows per (seed, step), from one coding pass (kept for _changed)."""
        if split not in self.rows:
            codes, keys, counts = _key_codes(rows)
            self.rows[split] = {key: int(counts[code]) for code, key in keys.items()}
            self.codes[split] = (codes, keys, len(counts))
        return self.rows[split]

    def _changed(
        self, split: str, rows: pa.Table, view: pa.Table, counts: dict[Key, int]
    ) -> tuple[pa.Table, pa.Table]:
        """The split's rows (and analyzer view) whose (seed, step) has rows not yet covered by
        the state; a null step is always recomputed."""
        if split not in self.changed:
            seen = self.state.rows.get(split, {})
            codes, keys, size = self.codes[split]
            stale = np.zeros(size, dtype=bool)
            for code, key in keys.items():
                stale[code] = key[1] is None or seen.get(key) != counts[key]
            if not stale[list(keys)].all():
                rows = rows_where(rows, stale[codes])
            # Calls coded as the full diagnosis codes them (evidence.io.encode_tool_calls),
            # here only the rows analyzed.
            rows = encode_tool_calls(rows)
            self.changed[split] = (rows, rows.select(view.column_names))
        return self.changed[split]


def _key_codes(rows: pa.Table) -> tuple[np.ndarray, dict[int, Key], np.ndarray]:
    """(a code per row, the (seed, step) of each code in use, None for a null; the rows per
    code): one pass over the rows, where grouping by the two columns hashes every row."""
    (seed, seed_of, _), (step, step_of, step_width) = (
        _value_codes(rows.column(name)) for name in ("seed", "step")
    )

    def key(code: int) -> Key:
        s, t = divmod(int(code), step_width)
        return seed_of(s), step_of(t)

    codes = seed * step_width + step
    if int(codes.max(initial=0)) <= 4 * len(codes) + 1024:  # dense: count by code
        counts = np.bincount(codes)
        return codes, {int(c): key(c) for c in np.flatnonzero(counts)}, counts
    used, codes, counts = np.unique(codes, return_inverse=True, return_counts=True)
    return codes, {i: key(c) for i, c in enumerate(used)}, counts


def _value_codes(column: pa.ChunkedArray) -> tuple[np.ndarray, Callable[[int], Any], int]:
    """(a code per value in range(width), the value of a code (None for null), width): the
    value less the lowest where values are dense, else its rank among the distinct values, so
    two columns' codes combine into one int64 without overflow."""
    extremes = pc.min_max(column)
    low, high = (extremes["min"].as_py() or 0), (extremes["max"].as_py() or 0)
    null = pc.is_null(column).to_numpy(zero_copy_only=False) if column.null_count else None
    values = pc.fill_null(column, low).to_numpy().astype(np.int64, copy=False)
    if high - low <= 2 * len(values) + 1024:
        width = high - low + 2  # the last code is null
        return (
            values - low if null is None else np.where(null, width - 1, values - low),
            lambda c: None if c == width - 1 else c + low,
            width,
        )
    distinct, rank = np.unique(values, return_inverse=True)
    return (
        rank if null is None else np.where(null, len(distinct), rank),
        lambda c: None if c == len(distinct) else int(distinct[c]),
        len(distinct) + 1,
    )


def _mean_rows(metric: Metric) -> tuple[str, str, str | None] | None:
    """(expression averaged, view, WHERE) of a mean query whose partials combine, or None."""
    if not metric.sql:
        return None
    mean = _MEAN_SQL.match(metric.sql)
    if mean is None:
        mean = _PLAIN_MEAN_SQL.match(metric.sql)
        if mean is None or _CLAUSE.search(mean["where"] or ""):
            return None
    expr, view, where = mean["expr"], mean["view"], mean["where"]
    if re.match(r"\s*distinct\b", expr, re.IGNORECASE):
        return None  # a mean of distinct values: no per-step partial combines into it
    if not _balanced(expr) or not _balanced(where or "") or any(
        _READS_RELATION.search(p or "") for p in (expr, where)
    ):
        return None
    return expr, view.lower(), where


def _per_step(metric: Metric) -> bool:
    """Whether `metric`'s value comes with per-step points (a plain mean's does not)."""
    return not metric.sql or _PLAIN_MEAN_SQL.match(metric.sql) is None


def _combinable(metric: Metric) -> tuple[str | None, str]:
    """(partial kind, SQL computing the partials per (seed, step)) or (None, "")."""
    if metric.keyed:  # one value per key over every row: computed in full
        return None, ""
    if metric.analyzer:
        # A declared analyzer (not registered) sees its rows in one piece: computed in full.
        return ("mean", "") if metric.analyzer in ANALYZERS else (None, "")
    if not metric.sql or metric.params:  # partial queries bind the revision's params
        return None, ""
    if (mean := _mean_rows(metric)) is not None:
        expr, view, where = mean
        condition = f" WHERE {where}" if where else ""
        return "mean", (
            f"SELECT seed, step, sum({expr}) AS total, count({expr}) AS n "
            f"FROM {view}{condition} GROUP BY seed, step"
        )
    if (corr := _CORR_SQL.match(metric.sql)) is not None:
        pair, view, where = _top_level_pair(corr["args"]), corr["view"], corr["where"]
        if pair and not any(_READS_RELATION.search(p or "") for p in (*pair, where)):
            x, y = pair
            condition = f" WHERE {where}" if where else ""
            # Per key the co-moments of the rows where both are non-null, as corr reads them.
            return "moments", (
                f"SELECT seed, step, regr_count({y}, {x}), regr_avgx({y}, {x}), "
                f"regr_avgy({y}, {x}), regr_sxx({y}, {x}), regr_syy({y}, {x}), "
                f"regr_sxy({y}, {x}) FROM {view}{condition} GROUP BY seed, step"
            )
    if (histogram := _histogram_query(metric.sql)) is not None:
        column = histogram[0]
        return "histogram", (
            f"SELECT seed, step, {column} AS v, count(*) AS n FROM rollouts "
            f"WHERE {column} IS NOT NULL GROUP BY seed, step, v"
        )
    if (entropy := _ENTROPY_SQL.match(metric.sql)) is not None:
        expr, view = entropy["expr"], entropy["view"]
        if _balanced(expr) and not _READS_RELATION.search(expr):
            return "entropy", (
                f"SELECT seed, step, ({expr}) AS v, count(*) AS n FROM {view} "
                f"WHERE ({expr}) IS NOT NULL GROUP BY seed, step, v"
            )
    return None, ""


def _top_level_pair(args: str) -> tuple[str, str] | None:
    """`args` split at its one comma outside parentheses and quotes, or None."""
    depth, quoted, commas = 0, False, []
    for i, char in enumerate(args):
        if char == "'":
            quoted = not quoted
        elif not quoted:
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth < 0:
                return None
            if char == "," and depth == 0:
                commas.append(i)
    if depth or quoted or len(commas) != 1:
        return None
    return args[: commas[0]].strip(), args[commas[0] + 1 :].strip()


def _balanced(expr: str) -> bool:
    """Whether `expr` is one parenthesised argument (so `avg(a) + avg(b)` is not taken)."""
    depth = 0
    for char in expr:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


def _analyzer_partials(metric: Metric, view: pa.Table, params: dict) -> dict[Key, Any]:
    spec = ANALYZERS[metric.analyzer]
    values = np.asarray(spec.fn(view, {**params, **metric.analyzer_params}), dtype=float)
    per_row = pa.table(
        {
            "seed": view.column("seed"),
            "step": view.column("step"),
            "v": pa.array(values, from_pandas=True),  # NaN (row left out) becomes null
        }
    )
    grouped = per_row.group_by(["seed", "step"]).aggregate([("v", "sum"), ("v", "count")])
    columns = (grouped.column(c).to_pylist() for c in ("seed", "step", "v_sum", "v_count"))
    return {
        (seed, step): (total or 0.0, n)
        for seed, step, total, n in zip(*columns, strict=True)
    }


def _sql_partials(kind: str, rows: list) -> dict[Key, Any]:
    partials: dict[Key, Any] = {}
    if kind == "mean":
        for seed, step, total, n in rows:
            partials[seed, step] = (float(total or 0), int(n))
        return partials
    if kind == "moments":
        for seed, step, n, *moments in rows:
            partials[seed, step] = (int(n), *(float(m or 0) for m in moments))
        return partials
    for seed, step, value, n in rows:
        partials.setdefault((seed, step), {})[value] = int(n)
    return partials


class _NotFromHistogram(Exception):
    """A query part the histogram evaluator does not compute."""


# What a query computed from one integer column's histogram may use (DuckDB's semantics).
_AGGREGATES = ("count", "sum", "avg", "min", "max", "quantile_cont")
_COMPARISONS = {
    "COMPARE_GREATERTHAN": lambda a, b: a > b,
    "COMPARE_GREATERTHANOREQUALTO": lambda a, b: a >= b,
    "COMPARE_LESSTHAN": lambda a, b: a < b,
    "COMPARE_LESSTHANOREQUALTO": lambda a, b: a <= b,
    "COMPARE_EQUAL": lambda a, b: a == b,
    "COMPARE_NOTEQUAL": lambda a, b: a != b,
}


@lru_cache(maxsize=256)
def _histogram_query(sql: str) -> tuple[str, bool, str] | None:
    """(column, per step, value expression as parsed JSON) of a query of the shapes
    sql.fusable_query takes, over `rollouts` without WHERE, whose value is built of
    constants, comparisons, CASE, a cast to DOUBLE, count/sum/avg/min/max/quantile_cont of
    one column, and scalar subqueries of the same over `rollouts` (turns_p90, turns_max,
    turns_mean): its value over any set of rows is computed exactly from the column's
    histogram ({value: count}) over them."""
    shape = fusable_query(sql)
    if shape is None:
        return None
    kind, plain, where = json.loads(shape.key)
    if where is not None or plain["from_table"].get("table_name") != "rollouts":
        return None
    columns: set[str] = set()
    try:
        _walk(json.loads(shape.value), columns, check_only=True)
    except _NotFromHistogram:
        return None
    if len(columns) != 1:
        return None
    return columns.pop(), kind == "rollup", shape.value


def _from_histograms(
    sql: str, partials: dict[Key, Any], everything: dict[int, int] | None = None
) -> tuple[float | None, list[list[float]]]:
    """(value, per-step points) of a _histogram_query from each (seed, step)'s histogram;
    `everything` is their merge where the caller holds it (metrics of one column share it)."""
    _, stepped, value = _histogram_query(sql)
    node = json.loads(value)
    if everything is None:
        everything = _merge(partials.values())
    # A scalar subquery reads every row, so its value is the same at every step: once each.
    subqueries: dict[int, Any] = {}
    total = _walk(node, set(), rows=everything, whole=everything, subqueries=subqueries)
    points: list[list[float]] = []
    if stepped:
        by_step: dict[int, list[dict]] = {}
        for (_, step), histogram in partials.items():
            if step is not None:
                by_step.setdefault(step, []).append(histogram)
        for step in sorted(by_step):
            parts = by_step[step]
            rows = parts[0] if len(parts) == 1 else _merge(parts)
            point = _walk(node, set(), rows=rows, whole=everything, subqueries=subqueries)
            if point is not None:
                points.append([step, float(point)])
    return (None if total is None else float(total)), points


def _merge(histograms: Iterable[dict[int, int]]) -> dict[int, int]:
    merged: dict[int, int] = {}
    for histogram in histograms:
        for value, n in histogram.items():
            merged[value] = merged.get(value, 0) + n
    return merged


def _walk(
    node: dict,
    columns: set[str],
    *,
    check_only: bool = False,
    rows: dict[int, int] | None = None,
    whole: dict[int, int] | None = None,
    subqueries: dict[int, Any] | None = None,
) -> Any:
    """Check (`check_only`, collecting the columns read) or compute a parsed expression over
    the histogram `rows` (a scalar subquery: over `whole`, every row of the view; its value
    kept in `subqueries` by node where given)."""

    def walk(child: dict, over: dict[int, int] | None = rows) -> Any:
        return _walk(
            child, columns, check_only=check_only, rows=over, whole=whole, subqueries=subqueries
        )

    kind = node.get("class")
    if kind == "CONSTANT":
        literal = node["literal"]
        if literal["kind"] == "NULL_LITERAL":
            return None
        if literal["kind"] == "INTEGER":
            return int(literal["text"])
        if literal["kind"] in ("NUMERIC", "DECIMAL", "DOUBLE", "FLOAT"):
            return float(literal["text"])
        raise _NotFromHistogram
    if kind == "COMPARISON" and node["type"] in _COMPARISONS:
        left, right = walk(node["left"]), walk(node["right"])
        if check_only or left is None or right is None:
            return None
        return _COMPARISONS[node["type"]](left, right)
    if kind == "CASE":
        for check in node["case_checks"]:
            when, then = walk(check["when_expr"]), walk(check["then_expr"])
            if when is True:
                return then
        return walk(node["else_expr"])
    if kind == "CAST" and not node["try_cast"] and node["type_expr"].get("type_name") == "DOUBLE":
        child = walk(node["child"])
        return None if child is None else float(child)
    if kind == "SUBQUERY" and node["subquery_type"] == "SCALAR":
        sub = node["subquery"]["node"]
        if (
            sub.get("type") != "SELECT_NODE"
            or len(sub["select_list"]) != 1
            or sub["modifiers"]
            or sub["cte_map"]["map"]
            or sub["group_expressions"]
            or sub["group_sets"]
            or sub["aggregate_handling"] != "STANDARD_HANDLING"
            or any(sub.get(k) is not None for k in ("where_clause", "having", "qualify", "sample"))
            or sub["from_table"].get("type") != "BASE_TABLE"
            or sub["from_table"].get("table_name") != "rollouts"
            or sub["from_table"].get("alias")
        ):
            raise _NotFromHistogram
        if subqueries is None or check_only:
            return walk(sub["select_list"][0], whole)
        if id(node) not in subqueries:
            subqueries[id(node)] = walk(sub["select_list"][0], whole)
        return subqueries[id(node)]
    if kind == "FUNCTION" and node["function_name"] in _AGGREGATES:
        arguments = [a["expression"] for a in node["arguments"]]
        if (
            node["distinct"]
            or node["filter"] is not None
            or node["order_bys"]["orders"]
            or node["schema"]
            or not arguments
            or arguments[0].get("class") != "COLUMN_REF"
            or len(arguments[0]["column_names"]) != 1
            or len(arguments) != (2 if node["function_name"] == "quantile_cont" else 1)
        ):
            raise _NotFromHistogram
        columns.add(arguments[0]["column_names"][0])
        fraction = None
        if len(arguments) == 2:
            if arguments[1].get("class") != "CONSTANT":
                raise _NotFromHistogram
            fraction = walk(arguments[1])
            if not isinstance(fraction, float | int) or not 0 <= fraction <= 1:
                raise _NotFromHistogram
        return None if check_only else _aggregate(node["function_name"], rows, fraction)
    raise _NotFromHistogram


def _aggregate(name: str, histogram: dict[int, int], fraction: float | None) -> Any:
    """DuckDB's aggregate `name` over the values a histogram counts (nulls are not counted)."""
    n = sum(histogram.values())
    if name == "count":
        return n
    if not n:
        return None
    if name == "sum":
        return sum(v * c for v, c in histogram.items())
    if name == "avg":
        return sum(v * c for v, c in histogram.items()) / n
    if name == "min":
        return min(v for v, c in histogram.items() if c)
    if name == "max":
        return max(v for v, c in histogram.items() if c)
    # quantile_cont: the values at the floor and ceiling of (n - 1) * fraction in sorted
    # order, interpolated as DuckDB does (lo + (hi - lo) * d, in double).
    position = (n - 1) * fraction
    below = math.floor(position)
    values = sorted(v for v, c in histogram.items() if c)
    counts = np.cumsum([histogram[v] for v in values])
    lo = float(values[int(np.searchsorted(counts, below, side="right"))])
    if below == position:
        return lo
    hi = float(values[int(np.searchsorted(counts, below + 1, side="right"))])
    return lo + (hi - lo) * (position - below)


Moments = tuple[int, float, float, float, float, float]  # n, mean x, mean y, Sxx, Syy, Sxy


def _merge_moments(parts: Iterable[Moments]) -> Moments:
    """The co-moments of the union of disjoint row sets (Chan et al.'s pairwise update, the
    one DuckDB's corr uses to combine its threads' states)."""
    n, mx, my, sxx, syy, sxy = 0, 0.0, 0.0, 0.0, 0.0, 0.0
    for bn, bmx, bmy, bsxx, bsyy, bsxy in parts:
        if not bn:
            continue
        total = n + bn
        dx, dy = bmx - mx, bmy - my
        weight = n * bn / total
        sxx += bsxx + dx * dx * weight
        syy += bsyy + dy * dy * weight
        sxy += bsxy + dx * dy * weight
        mx += dx * bn / total
        my += dy * bn / total
        n = total
    return n, mx, my, sxx, syy, sxy


def _corr(moments: Moments) -> float | None:
    """Pearson's r, or None where DuckDB's corr is null (no pair) or NaN (a constant side)."""
    n, _, _, sxx, syy, sxy = moments
    if not n or sxx * syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def _combine(kind: str, partials: dict[Key, Any]) -> tuple[float | None, list[list[float]]]:
    """(value, per-step points) from the partials of every (seed, step)."""
    if kind == "moments":
        by_step: dict[int, list[Moments]] = {}
        for (_, step), moments in partials.items():
            if step is not None:
                by_step.setdefault(step, []).append(moments)
        points = [
            [step, value]
            for step in sorted(by_step)
            if (value := _corr(_merge_moments(by_step[step]))) is not None
        ]
        return _corr(_merge_moments(partials.values())), points
    if kind == "entropy":
        counts: dict[Any, int] = {}
        for by_value in partials.values():
            for value, n in by_value.items():
                counts[value] = counts.get(value, 0) + n
        total = sum(counts.values())
        shares = [n / total for n in counts.values() if n]
        return (-sum(p * math.log2(p) for p in shares) if total else 0.0), []
    per_step: dict[int, tuple[float, int]] = {}
    for (_, step), (total, n) in partials.items():
        if step is not None:
            old_total, old_n = per_step.get(step, (0.0, 0))
            per_step[step] = (old_total + total, old_n + n)
    points = [[step, total / n] for step, (total, n) in sorted(per_step.items()) if n]
    grand_n = sum(n for total, n in partials.values())
    grand = sum(total for total, n in partials.values())
    return (grand / grand_n if grand_n else None), points
