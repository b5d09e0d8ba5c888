"""Declared analyzers: an analyzer written in the harness revision itself, as data a reviewer
reads in `git diff`, instead of a Python function registered in analyzers.py.

    analyzers:
      - name: think_share
        description: ...
        inputs: [response, step]          # the rollout columns it sees, and only those
        output: {kind: per_row}           # scalar | series | per_row | per_group
        rows: {split: train, where: ...}  # the rows it sees (its metrics read this split)
        sql: SELECT step, ... AS value FROM rollouts      # or
        python: |
          def think_share(rows, params):  # rows: {column: [values]}; params: the revision's
            return [float("<think>" in r) for r in rows["response"]]
        limits: {cpu_seconds: 5, memory_mb: 256, wall_seconds: 10}

What each kind returns, and what the metric makes of it:
  scalar     SQL: one row with `value`; Python: a number or null. The metric's value.
  series     SQL: `step, value` with GROUP BY ROLLUP (step); Python: {"value": v,
             "series": {step: v}}. The value and its per-step series.
  per_row    SQL: rows of `step, value`; Python: a list with a number (or null) per row.
  per_group  SQL: rows of `seed, step, group_id, value`, one per group; Python: a list of
             {"seed", "step", "group_id", "value"}. For both: the mean over rows / groups,
             and its mean per step (null values left out).

Neither reaches anything but its declared rows. `rows.where` is parsed by DuckDB as one
expression over rollout columns (no subquery, UNION or table) and the rows' query is written
from the parsed expression, never pasted text. SQL runs over a locked-down, read-only DuckDB
connection (sql.ReadOnlyQuery) over a table of the declared columns only. Python is untrusted
program text. Its load check (one function, imports from a small list of pure standard-library
modules, no dunder attributes, no open/exec/eval/...) is a lint that names mistakes early; it
is not the boundary, since Python's introspection has more ways out than any source check
sees. The boundary is the operating system's: the program runs in the model-code sandbox
(sandbox/process.py) as a uid that can read neither the caller's own files (the record key,
mode 0600) nor its environment, with no network, a private /tmp, CPU, memory and wall-clock
limits and nothing left running after it. As root that is a fresh uid in namespaces; without
root, the caller's uid confined in user, mount, pid and network namespaces that hide the
host. Where the machine gives neither (not root, no unprivileged user namespaces), a Python
analyzer of a revision not reviewed on main is not run: its metrics are gaps naming the
revision, and SQL analyzers and catalogue metrics still run. Its rows arrive on stdin and its
result is read back as JSON and checked against the declared kind.

Each diagnosis runs an analyzer once per (analyzer, params, rows), however many metrics name
it, and a revision's analyzers share MAX_REVISION_SECONDS of wall time per diagnosis
(AnalyzerRuns): past it the diagnosis stops with one line naming the revision.
"""

from __future__ import annotations

import ast
import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa

from evotrainer.diagnosis.analyzers import mean_by_step
from evotrainer.diagnosis.sql import ReadOnlyQuery, metric_result, query_columns, rows_query
from evotrainer.errors import EvoError
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.sandbox.process import Limits, LocalSandbox

OUTPUT_KINDS = ("scalar", "series", "per_row", "per_group")
GROUP_KEYS = ("seed", "step", "group_id")
# The columns each kind's result is keyed by, which its inputs must therefore include.
_KEY_INPUTS = {"scalar": (), "series": ("step",), "per_row": (), "per_group": GROUP_KEYS}

