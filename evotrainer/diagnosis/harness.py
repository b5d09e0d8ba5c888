"""HarnessRevision: the diagnostics of one harness version, as data loaded from YAML.

Document shape (see harness_revisions/h0.yaml):
  apiVersion: evotrainer/v1, kind: HarnessRevision, name, description, parent (optional),
  params: {...}                     values for `$name` in SQL and `params.name` in CEL
  metrics: [{name, layer, split, sql | analyzer: {name, params} | comparison, series,
             keyed, requires, params, description}]   a metric's params override the
                                               revision's for its own SQL; a keyed metric's
                                               SQL returns `key, value` rows, its value is
                                               the minimum over keys
  analyzers: [{name, description, inputs: [columns], output: {kind}, rows: {split, where},
               sql | python, limits}]   declared analyzers (diagnosis/declared.py) a metric
                                        names like a registered one
  alerts:  [{name, metric, severity, when, threshold | levels: [{severity, when,
             threshold}], message, sample: {where, limit, split}}]
  gate:    {alpha, min_delta, rules: [{name, when, verdict}]}
  early_stop: [{name, when, reason, alert}]   when a running job must stop (control/live.py)
  backtest_cases: [{version, expect}]
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evotrainer.diagnosis.analyzer_names import REGISTERED
from evotrainer.errors import EvoError
from evotrainer.evidence.columns import ROLLOUT_COLUMNS
from evotrainer.stats import GateProcedure
from evotrainer.store import cel, specs
from evotrainer.store.builtin import HARNESS_FOLDER, builtin_dir
from evotrainer.store.recipe import digest

if TYPE_CHECKING:
    from evotrainer.diagnosis.declared import DeclaredAnalyzer

LAYERS = ("score", "signal", "behavior", "version")
# Variables a gate rule may read besides the metric names (documented in the README).
GATE_VARIABLES = frozenset(
    {
        "delta",
        "ci_low",
        "ci_high",
        "p_value",
        "p_wilcoxon",
        "strata",
        "parent",
        "alpha",
        "min_delta",
        "critical_alerts",
        "critical_behavior_alerts",
        "warning_alerts",
        "alerts",
        "params",
    }
)

# Variables an early-stop rule may read besides the metric names: the live diagnosis of the
# evidence written so far (control/live.py binds them).
EARLY_STOP_VARIABLES = frozenset(
    {
        "alerts",  # names of the alerts that fire
        "critical",  # names of the critical ones
        "critical_alerts",
        "critical_behavior_alerts",
        "warning_alerts",
        "rows",  # train rollouts diagnosed so far
        "val_rows",
        "step",  # training steps done (summed over seeds)
        "steps",  # training steps the job will run (summed over seeds)
        "latest",  # {metric: its value at the latest step of its series}
        "params",
    }
)


@dataclass(frozen=True)
class Metric:
    name: str
    layer: str
    split: str
    sql: str | None = None
    analyzer: str | None = None
    analyzer_params: dict[str, Any] = field(default_factory=dict)
    comparison: str | None = None
    series: bool = False
    requires: tuple[str, ...] = ()
    description: str = ""
    # The metric's own params, over the revision's for its SQL: a catalogue metric copied
    # into a revision brings what it reads (diagnosis/catalogue.py).
    params: dict[str, Any] = field(default_factory=dict)
    # Its SQL returns `key, value` rows: one value per key (a reward component), recorded
    # under the diagnosis' `keyed`; the metric's value is the minimum over keys, so an
    # alert `metric < bound` fires when any key is below it.
    keyed: bool = False


@dataclass(frozen=True)
class Level:
    severity: str
    when: str
    threshold: float | None


@dataclass(frozen=True)
class Alert:
    name: str
    metric: str
    levels: tuple[Level, ...]  # most severe first; the first that holds fires
    message: str
    sample_where: str | None = None
    sample_limit: int = 5
    sample_split: str | None = None  # None: the metric's split; "all": every split


@dataclass(frozen=True)
class GateRule:
    name: str
    when: str
    verdict: str


@dataclass(frozen=True)
class EarlyStopRule:
    """Stop a running job when `when` holds over its live diagnosis; `alert` names the
    alert the gate records as the one that pruned it."""

    name: str
    when: str
    reason: str
    alert: str | None = None


@dataclass(frozen=True)
class HarnessRevision:
    name: str
    description: str
    parent: str | None
    params: dict[str, Any]
    metrics: tuple[Metric, ...]
    alerts: tuple[Alert, ...]
    gate_rules: tuple[GateRule, ...]
    alpha: float
    min_delta: float
    backtest_cases: tuple[dict[str, str], ...]
    digest: str
    source: str
    early_stop: tuple[EarlyStopRule, ...] = ()
    analyzers: tuple[DeclaredAnalyzer, ...] = ()
    # How the gate tests a version (CI method, resamples, strata, comparison family): the
    # revision's `gate:` fields, the method's paired bootstrap where they are absent.
    procedure: GateProcedure = GateProcedure()

    def metric(self, name: str) -> Metric:
        return next(m for m in self.metrics if m.name == name)

    def declared(self, name: str | None) -> DeclaredAnalyzer | None:
        """The analyzer this revision declares under `name`, or None (a registered one)."""
        return next((a for a in self.analyzers if a.name == name), None)

    def metric_params(self, metric: Metric) -> dict[str, Any]:
        """What `$name` reads in `metric`'s SQL: the revision's params, then its own."""
        return {**self.params, **metric.params} if metric.params else self.params


def load_harness(path: str | Path) -> HarnessRevision:
    """Read a HarnessRevision file through the spec loader: bounded YAML, the JSON Schema, then
    the checks a schema cannot express, every error with file:line:column."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise EvoError(f"cannot read harness revision: {err.strerror}", where=str(path)) from None
    return build_harness(specs.parse(raw, str(path)))


