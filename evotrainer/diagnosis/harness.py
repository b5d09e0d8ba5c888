"""HarnessRevision: the diagnostics of one harness version, as data loaded from YAML.

Document shape (see harness_versions/h0.yaml):
  apiVersion: evotrainer/v1, kind: HarnessRevision, name, description, parent (optional),
  params: {...}                     values for `$name` in SQL and `params.name` in CEL
  metrics: [{name, layer, split, sql | analyzer: {name, params} | comparison, series,
             requires, description}]
  alerts:  [{name, metric, severity, when, threshold | levels: [{severity, when,
             threshold}], message, sample: {where, limit, split}}]
  gate:    {alpha, min_delta, rules: [{name, when, verdict}]}
  backtest_cases: [{version, expect}]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evotrainer.diagnosis import cel
from evotrainer.diagnosis.analyzers import ANALYZERS
from evotrainer.diagnosis.sql import check_select, sql_params
from evotrainer.errors import EvoError
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.recipe import digest

LAYERS = ("score", "signal", "behavior", "version")
SPLITS = ("train", "val")
SEVERITIES = ("critical", "warning")
VERDICTS = ("promote", "prune", "revert", "inconclusive", "block")
# Fields of stats.compare_tables() that a version-layer metric may take.
COMPARISON_FIELDS = ("delta", "ci_low", "ci_high", "p_bootstrap", "p_wilcoxon", "mean_a", "mean_b")
# Variables a gate rule may read besides the metric names (documented in the README).
GATE_VARIABLES = frozenset(
    {
        "delta",
        "ci_low",
        "ci_high",
        "p_value",
        "p_wilcoxon",
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
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


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

    def metric(self, name: str) -> Metric:
        return next(m for m in self.metrics if m.name == name)


def load_harness(path: str | Path) -> HarnessRevision:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise EvoError(f"cannot read harness revision: {err.strerror}", where=str(path)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise EvoError(f"invalid YAML: {getattr(err, 'problem', err)}", where=where) from None
    return parse_harness(doc, source=str(path))


def resolve_harness(name_or_file: str, workspace: str | Path = ".") -> HarnessRevision:
    """A file path, else `<workspace>/harness_versions/<name>.yaml`, else the built-in one."""
    candidate = Path(name_or_file)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        return load_harness(candidate)
    for folder in (Path(workspace) / "harness_versions", builtin_dir("harness_versions")):
        if (folder / f"{name_or_file}.yaml").is_file():
            return load_harness(folder / f"{name_or_file}.yaml")
    raise EvoError(
        f"no harness revision named {name_or_file!r}",
        hint="pass a YAML file or a name under harness_versions/ (built-in: h0)",
    )


class _Doc:
    """Field access with errors that name the file and the dotted field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, message: str, hint: str | None = None) -> EvoError:
        return EvoError(message, where=self.source, field=field, hint=hint)

    def get(
        self,
        mapping: dict,
        key: str,
        prefix: str,
        kind: type | tuple,
        *,
        required: bool = True,
        default: Any = None,
    ) -> Any:
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in mapping or mapping[key] is None:
            if required:
                raise self.fail(dotted, "is required")
            return default
        value = mapping[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(dotted, f"must be a {names}, not {type(value).__name__}")
        return value

    def choice(self, mapping: dict, key: str, prefix: str, choices: tuple, **kw: Any) -> Any:
        value = self.get(mapping, key, prefix, str, **kw)
        if value is not None and value not in choices:
            raise self.fail(f"{prefix}.{key}", f"{value!r} is not one of {', '.join(choices)}")
        return value

    def cel(self, expr: str, dotted: str, allowed: frozenset[str]) -> str:
        try:
            cel.check(expr)
        except EvoError as err:
            raise self.fail(dotted, err.message, err.hint) from None
        unknown = sorted(cel.names(expr) - allowed)
        if unknown:
            raise self.fail(
                dotted,
                f"unknown name(s) {', '.join(unknown)} in {expr!r}",
                hint="use metric names of this revision or params.<name>",
            )
        return expr


def parse_harness(doc: Any, *, source: str = "<harness>") -> HarnessRevision:
    """Validate a loaded HarnessRevision document and build the revision."""
    d = _Doc(source)
    if not isinstance(doc, dict):
        raise d.fail("", "a HarnessRevision must be a YAML mapping")
    if doc.get("apiVersion") != "evotrainer/v1":
        raise d.fail("apiVersion", f"must be evotrainer/v1, not {doc.get('apiVersion')!r}")
    if doc.get("kind") != "HarnessRevision":
        raise d.fail("kind", f"must be HarnessRevision, not {doc.get('kind')!r}")
    name = d.get(doc, "name", "", str)
    params = d.get(doc, "params", "", dict, required=False, default={})
    metrics = tuple(
        _metric(d, m, f"metrics[{i}]", params)
        for i, m in enumerate(d.get(doc, "metrics", "", list))
    )
    seen: set[str] = set()
    for i, metric in enumerate(metrics):
        if metric.name in seen:
            raise d.fail(f"metrics[{i}].name", f"duplicate metric name {metric.name!r}")
        seen.add(metric.name)
    by_name = {m.name: m for m in metrics}
    alerts = tuple(
        _alert(d, a, f"alerts[{i}]", by_name, params)
        for i, a in enumerate(d.get(doc, "alerts", "", list, required=False, default=[]))
    )
    if len({a.name for a in alerts}) != len(alerts):
        raise d.fail("alerts", "alert names must be unique")
    gate = d.get(doc, "gate", "", dict, required=False, default={})
    gate_names = frozenset(seen) | GATE_VARIABLES
    rules = []
    for i, rule in enumerate(d.get(gate, "rules", "gate", list, required=False, default=[])):
        prefix = f"gate.rules[{i}]"
        if not isinstance(rule, dict):
            raise d.fail(prefix, "must be a mapping with name, when, verdict")
        rules.append(
            GateRule(
                name=d.get(rule, "name", prefix, str),
                when=d.cel(d.get(rule, "when", prefix, str), f"{prefix}.when", gate_names),
                verdict=d.choice(rule, "verdict", prefix, VERDICTS),
            )
        )
    alpha = float(d.get(gate, "alpha", "gate", (int, float), required=False, default=0.05))
    if not 0 < alpha < 1:
        raise d.fail("gate.alpha", f"must lie in (0, 1), not {alpha}")
    cases = []
    for i, case in enumerate(d.get(doc, "backtest_cases", "", list, required=False, default=[])):
        prefix = f"backtest_cases[{i}]"
        if not isinstance(case, dict):
            raise d.fail(prefix, "must be a mapping with version and expect")
        cases.append(
            {
                "version": d.get(case, "version", prefix, str),
                "expect": d.choice(case, "expect", prefix, VERDICTS),
            }
        )
    return HarnessRevision(
        name=name,
        description=d.get(doc, "description", "", str, required=False, default=""),
        parent=d.get(doc, "parent", "", str, required=False),
        params=params,
        metrics=metrics,
        alerts=alerts,
        gate_rules=tuple(rules),
        alpha=alpha,
        min_delta=float(
            d.get(gate, "min_delta", "gate", (int, float), required=False, default=0.0)
        ),
        backtest_cases=tuple(cases),
        digest=digest(doc),
        source=source,
    )


def _metric(d: _Doc, m: Any, prefix: str, params: dict) -> Metric:
    if not isinstance(m, dict):
        raise d.fail(prefix, "must be a mapping")
    name = d.get(m, "name", prefix, str)
    if not _NAME.match(name):
        raise d.fail(f"{prefix}.name", f"{name!r} must be lower_snake_case (it is a CEL name)")
    layer = d.choice(m, "layer", prefix, LAYERS)
    sources = [k for k in ("sql", "analyzer", "comparison") if m.get(k) is not None]
    if len(sources) != 1:
        raise d.fail(prefix, "needs exactly one of sql, analyzer, comparison")
    sql = d.get(m, "sql", prefix, str, required=False)
    analyzer_name, analyzer_params = None, {}
    if sql is not None:
        check_select(sql, where=d.source, field=f"{prefix}.sql")
        missing = [p for p in sql_params(sql) if p not in params]
        if missing:
            raise d.fail(
                f"{prefix}.sql",
                f"uses undefined param(s) ${', $'.join(missing)}",
                hint="define them under params:",
            )
    if "analyzer" in sources:
        spec = d.get(m, "analyzer", prefix, dict)
        analyzer_name = d.get(spec, "name", f"{prefix}.analyzer", str)
        if analyzer_name not in ANALYZERS:
            raise d.fail(
                f"{prefix}.analyzer.name",
                f"unknown analyzer {analyzer_name!r}",
                hint=f"registered: {', '.join(sorted(ANALYZERS))}",
            )
        analyzer_params = d.get(
            spec, "params", f"{prefix}.analyzer", dict, required=False, default={}
        )
    comparison = None
    if "comparison" in sources:
        comparison = d.choice(m, "comparison", prefix, COMPARISON_FIELDS)
        if layer != "version":
            raise d.fail(f"{prefix}.layer", "a comparison metric belongs to the version layer")
    requires = tuple(d.get(m, "requires", prefix, list, required=False, default=[]))
    unknown = [c for c in requires if c not in ROLLOUT_SCHEMA.names]
    if unknown:
        raise d.fail(f"{prefix}.requires", f"unknown rollout column(s) {', '.join(unknown)}")
    return Metric(
        name=name,
        layer=layer,
        split=d.choice(m, "split", prefix, SPLITS, required=False, default="train"),
        sql=sql,
        analyzer=analyzer_name,
        analyzer_params=analyzer_params,
        comparison=comparison,
        series=d.get(m, "series", prefix, bool, required=False, default=False),
        requires=requires,
        description=d.get(m, "description", prefix, str, required=False, default=""),
    )


def _alert(d: _Doc, a: Any, prefix: str, metrics: dict[str, Metric], params: dict) -> Alert:
    if not isinstance(a, dict):
        raise d.fail(prefix, "must be a mapping")
    metric = d.get(a, "metric", prefix, str)
    if metric not in metrics:
        raise d.fail(f"{prefix}.metric", f"unknown metric {metric!r}")
    allowed = frozenset(metrics) | {"params"}
    if ("levels" in a) == ("when" in a):
        raise d.fail(prefix, "needs either when/severity/threshold or levels: [...]")
    raw_levels = d.get(a, "levels", prefix, list) if "levels" in a else [a]
    levels = []
    for i, level in enumerate(raw_levels):
        lp = f"{prefix}.levels[{i}]" if "levels" in a else prefix
        if not isinstance(level, dict):
            raise d.fail(lp, "must be a mapping with severity, when, threshold")
        threshold = d.get(level, "threshold", lp, (int, float), required=False)
        levels.append(
            Level(
                severity=d.choice(level, "severity", lp, SEVERITIES),
                when=d.cel(d.get(level, "when", lp, str), f"{lp}.when", allowed),
                threshold=None if threshold is None else float(threshold),
            )
        )
    sample = d.get(a, "sample", prefix, dict, required=False, default={})
    where = d.get(sample, "where", f"{prefix}.sample", str, required=False)
    if where is not None:
        check_select(
            f"SELECT 1 FROM rollouts WHERE ({where})",
            where=d.source,
            field=f"{prefix}.sample.where",
        )
        missing = [p for p in sql_params(where) if p not in params]
        if missing:
            raise d.fail(f"{prefix}.sample.where", f"uses undefined param(s) {missing}")
    limit = d.get(sample, "limit", f"{prefix}.sample", int, required=False, default=5)
    return Alert(
        name=d.get(a, "name", prefix, str),
        metric=metric,
        levels=tuple(levels),
        message=d.get(a, "message", prefix, str, required=False, default=""),
        sample_where=where,
        sample_limit=limit,
        sample_split=d.choice(
            sample, "split", f"{prefix}.sample", (*SPLITS, "all"), required=False
        ),
    )