# What a Python analyzer may import: pure computation, nothing that reaches files, processes,
# the network or the interpreter's internals.
ALLOWED_MODULES = frozenset(
    {"math", "statistics", "collections", "itertools", "functools", "re", "bisect", "heapq",
     "operator", "string"}
)
# Builtins a Python analyzer never needs and an attack does: files, code from text,
# introspection that walks out of the namespace, the interpreter's exit and input.
_REFUSED_NAMES = frozenset(
    {"open", "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "getattr",
     "setattr", "delattr", "breakpoint", "input", "help", "memoryview", "exit", "quit",
     "__builtins__", "__loader__", "__spec__"}
)
# The runner exposes these builtins only (besides a guarded __import__).
_SAFE_BUILTINS = (
    "abs", "all", "any", "bool", "bytearray", "bytes", "chr", "dict", "divmod", "enumerate",
    "filter", "float", "format", "frozenset", "hash", "int", "isinstance", "iter", "len",
    "list", "map", "max", "min", "next", "ord", "pow", "print", "range", "repr", "reversed",
    "round", "set", "slice", "sorted", "str", "sum", "tuple", "zip", "ArithmeticError",
    "Exception", "IndexError", "KeyError", "StopIteration", "TypeError", "ValueError",
    "ZeroDivisionError",
)
# Attribute prefixes of frames, code, generators and tracebacks: the way from a value back to
# a frame's globals (and so to the runner's builtins), with dunders the other.
_REFUSED_ATTRIBUTE_PREFIXES = ("__", "f_", "gi_", "cr_", "ag_", "tb_", "co_")

# What an analyzer gets unless it asks for other limits (sandbox/process.Limits units); the
# most it may ask for is the schema's (harness-revision.schema.json, `limits`).
DEFAULT_LIMITS = {"cpu_seconds": 5.0, "wall_seconds": 10.0, "memory_mb": 512}
# The rows handed to a Python analyzer, as JSON: past this, narrow `inputs` or `rows.where`.
MAX_INPUT_BYTES = 64 * 2**20
MAX_OUTPUT_BYTES = 16 * 2**20
# The row order column added to a Python analyzer's rows while they are written as JSON.
_ROW = "__evotrainer_row"
# Wall seconds all of a revision's declared analyzers may take in one diagnosis, together:
# a revision naming one slow analyzer from many metrics, or declaring many, stops here.
MAX_REVISION_SECONDS = 120.0

# Runs the analyzer: its rows and params arrive on stdin, its result leaves on the real
# stdout (what the analyzer prints goes to stderr, so it cannot forge the result), and it
# sees the safe builtins only.
_RUNNER = """\
import builtins, json, sys
_real_stdout, sys.stdout = sys.stdout, sys.stderr
_allowed = {allowed!r}
def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level or name.split(".")[0] not in _allowed:
        raise ImportError("analyzers may import only " + ", ".join(sorted(_allowed)))
    return builtins.__import__(name, globals, locals, fromlist, level)
_names = {{n: getattr(builtins, n) for n in {safe!r}}}
_names["__import__"] = _guarded_import
_namespace = {{"__builtins__": _names, "__name__": "analyzer"}}
_data = json.loads(sys.stdin.read())
exec(compile({source!r}, {filename!r}, "exec"), _namespace)
_result = _namespace[{function!r}](_data["rows"], _data["params"])
_real_stdout.write(json.dumps({{"result": _result}}, allow_nan=True))
"""


@dataclass(frozen=True)
class DeclaredAnalyzer:
    name: str
    revision: str  # the revision that declares it, for error messages
    inputs: tuple[str, ...]
    kind: str  # one of OUTPUT_KINDS
    split: str | None  # the rows' split, which a metric naming it reads; None: any
    where: str | None  # SQL condition on those rows
    sql: str | None
    python: str | None
    function: str | None  # the Python source's one function
    limits: Limits
    description: str = ""
    # The revision's text is the one on main (or built in): reviewed. Only then may its Python
    # run where the machine cannot give the OS isolation (see the module doc).
    reviewed: bool = False

    def error(self, message: str, hint: str | None = None) -> EvoError:
        """A one-line error naming the revision and the analyzer."""
        return EvoError(f"harness {self.revision}, analyzer {self.name}: {message}", hint=hint)


class AnalyzerRefused(EvoError):
    """A Python analyzer not run because this machine cannot isolate it: its metric is a gap
    (this line), the rest of the diagnosis goes on."""