def parse_harness_text(text: str | bytes, source: str) -> HarnessRevision:
    """A HarnessRevision from YAML text (a proposal not yet on disk), errors with positions."""
    return build_harness(specs.parse(text, source))


def parse_harness(doc: Any, *, source: str = "<harness>") -> HarnessRevision:
    """A HarnessRevision from already-loaded data. Without the text there are no positions:
    errors name `source` and the field."""
    return build_harness(specs.Document(doc, source, {}))


def resolve_harness(name_or_file: str, workspace: str | Path = ".") -> HarnessRevision:
    """A file path, else `<workspace>/harness_revisions/<name>.yaml`, else the built-in one.
    Marked reviewed when it is a built-in file or its bytes are the workspace main's."""
    candidate = Path(name_or_file)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        return _reviewed(load_harness(candidate), candidate, workspace)
    builtin = builtin_dir(HARNESS_FOLDER)
    for folder in (Path(workspace) / HARNESS_FOLDER, builtin):
        if (folder / f"{name_or_file}.yaml").is_file():
            path = folder / f"{name_or_file}.yaml"
            return _reviewed(load_harness(path), path, workspace)
    names = ", ".join(sorted(p.stem for p in builtin.glob("*.yaml")))
    raise EvoError(
        f"no harness revision named {name_or_file!r}",
        hint=f"pass a YAML file or a name under harness_revisions/ (built-in: {names})",
    )


def _reviewed(revision: HarnessRevision, path: Path, workspace: str | Path) -> HarnessRevision:
    """`revision` with its Python analyzers marked reviewed when the file at `path` is a
    built-in revision, or holds exactly what `refs/heads/main` of the workspace's repository
    holds at that path. Only a revision with a Python analyzer costs a git read."""
    if not any(a.python is not None for a in revision.analyzers):
        return revision
    real = path.resolve()
    reviewed = real.is_relative_to(builtin_dir(HARNESS_FOLDER).resolve())
    root = Path(workspace).resolve()
    if not reviewed and real.is_relative_to(root):
        from evotrainer.store.git import GitStore  # only for revisions with Python analyzers

        try:
            store = GitStore(root)
            relative = real.relative_to(store.root.resolve()).as_posix()
            on_main = store.read("refs/heads/main", relative)
            reviewed = on_main is not None and on_main == real.read_bytes()
        except Exception:  # no repository, no main, unreadable: not shown to be reviewed
            reviewed = False
    if not reviewed:
        return revision
    return replace(revision, analyzers=tuple(replace(a, reviewed=True)
                                             for a in revision.analyzers))


