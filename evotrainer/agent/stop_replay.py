"""Early stops replayed over recorded runs: which stop a harness revision would (not) have made.

A revision's `early_stop` rules (and the alert thresholds and params they read) decide when a
running job is stopped. To show what revising them changes, every recorded run (succeeded or
stopped, its rollouts still on disk) is replayed step by step: the rows of the steps so far
are diagnosed as the live look diagnoses them (diagnose_incremental, carrying its state from
one step to the next) and the rules are evaluated by the controller's own `early_stop` over
the same variables (`stop_variables`: rows, step, latest.<metric>, critical, ...). The first
step where a rule holds is the stop that revision would have made.

A replay diagnoses only what a stop reads (`stop_inputs`: the rules, the alerts, the params
and the metrics they name): a run once, each step's metrics merged from its per-step
partials where they all combine (`diagnose_prefixes`), else each step in turn. `harness
diff` replays only when the two revisions differ there (`stops_may_differ`), shares the work
with a child process on another core (agent/diff_work.py), and each replay's outcome is
kept beside the backtest's diagnoses (.evotrainer/cache/backtest), keyed by what it depends
on: those inputs, the version's branch, its resolved recipe and the code that replays. Two
revisions that differ only in what no stop reads share their replays.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from evotrainer.control.live import LiveView, early_stop
from evotrainer.diagnosis.diagnose import columns_read, fired_level
from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.diagnosis.incremental import Prefix, diagnose_incremental, diagnose_prefixes
from evotrainer.evidence.io import read_rollouts, read_steps
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.gate.harness_backtest import _code_digest, _remember
from evotrainer.store.cel import members_tested, names
from evotrainer.store.lineage import tree_order
from evotrainer.store.records import JobState
from evotrainer.store.workspace import VersionState, Workspace

REPLAYED_STATES = (JobState.SUCCEEDED, JobState.STOPPED)


def stop_inputs(harness: HarnessRevision) -> HarnessRevision:
    """`harness` cut to what its early stops read: the rules, the params, the alerts whose
    firing a rule can tell (`_observed_alerts`; only their critical levels where no rule
    reads `alerts` or `warning_alerts`, as a critical level fires whatever follows it), and
    the metrics a rule or a kept level names. Alert examples are left out (no rule reads
    them), and the digest is of what is kept."""
    read = set().union(*(names(rule.when) for rule in harness.early_stop))
    warned = bool(read & {"alerts", "warning_alerts"})
    observed = _observed_alerts(harness, read)
    alerts = tuple(
        dataclasses.replace(alert, sample_limit=0, levels=levels)
        for alert in harness.alerts
        if alert.name in observed and (levels := tuple(
            level for level in alert.levels if warned or level.severity == "critical"))
    )
    texts = " ".join([rule.when for rule in harness.early_stop] +
                     [level.when for alert in alerts for level in alert.levels])
    metrics = {alert.metric for alert in alerts} | {
        m.name for m in harness.metrics if re.search(rf"\b{re.escape(m.name)}\b", texts)}
    kept = dataclasses.replace(
        harness, metrics=tuple(m for m in harness.metrics if m.name in metrics), alerts=alerts)
    content = {field: dataclasses.asdict(kept)[field]
               for field in ("params", "metrics", "alerts", "early_stop", "analyzers")}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode())
    return dataclasses.replace(kept, digest=digest.hexdigest())


def _observed_alerts(harness: HarnessRevision, read: set[str]) -> set[str]:
    """The alerts whose firing the rules can tell, from the names they read: every one where
    a rule reads `alerts`, `warning_alerts` or `critical_alerts`, or reads `critical` other
    than as `'name' in critical`; else those named so, and those of the behavior layer where
    a rule reads `critical_behavior_alerts`."""
    every = {alert.name for alert in harness.alerts}
    if read & {"alerts", "warning_alerts", "critical_alerts"}:
        return every
    observed = {alert.name for alert in harness.alerts
                if harness.metric(alert.metric).layer == "behavior"} \
        if "critical_behavior_alerts" in read else set()
    for rule in harness.early_stop:
        if "critical" in names(rule.when):
            tested = members_tested(rule.when, "critical")
            if tested is None:
                return every
            observed |= tested
    return observed


def stops_may_differ(old: HarnessRevision, new: HarnessRevision) -> bool:
    """Whether a stop could differ: the rules, or what they read — alerts, params, or a
    metric a rule or an alert names whose definition changed. A revision that only adds
    metrics nothing reads is not replayed."""
    if not (old.early_stop or new.early_stop):
        return False
    return stop_inputs(old).digest != stop_inputs(new).digest


def replayed_versions(ws: Workspace, states: dict[str, VersionState]) -> list[str]:
    """Versions whose run ended (collected or stopped) with its rollouts on disk."""
    out = []
    for name in tree_order(states):
        run = states[name].records.get("run") or {}
        if run.get("state") in REPLAYED_STATES and run.get("artifact_dir") and \
                (ws.root / run["artifact_dir"]).is_dir():
            out.append(name)
    return out


def replay_stops(ws: Workspace, states: dict[str, VersionState], name: str,
                 harnesses: list[HarnessRevision]) -> list[dict[str, Any] | None]:
    """The first early stop each of `harnesses` (revisions' `stop_inputs`) would have made
    on `name`'s recorded run, or None: kept ones read back, the others replayed together."""
    memos = [_memo(ws, states, name, h) if h.early_stop else None for h in harnesses]
    stops = [_kept(memo) if memo is not None else (True, None) for memo in memos]
    missing = [i for i, (found, _) in enumerate(stops) if not found]
    if missing:
        replayed = _replay(ws, states[name], [harnesses[i] for i in missing],
                           ws.resolved_recipe(name, states))
        for i, stop in zip(missing, replayed, strict=True):
            stops[i] = (True, stop)
            _remember(memos[i], {"stop": stop})
    return [stop for _, stop in stops]


def _memo(ws: Workspace, states: dict[str, VersionState], name: str,
          harness: HarnessRevision) -> Path:
    """Where this revision's replay of this run is kept, from an earlier harness diff."""
    state = states[name]
    key = _memo_key(harness, state.name, state.sha, ws.resolved_recipe(name, states))
    return ws.state_dir / "cache" / "backtest" / f"stop-{key}.json"


def replays_kept(ws: Workspace, states: dict[str, VersionState], runs: list[str],
                 cut: list[HarnessRevision]) -> bool:
    """Whether every replay of `runs` under `cut` (revisions' `stop_inputs`) is kept from an
    earlier diff."""
    return all(_kept(_memo(ws, states, name, h))[0] for name in runs for h in cut
               if h.early_stop)


def _kept(memo: Path) -> tuple[bool, dict[str, Any] | None]:
    """(found, the stop) of a kept replay; a memo that is not one is not found."""
    try:
        kept = json.loads(memo.read_bytes())
        if isinstance(kept, dict) and (kept.get("stop") is None or
                                       isinstance(kept["stop"], dict)):
            return True, kept["stop"]
    except (OSError, ValueError, KeyError):
        pass
    return False, None


def _memo_key(harness: HarnessRevision, name: str, sha: str, recipe: dict) -> str:
    """What a replay depends on: what the revision's stops read (`stop_inputs`' digest), the
    version's branch (its run record and artifacts' digests), the recipe it ran (its steps
    and seeds, inherited from ancestors) and the code that diagnoses, reads the evidence and
    decides a stop."""
    parts = (harness.digest, name, sha, json.dumps(recipe, sort_keys=True, default=str),
             _code_digest(), _replay_code_digest())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@cache
def _replay_code_digest() -> str:
    """The digest of the replay and of the controller's live look and early_stop."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in (root / "agent" / "stop_replay.py", root / "control" / "live.py"):
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _replay(ws: Workspace, state: VersionState, harnesses: list[HarnessRevision],
            recipe: dict) -> list[dict[str, Any] | None]:
    """The replays themselves, of one run for each of `harnesses`: the run's evidence up to
    each recorded step diagnosed and looked at as the live look does. Every step's metrics
    come from one pass where they all combine (`diagnose_prefixes`; one pass for revisions
    that define their metrics alike), else from each step's diagnosis carried to the next."""
    files = RunArtifacts(ws.run_dir(state.name, state.records["run"]))
    read = [columns_read(h) for h in harnesses]  # a replay reads no prompt or response text
    columns = None if None in read else sorted({c for each in read for c in each})
    table = read_rollouts(files.rollouts_dir, columns=columns)
    steps = read_steps(files.steps) if files.steps.is_file() else None
    seeds = recipe.get("seeds") or [0]
    looks = _looks(table, int(recipe["grpo"]["steps"]) * len(seeds))
    ends = [look.step for look in looks]
    shared = _shared(harnesses)
    common = diagnose_prefixes(table, steps, shared, ends) if shared is not None else None
    out = []
    for harness in harnesses:
        prefixes = common if shared is not None else \
            diagnose_prefixes(table, steps, harness, ends)
        looked = _looked_from_prefixes(harness, prefixes) if prefixes is not None else \
            _looked_step_by_step(harness, table, steps, ends)
        out.append(_first_stop(state.name, harness, recipe, looks, looked))
    return out


def _shared(harnesses: list[HarnessRevision]) -> HarnessRevision | None:
    """One revision holding every metric of `harnesses`, where they bind the same params
    and analyzers and define each metric they share alike; None where they do not."""
    first = harnesses[0]
    metrics = {m.name: m for m in first.metrics}
    for other in harnesses[1:]:
        if other.params != first.params or other.analyzers != first.analyzers:
            return None
        for metric in other.metrics:
            if metrics.setdefault(metric.name, metric) != metric:
                return None
    # Metrics alone: the alerts and rules are each revision's. The digest names only the
    # incremental state of this one pass.
    return dataclasses.replace(first, metrics=tuple(metrics.values()), alerts=(),
                               early_stop=(), digest=f"{first.digest}+{len(harnesses)}")


def _looked_from_prefixes(harness: HarnessRevision, prefixes: list[Prefix]
                          ) -> Iterator[dict]:
    """The diagnosis a live look reads at each step, from prefixes holding (at least) the
    metrics of `harness`: its metrics, the alerts that fire over them, each series' latest
    point."""
    for values, latest in prefixes:
        metrics = {m.name: values[m.name] for m in harness.metrics}
        yield {"metrics": metrics, "alerts": _alerts(harness, metrics),
               "series": {n: [point] for n, point in latest.items() if n in metrics}}


def _looked_step_by_step(harness: HarnessRevision, table: pa.Table, steps: pa.Table | None,
                         ends: list[int]) -> Iterator[dict]:
    """The diagnosis of the rows up to each step, each carried to the next."""
    carried = None
    for end in ends:
        so_far = table.filter(pc.less_equal(table["step"], end))
        steps_so_far = steps.filter(pc.less_equal(steps["step"], end)) \
            if steps is not None and "step" in steps.column_names else steps
        diagnosis, carried = diagnose_incremental(so_far, steps_so_far, harness, carried)
        yield diagnosis


def _first_stop(name: str, harness: HarnessRevision, recipe: dict, looks: list[_Look],
                diagnoses: Iterator[dict]) -> dict[str, Any] | None:
    """The first look at which a rule of `harness` holds, as the stop a run record holds."""
    for look, diagnosis in zip(looks, diagnoses, strict=True):
        view = LiveView(name, "replay", recipe.get("backend") or "local", step=look.done,
                        steps=look.total, rows=look.rows, val_rows=look.val_rows,
                        diagnosis=diagnosis)
        stop = early_stop(harness, view)
        if stop is not None:
            # What the rule decided on; not when this replay ran.
            return {k: stop[k] for k in ("rule", "alert", "step", "steps", "rows")}
    return None


@dataclasses.dataclass(frozen=True)
class _Look:
    """What the live look would see at a recorded train step: the training steps done
    (summed over seeds), and the train and validation rows up to it."""

    step: int
    done: int
    total: int
    rows: int
    val_rows: int


def _looks(table: pa.Table, total: int) -> list[_Look]:
    """A look at each recorded train step while steps are left to save (of `total`, summed
    over seeds; at the last one the live look stops nothing: early_stop), counted from one
    grouping of the rows."""
    counts = table.group_by(["split", "seed", "step"]).aggregate([([], "count_all")])
    keys = [row for row in counts.to_pylist() if row["step"] is not None]
    looks = []
    for step in sorted({k["step"] for k in keys if k["split"] == "train"}):
        upto = [k for k in keys if k["step"] <= step]
        done = sum(k["split"] == "train" for k in upto)
        if done >= total:
            break
        looks.append(_Look(step, done, total,
                           *(sum(k["count_all"] for k in upto if k["split"] == s)
                             for s in ("train", "val"))))
    return looks


def _alerts(harness: HarnessRevision, metrics: dict[str, float | None]) -> list[dict]:
    """The alerts that fire over `metrics`, with what a stop rule reads of them."""
    return [{"name": alert.name, "severity": level.severity,
             "layer": harness.metric(alert.metric).layer}
            for alert in harness.alerts if (level := fired_level(harness, alert, metrics))]


def stop_changes(ws: Workspace, old: HarnessRevision, new: HarnessRevision
                 ) -> list[dict[str, Any]]:
    """Each recorded run whose early stop differs between `old` and `new`: {version,
    recorded (the stop its run record holds), before, after} — a stop that would (not) have
    fired, or fired by another rule or at another step."""
    states = ws.versions()
    return changes_over(ws, states, [stop_inputs(old), stop_inputs(new)],
                        replayed_versions(ws, states))


def changes_over(ws: Workspace, states: dict[str, VersionState], cut: list[HarnessRevision],
                 runs: list[str]) -> list[dict[str, Any]]:
    """stop_changes over `runs` for two revisions' `stop_inputs`."""
    stops = {name: replay_stops(ws, states, name, cut) for name in runs}
    out = []
    for name in runs:
        before, after = stops[name]
        if before != after:
            recorded = (states[name].records.get("run") or {}).get("stopped") or None
            out.append({"version": name, "recorded": recorded and recorded.get("rule"),
                        "before": before, "after": after})
    return out


def describe(change: dict[str, Any]) -> str:
    """`v2: no stop → collapse at step 3 of 8 (96 rollouts)`."""
    def one(stop: dict | None) -> str:
        if stop is None:
            return "no stop"
        return f"{stop['rule']} at step {stop['step']} of {stop['steps']} ({stop['rows']} " \
            "rollouts)"
    return f"{change['version']}: {one(change['before'])} → {one(change['after'])}"