@dataclass
class AnalyzerRuns:
    """One diagnosis's runs of a revision's declared analyzers: each (analyzer, params, rows)
    runs once however many metrics name it, and all of them share `budget_s` of wall time."""

    revision: str
    budget_s: float = field(default_factory=lambda: MAX_REVISION_SECONDS)
    spent_s: float = 0.0
    results: dict[tuple, tuple[float | None, list[list[float]]]] = field(default_factory=dict)

    def remaining(self, analyzer: DeclaredAnalyzer) -> float:
        """Seconds left; EvoError naming the revision when none are."""
        left = self.budget_s - self.spent_s
        if left <= 0:
            raise self.exhausted(analyzer)
        return left

    def exhausted(self, analyzer: DeclaredAnalyzer) -> EvoError:
        return EvoError(
            f"harness {self.revision}: its declared analyzers took more than the "
            f"{self.budget_s:g} s of wall time a diagnosis allows them (stopped at analyzer "
            f"{analyzer.name}, after {self.spent_s:.1f} s)",
            hint="make the analyzers cheaper, narrow their rows.where, or let fewer run",
        )


def declared_analyzer(raw: dict[str, Any], *, revision: str, where: str) -> DeclaredAnalyzer:
    """Check one schema-valid `analyzers:` entry: its columns exist, its kind's keys are among
    its inputs, its SQL reads only its inputs, its Python is one function that uses nothing
    outside the allowed modules. Raises EvoError naming the revision and the analyzer."""
    name = raw["name"]

    def fail(message: str, hint: str | None = None) -> EvoError:
        return EvoError(f"harness {revision}, analyzer {name}: {message}", where=where,
                        hint=hint)

    inputs = tuple(raw["inputs"])
    unknown = [c for c in inputs if c not in ROLLOUT_SCHEMA.names]
    if unknown:
        raise fail(f"unknown rollout column(s) {', '.join(unknown)} in inputs",
                   hint=f"columns: {', '.join(ROLLOUT_SCHEMA.names)}")
    kind = raw["output"]["kind"]
    missing = [c for c in _KEY_INPUTS[kind] if c not in inputs]
    if missing:
        raise fail(f"a {kind} analyzer needs {', '.join(missing)} among its inputs",
                   hint=f"add {', '.join(missing)} to inputs")
    sql, python = raw.get("sql"), raw.get("python")
    if (sql is None) == (python is None):
        raise fail("needs exactly one of sql, python")
    if sql is not None:
        read = query_columns(sql, tuple(ROLLOUT_SCHEMA.names))
        outside = sorted((read or frozenset()) - set(inputs))
        if outside:
            raise fail(f"its sql reads {', '.join(outside)}, not among its inputs",
                       hint="declare every column the analyzer reads under inputs")
    function = None if python is None else _check_python(python, fail)
    rows = raw.get("rows") or {}
    asked = {**DEFAULT_LIMITS, **(raw.get("limits") or {})}
    return DeclaredAnalyzer(
        name=name,
        revision=revision,
        inputs=inputs,
        kind=kind,
        split=rows.get("split"),
        where=rows.get("where"),
        sql=sql,
        python=python,
        function=function,
        limits=Limits(
            cpu_seconds=float(asked["cpu_seconds"]),
            wall_seconds=float(asked["wall_seconds"]),
            memory_bytes=int(asked["memory_mb"]) * 2**20,
            output_bytes=MAX_OUTPUT_BYTES,
            processes=1,
            file_bytes=2**20,
        ),
        description=raw.get("description") or "",
    )