def build_harness(doc: specs.Document) -> HarnessRevision:
    """Check `doc` against harness-revision.schema.json, then what a schema cannot say:
    CEL compiles and names known metrics, SQL is one SELECT with defined params, analyzers
    and rollout columns exist, names are unique."""
    problems = specs.check(doc, "HarnessRevision")
    if problems:
        raise problems[0]
    return _RevisionBuilder(doc).revision()


def _BOUNDS(metric: str) -> re.Pattern[str]:
    """`metric OP bound` in a CEL condition, the bound a number or `params.NAME`."""
    return re.compile(rf"\b{re.escape(metric)}\s*(?:<=|>=|<|>|==)\s*"
                      r"(?:params\.(\w+)|(-?\d+(?:\.\d+)?(?:[eE]-?\d+)?))")


@cache
def _builtin_texts() -> frozenset[bytes]:
    """The sha256 of each built-in revision's file."""
    return frozenset(hashlib.sha256(path.read_bytes()).digest()
                     for path in builtin_dir(HARNESS_FOLDER).glob("*.yaml"))


class _RevisionBuilder:
    """A HarnessRevision from a schema-valid document, through the semantic checks a schema
    cannot make; errors carry file:line:column."""

    def __init__(self, doc: specs.Document) -> None:
        self.doc = doc
        self.params: dict[str, Any] = doc.data.get("params") or {}
        # The text of a built-in revision (a workspace's copy from `init`, or the built-in file
        # itself): frozen, and its SQL passes the checks below (tests/test_harness_golden.py
        # holds it), so its SQL is not parsed again, and checking it imports no DuckDB.
        raw = doc.raw.encode() if isinstance(doc.raw, str) else doc.raw
        self.builtin = raw is not None and hashlib.sha256(raw).digest() in _builtin_texts()

    def fail(self, path: tuple, message: str, hint: str | None = None) -> EvoError:
        return EvoError(message, where=self.doc.where(path), field=specs.dotted_field(path),
                        hint=hint)

    def cel(self, expr: str, path: tuple, allowed: frozenset[str]) -> str:
        try:
            cel.check(expr)
        except EvoError as err:
            raise self.fail(path, err.message, err.hint) from None
        unknown = sorted(cel.names(expr) - allowed)
        if unknown:
            raise self.fail(path, f"unknown name(s) {', '.join(unknown)} in {expr!r}",
                            hint="use metric names of this revision or params.<name>")
        return expr

    def sql(
        self, sql: str, path: tuple, statement: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        """`sql` (run as `statement` when given) is one SELECT whose `$params` are defined
        (in `params` when given, else the revision's)."""
        if self.builtin:
            return
        from evotrainer.diagnosis.sql import check_select, sql_params  # DuckDB parses it

        check_select(statement or sql, where=self.doc.where(path),
                     field=specs.dotted_field(path))
        defined = self.params if params is None else params
        missing = [p for p in sql_params(sql) if p not in defined]
        if missing:
            raise self.fail(path, f"uses undefined param(s) ${', $'.join(missing)}",
                            hint="define them under params:")

    def condition(self, expr: str, path: tuple) -> None:
        """`expr` is one boolean expression over rollout columns and defined `$params`: parsed
        by DuckDB and bound over the rollout schema, so it can never be more than a filter
        (a `false) UNION ALL SELECT ...` is not an expression)."""
        # DuckDB binds it over the rollout table's types (pyarrow): only a declared analyzer
        # has a row condition, and the built-in revisions declare none.
        from evotrainer.diagnosis.sql import check_condition, condition_type, sql_params
        from evotrainer.evidence.schema import ROLLOUT_SCHEMA

        where, field = self.doc.where(path), specs.dotted_field(path)
        check_condition(expr, ROLLOUT_COLUMNS, where=where, field=field)
        missing = [p for p in sql_params(expr) if p not in self.params]
        if missing:
            raise self.fail(path, f"uses undefined param(s) ${', $'.join(missing)}",
                            hint="define them under params:")
        kind = condition_type(expr, ROLLOUT_SCHEMA, self.params, where=where, field=field)
        if kind != "BOOLEAN":
            raise self.fail(path, f"is a {kind} expression, not a condition",
                            hint="compare it, e.g. `turns >= 3`")

    def revision(self) -> HarnessRevision:
        data = self.doc.data
        self.analyzers: dict[str, DeclaredAnalyzer] = {}
        for i, raw in enumerate(data.get("analyzers") or []):
            path = ("analyzers", i)
            if raw["name"] in self.analyzers or raw["name"] in REGISTERED:
                raise self.fail((*path, "name"), f"analyzer name {raw['name']!r} is taken",
                                hint="a declared analyzer needs a name no other analyzer "
                                f"has (registered: {', '.join(sorted(REGISTERED))})")
            # Imported by a revision that declares an analyzer (the built-in ones do not): it
            # brings the analyzer sandbox and the SQL runner, which checking any other does not use.
            from evotrainer.diagnosis.declared import declared_analyzer

            declared = declared_analyzer(raw, revision=data["name"],
                                         where=self.doc.where(path))
            if declared.sql is not None:
                self.sql(declared.sql, (*path, "sql"))
            if declared.where is not None:
                self.condition(declared.where, (*path, "rows", "where"))
            self.analyzers[declared.name] = declared
        metrics = tuple(self.metric(m, ("metrics", i)) for i, m in enumerate(data["metrics"]))
        by_name: dict[str, Metric] = {}
        for i, metric in enumerate(metrics):
            if metric.name in by_name:
                raise self.fail(("metrics", i, "name"),
                                f"duplicate metric name {metric.name!r}")
            by_name[metric.name] = metric
        alerts = tuple(self.alert(a, ("alerts", i), by_name)
                       for i, a in enumerate(data.get("alerts") or []))
        seen_alerts: set[str] = set()
        for i, alert in enumerate(alerts):
            if alert.name in seen_alerts:
                raise self.fail(("alerts", i, "name"), f"duplicate alert name {alert.name!r}")
            seen_alerts.add(alert.name)
        gate = data.get("gate") or {}
        gate_names = frozenset(by_name) | GATE_VARIABLES
        rules = tuple(
            GateRule(rule["name"], self.cel(rule["when"], ("gate", "rules", i, "when"),
                                            gate_names), rule["verdict"])
            for i, rule in enumerate(gate.get("rules") or [])
        )
        stop_names = frozenset(by_name) | EARLY_STOP_VARIABLES
        early_stop = tuple(
            self.early_stop_rule(rule, ("early_stop", i), stop_names, seen_alerts)
            for i, rule in enumerate(data.get("early_stop") or [])
        )
        seen_rules: set[str] = set()
        for i, rule in enumerate(early_stop):
            if rule.name in seen_rules:
                raise self.fail(("early_stop", i, "name"),
                                f"duplicate early-stop rule name {rule.name!r}")
            seen_rules.add(rule.name)
        procedure = GateProcedure.from_gate(gate)
        return HarnessRevision(
            name=data["name"],
            description=data.get("description") or "",
            parent=data.get("parent"),
            params=self.params,
            metrics=metrics,
            alerts=alerts,
            gate_rules=rules,
            procedure=procedure,
            alpha=procedure.alpha,
            min_delta=float(gate.get("min_delta", 0.0)),
            backtest_cases=tuple({"version": c["version"], "expect": c["expect"]}
                                 for c in data.get("backtest_cases") or []),
            digest=digest(data),
            source=self.doc.source,
            early_stop=early_stop,
            analyzers=tuple(self.analyzers.values()),
        )

    def early_stop_rule(
        self, rule: dict, path: tuple, allowed: frozenset[str], alerts: set[str]
    ) -> EarlyStopRule:
        alert = rule.get("alert")
        if alert is not None and alert not in alerts:
            raise self.fail((*path, "alert"), f"unknown alert {alert!r}",
                            hint=f"alerts of this revision: {', '.join(sorted(alerts))}")
        return EarlyStopRule(
            name=rule["name"],
            when=self.cel(rule["when"], (*path, "when"), allowed),
            reason=rule["reason"],
            alert=alert,
        )

    def metric(self, m: dict, path: tuple) -> Metric:
        sources = [k for k in ("sql", "analyzer", "comparison") if m.get(k) is not None]
        if len(sources) != 1:
            raise self.fail(path, "needs exactly one of sql, analyzer, comparison")
        params = m.get("params") or {}
        if params and m.get("sql") is None:
            raise self.fail((*path, "params"), "a metric's own params are for its sql",
                            hint="an analyzer's go under analyzer.params; others under the "
                            "revision's params")
        if m.get("sql") is not None:
            self.sql(m["sql"], (*path, "sql"), params={**self.params, **params})
        analyzer = m.get("analyzer") or {}
        name = analyzer.get("name")
        if analyzer and name not in REGISTERED and name not in self.analyzers:
            declared = ", ".join(sorted(self.analyzers)) or "none"
            raise self.fail((*path, "analyzer", "name"),
                            f"unknown analyzer {name!r}",
                            hint=f"registered: {', '.join(sorted(REGISTERED))}; declared in "
                            f"this revision: {declared}")
        declared = self.analyzers.get(name)
        split = m.get("split") or "train"
        if declared is not None and declared.split not in (None, split):
            raise self.fail((*path, "split"),
                            f"reads {split} rows, but analyzer {name!r} declares rows.split "
                            f"{declared.split}", hint=f"set the metric's split to "
                            f"{declared.split}")
        if m.get("comparison") is not None and m["layer"] != "version":
            raise self.fail((*path, "layer"), "a comparison metric belongs to the version layer")
        keyed = bool(m.get("keyed", False))
        if keyed and (m.get("sql") is None or m.get("series")):
            raise self.fail((*path, "keyed"), "a keyed metric is an sql metric without a series",
                            hint="return `key, value` rows from sql, and drop series")
        requires = tuple(m.get("requires") or [])
        unknown = [c for c in requires if c not in ROLLOUT_COLUMNS]
        if unknown:
            raise self.fail((*path, "requires"),
                            f"unknown rollout column(s) {', '.join(unknown)}")
        return Metric(
            name=m["name"],
            layer=m["layer"],
            split=split,
            sql=m.get("sql"),
            analyzer=analyzer.get("name"),
            analyzer_params=analyzer.get("params") or {},
            comparison=m.get("comparison"),
            series=bool(m.get("series", False)),
            requires=requires,
            description=m.get("description") or "",
            params=params,
            keyed=keyed,
        )

    def threshold(self, level: dict, path: tuple, metric: str) -> float | None:
        """The level's `threshold` (what reports and backtests show beside the value), which
        must be a bound its `when` compares the metric with: the two say one fact twice."""
        if level.get("threshold") is None:
            return None
        threshold = float(level["threshold"])
        bounds = {float(self.params[param]) if param else float(number)
                  for param, number in _BOUNDS(metric).findall(level["when"])
                  if not param or isinstance(self.params.get(param), (int, float))}
        if bounds and threshold not in bounds:
            shown = ", ".join(f"{b:g}" for b in sorted(bounds))
            raise self.fail((*path, "threshold"),
                            f"threshold {threshold:g} is not the bound `when` compares "
                            f"{metric} with ({shown})",
                            hint=f"set threshold to {shown.split(', ')[0]}, or change `when`")
        return threshold

    def alert(self, a: dict, path: tuple, metrics: dict[str, Metric]) -> Alert:
        if a["metric"] not in metrics:
            raise self.fail((*path, "metric"), f"unknown metric {a['metric']!r}",
                            hint=f"metrics of this revision: {', '.join(metrics)}")
        if ("levels" in a) == ("when" in a):
            raise self.fail(path, "needs either when/severity/threshold or levels: [...]")
        allowed = frozenset(metrics) | {"params"}
        if "levels" in a:
            raw_levels = [(level, (*path, "levels", i)) for i, level in enumerate(a["levels"])]
        else:
            if "severity" not in a:
                raise self.fail(path, "an alert with `when` needs a `severity`",
                                hint="critical or warning")
            raw_levels = [(a, path)]
        levels = tuple(
            Level(level["severity"], self.cel(level["when"], (*lpath, "when"), allowed),
                  self.threshold(level, lpath, a["metric"]))
            for level, lpath in raw_levels
        )
        sample = a.get("sample") or {}
        if sample.get("where") is not None:
            self.sql(sample["where"], (*path, "sample", "where"),
                     statement=f"SELECT 1 FROM rollouts WHERE ({sample['where']})")
        return Alert(
            name=a["name"],
            metric=a["metric"],
            levels=levels,
            message=a.get("message") or "",
            sample_where=sample.get("where"),
            sample_limit=sample.get("limit", 5),
            sample_split=sample.get("split"),
        )
