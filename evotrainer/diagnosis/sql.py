"""Run harness SQL read-only: one SELECT per metric, no file, network or extension access,
bounded time, memory and threads (an alert's `sample.where` is harness text too: a
`string_agg` over every rollout must fail with a clear error, not take the machine's memory).
Views: `rollouts` (the metric's split), `all_rollouts`, `steps`; `groups`: one row per
GRPO group of the split (seed, step, group_id), aggregated once on first use and shared by
every query of the diagnosis, so the group metrics cost one pass over the rows, not one each
(its columns are GROUP_COLUMNS); and `calls`: one row per tool call of the split (seed, step,
name, args), flattened once in Arrow and shared with the tool-call analyzers, so a query over
calls does not convert every rollout's list of calls."""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import duckdb

from evotrainer.errors import EvoError
from evotrainer.evidence.groups import DEAD_GROUP_SQL

# numpy, pyarrow and the analyzers are imported where rows are read: checking a harness
# revision's SQL (harness.py, on every `validate` and `plan`) needs DuckDB's parser alone.
if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

_PARAM = re.compile(r"\$([A-Za-z_]\w*)")
# DuckDB's own default is 80% of the machine's memory; a diagnosis needs far less.
MEMORY_LIMIT = "2GB"
THREADS = min(4, os.cpu_count() or 1)
# The `groups` table: what the group metrics (dead, saturated, spread) read.
GROUPS_SQL = f"""CREATE TEMP TABLE groups AS
SELECT seed, step, group_id,
       count(*) AS n,                        -- rollouts in the group
       count(correct) AS n_scored,           -- of which have a `correct`
       stddev_pop(reward) AS reward_sd,
       {DEAD_GROUP_SQL} AS dead,  -- evidence/groups.py: the one dead-group rule
       avg(reward) AS reward_mean,
       bool_and(correct = 1) AS all_correct, -- over the scored rollouts
       bool_and(correct = 0) AS all_wrong
FROM rollouts GROUP BY seed, step, group_id"""
GROUP_COLUMNS = (
    "seed", "step", "group_id", "n", "n_scored", "reward_sd", "dead", "reward_mean",
    "all_correct", "all_wrong",
)
READS_GROUPS = re.compile(r"\bgroups\b", re.IGNORECASE)
READS_CALLS = re.compile(r"\bcalls\b", re.IGNORECASE)
# A split in more runs of rows than this is filtered (copied) rather than sliced.
_MAX_SLICES = 64
_LOCKDOWN = (
    # Nothing spills to disk (the default temp directory is `.tmp` under the current one):
    # memory_limit is the bound.
    "SET temp_directory = ''",
    "SET enable_progress_bar = false",  # a long query would draw on the user's terminal
    "SET enable_external_access = false",
    "SET autoinstall_known_extensions = false",
    "SET autoload_known_extensions = false",
    "SET allow_community_extensions = false",
    "SET lock_configuration = true",
)