def _check_python(source: str, fail: Any) -> str:
    """The name of the one function `source` defines, after refusing what an analyzer has no
    use for and an attack needs (the sandbox contains what this misses)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise fail(f"python does not parse: {err.msg} (line {err.lineno})") from None
    functions = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions.append(node.name)
        elif not isinstance(node, (ast.Import, ast.ImportFrom)) and not (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        ):
            raise fail(f"python line {node.lineno}: only imports and one function may stand "
                       "at the top level", hint="put the computation inside the function")
    if len(functions) != 1:
        raise fail(f"python must define exactly one function, found {len(functions)}",
                   hint="def analyze(rows, params): ... returning the declared output")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""])
            refused = [m for m in modules
                       if m.split(".")[0] not in ALLOWED_MODULES or getattr(node, "level", 0)]
            if refused:
                raise fail(f"python line {node.lineno} imports {', '.join(refused)}",
                           hint=f"analyzers may import only {', '.join(sorted(ALLOWED_MODULES))}")
        elif isinstance(node, ast.Name) and node.id in _REFUSED_NAMES:
            raise fail(f"python line {node.lineno} uses {node.id}",
                       hint="an analyzer computes over its rows: no files, no code from text, "
                       "no introspection")
        elif isinstance(node, ast.Attribute) and node.attr.startswith(
            _REFUSED_ATTRIBUTE_PREFIXES
        ):
            raise fail(f"python line {node.lineno} reads the attribute {node.attr}",
                       hint="dunder, frame and code attributes reach outside the analyzer's "
                       "namespace")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            raise fail(f"python line {node.lineno}: no global or nonlocal state")
    return functions[0]


def run_declared(
    analyzer: DeclaredAnalyzer,
    connection: ReadOnlyQuery,
    params: dict[str, Any],
    *,
    timeout_s: float,
    memory_limit: str,
    runs: AnalyzerRuns | None = None,
) -> tuple[float | None, list[list[float]]]:
    """(value, series points) of `analyzer` over the rows of `connection`'s split that hold its
    `rows.where`, with only its declared columns. `runs` (one per diagnosis) keeps each
    result, so a second metric naming the same analyzer, params and rows reuses it, and
    bounds the time all of them take. AnalyzerRefused when a Python analyzer cannot be
    isolated here."""
    runs = runs or AnalyzerRuns(analyzer.revision)
    try:
        params_key = json.dumps(params, sort_keys=True, default=str)
    except (TypeError, ValueError) as err:
        raise analyzer.error(f"params are not JSON: {err}") from None
    # The connection is the split's for this diagnosis: the same connection, the same rows.
    key = (analyzer.name, analyzer.sql, analyzer.python, analyzer.where, analyzer.inputs,
           analyzer.kind, id(connection), params_key)
    if key in runs.results:
        return runs.results[key]
    if analyzer.python is not None:
        box = analyzer_sandbox()
        if not box.separated and not analyzer.reviewed:
            raise AnalyzerRefused(
                f"harness {analyzer.revision}, analyzer {analyzer.name}: not run: revision "
                f"{analyzer.revision} is not reviewed on main and this machine cannot isolate "
                "its Python (not root, and no unprivileged user namespaces)",
                hint="run as root, allow unprivileged user namespaces "
                "(sysctl user.max_user_namespaces), or review and merge the revision; SQL "
                "analyzers and catalogue metrics still run",
            )
    left = runs.remaining(analyzer)
    start = time.monotonic()
    try:
        result, out_of_time = _run(analyzer, connection, params, min(timeout_s, left),
                                   memory_limit, left), False
    except _OutOfTime:
        result, out_of_time = (None, []), True
    runs.spent_s += time.monotonic() - start
    if out_of_time or runs.spent_s > runs.budget_s:
        raise runs.exhausted(analyzer)
    runs.results[key] = result
    return result


class _OutOfTime(Exception):
    """A run stopped by the revision's remaining time, not by its own limits."""


def _run(
    analyzer: DeclaredAnalyzer, connection: ReadOnlyQuery, params: dict[str, Any],
    timeout_s: float, memory_limit: str, left: float,
) -> tuple[float | None, list[list[float]]]:
    keys = [c for c in ("step",) if c not in analyzer.inputs]  # per_row series need steps
    try:
        # Written by DuckDB from the parsed `rows.where` (checked when the revision loaded).
        query = rows_query((*analyzer.inputs, *keys), analyzer.where)
        rows = connection.table(query, params, field=f"analyzers.{analyzer.name}.rows")
    except EvoError as err:
        raise analyzer.error(err.message, err.hint) from None
    steps = rows.column("step").to_numpy(zero_copy_only=False)
    seen = rows.select(list(analyzer.inputs))
    if analyzer.sql is not None:
        try:
            return _run_sql(analyzer, seen, params, timeout_s, memory_limit)
        except EvoError as err:
            if timeout_s < left or "ran longer than" not in err.message:
                raise
            raise _OutOfTime from None
    limits = analyzer.limits
    if left < limits.wall_seconds:
        limits = replace(limits, wall_seconds=left, cpu_seconds=min(limits.cpu_seconds, left))
    return _run_python(analyzer, seen, steps, params, analyzer_sandbox(), timeout_s,
                       memory_limit, limits, clipped=limits is not analyzer.limits)


_ANALYZER_SANDBOXES: dict[tuple[str, str], LocalSandbox] = {}


def analyzer_sandbox() -> LocalSandbox:
    """The sandbox Python analyzers run in: the local one, confined in namespaces when not
    root, with the current directory (the workspace, which holds the record key) and the
    home directory covered even where they lie under a visible directory. One per process
    and place."""
    key = (os.getcwd(), os.path.expanduser("~"))
    if key not in _ANALYZER_SANDBOXES:
        _ANALYZER_SANDBOXES[key] = LocalSandbox(confine=True, hide=key)
    return _ANALYZER_SANDBOXES[key]


def _run_sql(
    analyzer: DeclaredAnalyzer, rows: pa.Table, params: dict[str, Any], timeout_s: float,
    memory_limit: str,
) -> tuple[float | None, list[list[float]]]:
    # The analyzer's own connection: `rollouts` and `all_rollouts` are its declared rows only.
    own = ReadOnlyQuery(rows, None, None, timeout_s=timeout_s, memory_limit=memory_limit)
    try:
        columns, result = own.query(analyzer.sql or "", params,
                                    field=f"analyzers.{analyzer.name}.sql")
    except EvoError as err:
        raise analyzer.error(err.message, err.hint) from None
    finally:
        own.close()
    if analyzer.kind == "series" and "step" not in columns:
        raise analyzer.error("a series analyzer returns `step, value` with GROUP BY ROLLUP "
                             "(step)")
    if analyzer.kind in ("scalar", "series"):
        try:
            return metric_result(columns, result)
        except EvoError as err:
            raise analyzer.error(err.message, err.hint) from None
    return _aggregate(analyzer, columns, result)


def _aggregate(
    analyzer: DeclaredAnalyzer, columns: list[str], result: list
) -> tuple[float | None, list[list[float]]]:
    """Mean and per-step means of a per_row (`step, value`) or per_group (`seed, step,
    group_id, value`) SQL result."""
    needed = ["step", "value"] if analyzer.kind == "per_row" else [*GROUP_KEYS, "value"]
    if any(c not in columns for c in needed):
        raise analyzer.error(f"a {analyzer.kind} analyzer returns the columns "
                             f"{', '.join(needed)}; it returned {', '.join(columns)}")
    at = [columns.index(c) for c in needed]
    picked = [[row[i] for i in at] for row in result]
    if analyzer.kind == "per_group":
        groups = [tuple(row[:3]) for row in picked]
        if len(set(groups)) != len(groups):
            raise analyzer.error("a per_group analyzer returns one row per group; a group came "
                                 "twice")
    step = needed.index("step")
    return _mean(analyzer, [row[step] for row in picked], [row[-1] for row in picked])


def _mean(
    analyzer: DeclaredAnalyzer, steps: list, values: list
) -> tuple[float | None, list[list[float]]]:
    """mean_by_step over (step, number or null) pairs, refusing anything else."""
    numbers = np.full(len(values), np.nan)
    for i, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
            raise analyzer.error(f"value {i} is {type(value).__name__}, not a number")
        numbers[i] = float(value)
    if any(not isinstance(s, int) or isinstance(s, bool) for s in steps):
        raise analyzer.error("a step is not an integer")
    return mean_by_step(np.array(steps, dtype=np.int64), numbers)