def check_select(sql: str, *, where: str | None = None, field: str | None = None) -> None:
    """Refuse anything but exactly one SELECT statement."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as err:
        raise EvoError(f"SQL does not parse: {err}", where=where, field=field) from None
    if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
        kinds = ", ".join(s.type.name for s in statements) or "nothing"
        raise EvoError(
            f"harness SQL must be exactly one SELECT statement, found {kinds}",
            where=where,
            field=field,
            hint="metrics only read the `rollouts`, `all_rollouts`, `steps`, `groups` and "
            "`calls` views",
        )


def metric_result(columns: list[str], rows: list) -> tuple[float | None, list[list[float]]]:
    """(value, series points) of a metric query's result: one row with `value`, or `step,
    value` rows from GROUP BY ROLLUP (step) whose step-NULL row carries the value."""
    if "value" not in columns:
        raise EvoError("the query must return a column named `value`")
    vi = columns.index("value")
    if "step" not in columns:
        if len(rows) > 1:
            raise EvoError(
                f"the query returned {len(rows)} rows; return one row, or a "
                "`step` column with GROUP BY ROLLUP (step)"
            )
        return (finite(rows[0][vi]) if rows else None), []
    si = columns.index("step")
    total = [r for r in rows if r[si] is None]
    if len(total) != 1:
        raise EvoError(
            "a query with a `step` column needs GROUP BY ROLLUP (step) so one "
            "row (step NULL) carries the overall value"
        )
    points = sorted(
        [int(r[si]), v] for r in rows if r[si] is not None and (v := finite(r[vi])) is not None
    )
    return finite(total[0][vi]), points


def keyed_result(columns: list[str], rows: list) -> dict[str, float | None]:
    """{key: value} of a keyed metric's query: `key, value` rows, one per key."""
    if "key" not in columns or "value" not in columns:
        raise EvoError("a keyed metric's query must return columns named `key` and `value`")
    ki, vi = columns.index("key"), columns.index("value")
    out: dict[str, float | None] = {}
    for row in rows:
        key = str(row[ki])
        if row[ki] is None or key in out:
            raise EvoError(f"the query returned a {'null' if row[ki] is None else 'repeated'} "
                           f"key {row[ki]!r}; return one row per key",
                           hint="GROUP BY the key")
        out[key] = finite(row[vi])
    return out


def finite(value: Any) -> float | None:
    """`value` as a float, or None for null, NaN and infinity (a metric's missing value)."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


def sql_params(sql: str) -> list[str]:
    """Names of the `$param` placeholders in `sql`."""
    return sorted(set(_PARAM.findall(sql)))


# The alias of each member's value in a fused query: harness SQL may not name it (see
# fusable_query), so a member can never read another's value.
_FUSED_ALIAS = "__evotrainer_fused_"
# Where a parsed node's text came from: irrelevant to what it means.
_LOCATION_KEYS = ("query_location", "query_location_length")


@dataclass(frozen=True)
class FusableQuery:
    """A metric query of one of the two shapes that run together with others of the same
    `key` as one query: `SELECT step, <e> AS value FROM <view> [WHERE w] GROUP BY ROLLUP
    (step)` (per step rows) or `SELECT <e> AS value FROM <view> [WHERE w]` (one row)."""

    key: str  # shape, view and WHERE: queries with equal keys read the same rows alike
    node: str  # the parsed SELECT, as DuckDB serializes it
    value: str  # its value expression, parsed


@lru_cache(maxsize=256)
def fusable_query(sql: str) -> FusableQuery | None:
    """`sql` parsed as a FusableQuery, or None when it has another shape, or DuckDB's text
    of it would not parse back to the same query (then fusing it could change its meaning)."""
    if _FUSED_ALIAS in sql:
        return None
    parsed = _parse(sql)
    if parsed is None:
        return None
    node = parsed["statements"][0]["node"]
    plain = {k: v for k, v in node.items() if k not in ("select_list", "where_clause")}
    table = node.get("from_table") or {}
    if (
        len(parsed["statements"]) != 1
        or node.get("type") != "SELECT_NODE"
        or node["modifiers"]
        or node["cte_map"]["map"]
        or any(node.get(k) is not None for k in ("having", "sample", "qualify"))
        or node["aggregate_handling"] != "STANDARD_HANDLING"
        or table.get("type") != "BASE_TABLE"
        or table.get("alias")
        or table.get("sample") is not None
        or table.get("at_clause") is not None
        or table.get("column_name_alias")
    ):
        return None
    select = node["select_list"]
    if select[-1].get("alias") != "value":
        return None
    groups = [_strip(g) for g in node["group_expressions"]]
    step = {"class": "COLUMN_REF", "type": "COLUMN_REF", "alias": "", "column_names": ["step"]}
    if len(select) == 2 and groups == [step] and node["group_sets"] == [[], [0]]:
        if _strip({**select[0], "alias": ""}) != step or select[0]["alias"] not in ("", "step"):
            return None
        shape = "rollup"
    elif len(select) == 1 and not groups and not node["group_sets"]:
        shape = "scalar"
    else:
        return None
    # DuckDB writes the fused query from the parsed members: use only queries whose text,
    # so written, parses back to themselves.
    again = _parse(_unparse(parsed))
    if again is None or _strip(again["statements"][0]["node"]) != _strip(node):
        return None
    key = json.dumps([shape, _strip(plain), _strip(node.get("where_clause"))], sort_keys=True)
    return FusableQuery(key, json.dumps(node), json.dumps(select[-1]))


def fused_query(queries: list[FusableQuery]) -> str:
    """One query computing every member's value (all of one key): its columns are `step`
    (rollup shape) and `value_0`, `value_1`, ... aliased as fused_value(i)."""
    node = json.loads(queries[0].node)
    values = [{**json.loads(q.value), "alias": fused_value(i)} for i, q in enumerate(queries)]
    node["select_list"] = node["select_list"][:-1] + values
    return _unparse({"error": False, "statements": [{"node": node, "named_param_map": []}]})


def fused_value(index: int) -> str:
    """The column of the `index`th member's value in a fused query."""
    return f"{_FUSED_ALIAS}{index}"


_parser_lock = threading.Lock()
# The process's DuckDB databases, each opened on first use (importing this module opens
# nothing): the one that parses harness SQL (key None) and the harness queries' under each
# (memory limit, threads).
_DATABASES: dict[tuple[str, int] | None, duckdb.DuckDBPyConnection] = {}
_databases_lock = threading.Lock()
# A forked child's inherited databases: their queries run on worker threads only the parent
# has, and closing one waits for those threads. The child opens its own and keeps these
# referenced, never used or closed.
_INHERITED: list[duckdb.DuckDBPyConnection] = []


def _open_anew_after_fork() -> None:
    global _parser_lock, _databases_lock
    _INHERITED.extend(_DATABASES.values())
    _DATABASES.clear()
    _parser_lock, _databases_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_open_anew_after_fork)


def _parser() -> duckdb.DuckDBPyConnection:
    """The connection that parses harness SQL (used under _parser_lock)."""
    with _databases_lock:
        if None not in _DATABASES:
            _DATABASES[None] = duckdb.connect()
        return _DATABASES[None]


def _parse(sql: str) -> dict | None:
    with _parser_lock:
        try:
            text = _parser().execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0]
        except duckdb.Error:
            return None
    parsed = json.loads(text)
    return None if parsed.get("error") or not parsed.get("statements") else parsed


def _unparse(parsed: dict) -> str:
    with _parser_lock:
        sql = "SELECT json_deserialize_sql(?)"
        return _parser().execute(sql, [json.dumps(parsed)]).fetchone()[0]


# Names a query may read besides the rollout columns: those of the `groups` and `calls` views.
_VIEW_COLUMNS = frozenset(GROUP_COLUMNS) | {"name", "args"}


class _ReadsAnyColumn(Exception):
    """A parsed query may read a column it does not name."""


@lru_cache(maxsize=256)
def query_columns(sql: str, columns: tuple[str, ...]) -> frozenset[str] | None:
    """The names in `columns` that `sql` reads (a superset: any name it mentions), or None
    when it may read one without naming it: a star (`*`, `COLUMNS(...)`), a NATURAL join,
    a bare name that is no column, alias or lambda parameter (a table's row read as one
    value), or SQL that does not parse."""
    parsed = _parse(sql)
    if parsed is None:
        return None
    refs: list[list[str]] = []
    known = set(columns) | _VIEW_COLUMNS  # plus the query's own aliases and lambda parameters
    tables: set[str] = set()  # table names and aliases: a bare one reads a whole row

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        if node.get("class") == "STAR" or node.get("ref_type") == "NATURAL":
            raise _ReadsAnyColumn
        if node.get("class") == "COLUMN_REF":
            refs.append(node["column_names"])
        elif node.get("class") == "LAMBDA":
            known.update(_names_in(node["lhs"]))
        if "class" in node:
            known.add(node.get("alias") or "")
        else:
            tables.update(n for n in (node.get("alias"), node.get("table_name")) if n)
        refs.extend([name] for name in node.get("using_columns") or [])
        for value in node.values():
            walk(value)

    try:
        walk(parsed["statements"])
    except _ReadsAnyColumn:
        return None
    if any(len(ref) == 1 and (ref[0] not in known or ref[0] in tables) for ref in refs):
        return None
    return frozenset(name for ref in refs for name in ref if name in columns)


def _names_in(node: Any) -> list[str]:
    """Every column name a parsed node holds (a lambda's parameters)."""
    if isinstance(node, list):
        return [name for item in node for name in _names_in(item)]
    if not isinstance(node, dict):
        return []
    return list(node.get("column_names") or []) + _names_in(list(node.values()))


def _strip(node: Any) -> Any:
    """A parsed node without where its text was."""
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k not in _LOCATION_KEYS}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def split_rows(table: pa.Table, split: str | None) -> pa.Table:
    """The rows of `table` in `split` (all rows for None), as data: no SQL text is built from
    the split name."""
    import pyarrow.compute as pc

    if split is None:
        return table
    return rows_where(table, pc.equal(table.column("split"), split))


def rows_where(table: pa.Table, mask: np.ndarray | pa.Array | pa.ChunkedArray) -> pa.Table:
    """The rows of `table` where `mask` holds. Evidence stores each split as one run of rows
    (one file per split) and a growing run's new rows come after the old ones, so the result
    is usually zero-copy slices; scattered rows are filtered (copied) instead."""
    import numpy as np
    import pyarrow as pa

    if not isinstance(mask, np.ndarray):
        mask = mask.to_numpy(zero_copy_only=False)
    # Where the mask changes: boolean compares of neighbours, no integer copy of the mask.
    changes = np.flatnonzero(mask[1:] != mask[:-1]) + 1
    if len(changes) > 2 * _MAX_SLICES:
        return table.filter(pa.array(mask))
    edges = [0, *changes.tolist(), len(mask)]
    runs = [
        (start, end)
        for start, end in zip(edges, edges[1:], strict=False)
        if end > start and mask[start]
    ]
    if runs == [(0, table.num_rows)]:
        return table
    if not runs:
        return table.slice(0, 0)
    return pa.concat_tables([table.slice(start, end - start) for start, end in runs])


def _locked_database(memory_limit: str, threads: int) -> duckdb.DuckDBPyConnection:
    """The process's in-memory DuckDB database for harness queries under these limits, locked
    down before it sees any input (no view or table exists while settings can change). Each
    ReadOnlyQuery is a connection to it (a cursor: opened at no cost, with its own views and temp
    tables and every setting locked), where a database of its own would take longer to open
    than a small diagnosis takes to run."""
    with _databases_lock:
        con = _DATABASES.get((memory_limit, threads))
        if con is None:
            con = duckdb.connect(config={"memory_limit": memory_limit, "threads": threads})
            for statement in _LOCKDOWN:
                con.execute(statement)
            _DATABASES[memory_limit, threads] = con
        return con


class ReadOnlyQuery:
    """A locked-down DuckDB connection whose `rollouts` view holds one split.

    `rows` is the split's rows when the caller has them already (else taken from `rollouts`);
    `calls` builds the `calls` view (default: analyzers.call_table of the split's rows), made
    on first use like `groups`. Every ReadOnlyQuery with the same limits connects to one locked
    database (_locked_database); what it registers and creates is its own."""

    def __init__(
        self,
        rollouts: pa.Table,
        steps: pa.Table | None,
        split: str | None,
        *,
        timeout_s: float = 60.0,
        memory_limit: str = MEMORY_LIMIT,
        threads: int = THREADS,
        rows: pa.Table | None = None,
        calls: Callable[[], pa.Table] | None = None,
    ) -> None:
        from evotrainer.diagnosis.analyzers import call_table
        from evotrainer.evidence.steps import empty_steps

        self.timeout_s, self.memory_limit = timeout_s, memory_limit
        self.con = _locked_database(memory_limit, threads).cursor()
        split_table = rows if rows is not None else split_rows(rollouts, split)
        self.con.register("all_rollouts", rollouts)
        self.con.register("steps", steps if steps is not None else empty_steps())
        self.con.register("rollouts", split_table)
        self.make_calls = calls or (lambda: call_table(split_table))
        self.has_groups = self.has_calls = False
        self.split_table = split_table
        self.recent: dict[int, str] = {}  # step floor: the registered copy of its rows

    def recent_rows(self, floor: int) -> str:
        """A FROM item reading the view's rows of step `floor` and later under the name
        `rollouts`: the rows are taken out once per floor (slices where they lie together, as
        a run's latest steps do), so a `WHERE` over them converts only those rows' columns (a
        filter on the full view converts every row's tool calls first). An alias is no table
        name: a subquery's `FROM rollouts` still reads the full view, so `WHERE` means what
        it means over `FROM rollouts WHERE step >= floor`."""
        if floor not in self.recent:
            import pyarrow.compute as pc

            recent = pc.greater_equal(self.split_table.column("step"), floor)
            self.recent[floor] = f"recent_rollouts_{len(self.recent)}"
            self.con.register(self.recent[floor], rows_where(self.split_table, recent))
        return f"{self.recent[floor]} AS rollouts"

    def query(self, sql: str, params: dict[str, Any], *, field: str) -> tuple[list[str], list]:
        """Run one checked SELECT; return (column names, rows)."""
        def fetch(sql: str, used: dict[str, Any] | None) -> tuple[list[str], list]:
            result = self.con.execute(sql, used)
            return [d[0] for d in result.description], result.fetchall()

        return self._run(sql, params, field, fetch)

    def table(self, sql: str, params: dict[str, Any], *, field: str) -> pa.Table:
        """Run one checked SELECT; return its result as an Arrow table."""
        # A relation hands its rows to Arrow directly; a DB-API result would copy them.
        return self._run(
            sql, params, field, lambda sql, used: self.con.sql(sql, params=used).to_arrow_table()
        )

    def _run(
        self, sql: str, params: dict[str, Any], field: str,
        fetch: Callable[[str, dict[str, Any] | None], Any],
    ) -> Any:
        """`fetch(sql, params)` of one checked SELECT, within the connection's time and memory."""
        check_select(sql, field=field)
        used = {name: params[name] for name in sql_params(sql)}
        timer = threading.Timer(self.timeout_s, self.con.interrupt)
        timer.start()
        try:
            if not self.has_groups and READS_GROUPS.search(sql):
                self.con.execute(GROUPS_SQL)
                self.has_groups = True
            if not self.has_calls and READS_CALLS.search(sql):
                self.con.register("calls", self.make_calls())
                self.has_calls = True
            return fetch(sql, used or None)
        except duckdb.InterruptException:
            raise EvoError(f"query ran longer than {self.timeout_s:g} s", field=field) from None
        except duckdb.OutOfMemoryException:
            raise EvoError(
                f"query needs more than the {self.memory_limit} harness queries may use",
                field=field,
                hint="aggregate to numbers per group or step; do not collect every rollout's "
                "text (string_agg, list) in one value",
            ) from None
        except duckdb.Error as err:
            raise EvoError(f"query failed: {err}", field=field) from None
        finally:
            timer.cancel()

    def close(self) -> None:
        self.con.close()


# ---- a row condition (an analyzer's `rows.where`): one boolean expression, never a query ----

# Parsed node classes a row condition may not hold: each reads rows or columns the
# condition's own row does not have.
_REFUSED_IN_CONDITION = frozenset({"SUBQUERY", "STAR", "WINDOW"})


@lru_cache(maxsize=256)
def _condition(expr: str) -> str | None:
    """`expr` parsed as one expression (its node as JSON), or None when it is anything else.
    The text goes into `SELECT (...)` with a newline before the closing parenthesis, so
    neither a parenthesis nor a comment in it can end the expression early unnoticed."""
    parsed = _parse(f"SELECT ({expr}\n)")
    if parsed is None or len(parsed["statements"]) != 1:
        return None
    node = parsed["statements"][0]["node"]
    if (
        node.get("type") != "SELECT_NODE"
        or len(node.get("select_list") or []) != 1
        or (node.get("from_table") or {}).get("type") != "EMPTY"
        or node["modifiers"]
        or node["cte_map"]["map"]
        or node["group_expressions"]
        or node["group_sets"]
        or any(node.get(k) is not None for k in ("where_clause", "having", "sample", "qualify"))
    ):
        return None
    return json.dumps(node["select_list"][0])


def check_condition(
    expr: str, columns: tuple[str, ...], *, where: str | None = None, field: str | None = None
) -> None:
    """Refuse `expr` unless it is a single expression over `columns` (and `$params`): no
    subquery, no second statement, no table, star or window. EvoError naming `field`."""
    hint = ("a row condition is one boolean expression over rollout columns, e.g. "
            "`turns >= 3 AND split = 'train'`; no subquery, UNION or table")
    node = _condition(expr)
    if node is None:
        raise EvoError("is not a single SQL expression", where=where, field=field, hint=hint)
    lambdas: set[str] = set()

    def walk(item: Any) -> None:
        if isinstance(item, list):
            for value in item:
                walk(value)
            return
        if not isinstance(item, dict):
            return
        kind = item.get("class")
        if kind in _REFUSED_IN_CONDITION or "subquery" in item or item.get("type") in (
            "SELECT_NODE", "SET_OPERATION_NODE"
        ):
            raise EvoError(f"holds a {str(kind or item.get('type')).lower()}, which reads "
                           "beyond the row", where=where, field=field, hint=hint)
        if kind == "LAMBDA":
            lambdas.update(_names_in(item["lhs"]))
        if kind == "COLUMN_REF":
            name = item["column_names"][0]
            if name not in columns and name not in lambdas:
                raise EvoError(f"reads {'.'.join(item['column_names'])!r}, which is no "
                               "rollout column", where=where, field=field,
                               hint=f"columns: {', '.join(columns)}")
        for value in item.values():
            walk(value)

    walk(json.loads(node))


@lru_cache(maxsize=256)
def rows_query(columns: tuple[str, ...], condition: str | None) -> str:
    """`SELECT <columns> FROM rollouts [WHERE <condition>]`, written by DuckDB from the parsed
    condition (check_condition passed): the condition's text is never pasted into SQL."""
    listed = ", ".join('"' + c.replace('"', '""') + '"' for c in columns)
    if condition is None:
        return f"SELECT {listed} FROM rollouts"
    node = _condition(condition)
    if node is None:
        raise EvoError("the row condition is not a single SQL expression")
    parsed = _parse(f"SELECT {listed} FROM rollouts WHERE true")
    assert parsed is not None
    parsed["statements"][0]["node"]["where_clause"] = json.loads(node)
    return _unparse(parsed)


def condition_type(
    condition: str, schema: pa.Schema, params: dict[str, Any], *, where: str | None = None,
    field: str | None = None,
) -> str:
    """The SQL type of `condition` (check_condition passed) over rows of `schema`: bound,
    never run on a row. EvoError naming `field` when it does not bind."""
    node = _condition(condition)
    if node is None:
        raise EvoError("is not a single SQL expression", where=where, field=field)
    parsed = _parse("SELECT true FROM rollouts")
    assert parsed is not None
    parsed["statements"][0]["node"]["select_list"] = [json.loads(node)]
    used = {name: params[name] for name in sql_params(condition) if name in params}
    con = _locked_database(MEMORY_LIMIT, 1).cursor()
    try:
        con.register("rollouts", schema.empty_table())
        return str(con.sql(_unparse(parsed), params=used or None).types[0])
    except duckdb.Error as err:
        first = (str(err).splitlines() or [""])[0]
        raise EvoError(f"does not bind: {first}", where=where, field=field) from None
    finally:
        con.close()