def _run_python(
    analyzer: DeclaredAnalyzer, rows: pa.Table, steps: np.ndarray, params: dict[str, Any],
    sandbox: LocalSandbox, timeout_s: float, memory_limit: str, limits: Limits,
    *, clipped: bool,
) -> tuple[float | None, list[list[float]]]:
    try:
        params_json = json.dumps(params, default=str)
    except (TypeError, ValueError) as err:
        raise analyzer.error(f"params are not JSON: {err}") from None
    stdin = f'{{"rows": {_rows_json(analyzer, rows, timeout_s, memory_limit)}, ' \
            f'"params": {params_json}}}'
    if len(stdin) > MAX_INPUT_BYTES:
        raise analyzer.error(
            f"its rows are {len(stdin)} bytes as JSON, more than {MAX_INPUT_BYTES}",
            hint="declare fewer inputs or narrow rows.where",
        )
    program = _RUNNER.format(
        allowed=sorted(ALLOWED_MODULES), safe=_SAFE_BUILTINS, source=analyzer.python,
        filename=f"<analyzer {analyzer.name}>", function=analyzer.function,
    )
    outcome = sandbox.run(program, stdin, limits)
    if clipped and outcome.status in ("timeout", "cpu_limit"):
        raise _OutOfTime
    if outcome.status != "ok":
        last = (outcome.stderr.strip().splitlines() or [""])[-1][:200]
        detail = outcome.detail if outcome.status != "runtime_error" or not last else last
        raise analyzer.error(
            f"stopped in the sandbox ({outcome.status}): {detail}",
            hint="an analyzer computes within its limits over its declared rows",
        )
    try:
        result = json.loads(outcome.stdout)["result"]
    except (ValueError, KeyError, TypeError):
        raise analyzer.error("its program wrote no result") from None
    return _python_result(analyzer, result, steps, rows.num_rows)


def _rows_json(
    analyzer: DeclaredAnalyzer, rows: pa.Table, timeout_s: float, memory_limit: str
) -> str:
    """`rows` as one JSON object of columns ({column: [value per row]}; a map is an object),
    written by DuckDB: several times faster than Python objects through json.dumps."""
    if rows.num_rows == 0:
        return json.dumps({c: [] for c in rows.column_names})
    ordered = rows.append_column(_ROW, pa.array(np.arange(rows.num_rows)))
    lists = ", ".join(f'"{c}": list("{c}" ORDER BY {_ROW})' for c in rows.column_names)
    own = ReadOnlyQuery(ordered, None, None, timeout_s=timeout_s, memory_limit=memory_limit)
    try:
        _, result = own.query(f"SELECT to_json({{{lists}}}) FROM rollouts", {},
                              field=f"analyzers.{analyzer.name}.inputs")
    except EvoError as err:
        raise analyzer.error(err.message, err.hint) from None
    finally:
        own.close()
    return result[0][0]


def _python_result(
    analyzer: DeclaredAnalyzer, result: Any, steps: np.ndarray, num_rows: int
) -> tuple[float | None, list[list[float]]]:
    """(value, points) from a Python analyzer's result, checked against its kind."""
    kind = analyzer.kind
    if kind == "scalar":
        return _number(analyzer, result, "the result"), []
    if kind == "series":
        if not isinstance(result, dict) or set(result) != {"value", "series"} or not isinstance(
            result["series"], dict
        ):
            raise analyzer.error('a series analyzer returns {"value": v, "series": {step: v}}')
        points = []
        for step, value in result["series"].items():
            try:
                step_number = int(step)
            except ValueError:
                raise analyzer.error(f"series step {step!r} is not an integer") from None
            number = _number(analyzer, value, f"series[{step}]")
            if number is not None:
                points.append([step_number, number])
        return _number(analyzer, result["value"], "value"), sorted(points)
    if not isinstance(result, list):
        raise analyzer.error(f"a {kind} analyzer returns a list, not {type(result).__name__}")
    if kind == "per_row":
        if len(result) != num_rows:
            raise analyzer.error(f"returned {len(result)} values for {num_rows} rows")
        return _mean(analyzer, steps.tolist(), result)
    if any(not isinstance(g, dict) or set(g) != {*GROUP_KEYS, "value"} for g in result):
        raise analyzer.error('a per_group analyzer returns [{"seed", "step", "group_id", '
                             '"value"}, ...]')
    return _aggregate(analyzer, [*GROUP_KEYS, "value"],
                      [[g[k] for k in (*GROUP_KEYS, "value")] for g in result])


def _number(analyzer: DeclaredAnalyzer, value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        raise analyzer.error(f"{what} is {type(value).__name__}, not a number")
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else float(value)
