"""Early stops replayed over recorded runs: which stop a harness revision would (not) have made.

A revision's `early_stop` rules (and the alert thresholds and params they read) decide when a
running job is stopped. To show what revising them changes, every recorded run (succeeded or
stopped, its rollouts still on disk) is replayed step by step: the rows of the steps so far
are diagnosed as the live look diagnoses them (diagnose_incremental, carrying its state from
one step to the next) and the rules are evaluated by the controller's own `early_stop` over
the same variables (`stop_variables`: rows, step, latest.<metric>, critical, ...). The first
step where a rule holds is the stop that revision would have made.

A replay re-diagnoses each recorded step with only what a stop reads (`stop_inputs`: the
rules, the alerts, the params and the metrics they name), so `harness diff` runs it only when
the two revisions differ there (`stops_may_differ`), and each replay's outcome is kept beside
the backtest's diagnoses (.evotrainer/cache/backtest), keyed by what it depends on: those
inputs, the version's branch, its resolved recipe and the code that replays. Two revisions
that differ only in what no stop reads share their replays.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from evotrainer.control.live import LiveView, early_stop
from evotrainer.diagnosis.diagnose import fired_level
from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.diagnosis.incremental import diagnose_incremental, diagnose_prefixes
from evotrainer.evidence.io import read_rollouts, read_steps
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.gate.harness_backtest import _code_digest, _remember
from evotrainer.store.cel import names
from evotrainer.store.lineage import tree_order
from evotrainer.store.records import JobState
from evotrainer.store.workspace import VersionState, Workspace

REPLAYED_STATES = (JobState.SUCCEEDED, JobState.STOPPED)


def stop_inputs(harness: HarnessRevision) -> HarnessRevision:
    """`harness` cut to what its early stops read: the rules, the params, the alerts (the
    rules read which fire; only their critical levels where no rule reads `alerts` or
    `warning_alerts`, as a critical level fires whatever follows it), and the metrics a rule
    or a kept level names. Alert examples are left out (no rule reads them), and the digest
    is of what is kept."""
    warned = any(names(rule.when) & {"alerts", "warning_alerts"} for rule in harness.early_stop)
    alerts = tuple(
        dataclasses.replace(alert, sample_limit=0, levels=levels)
        for alert in harness.alerts
        if (levels := tuple(level for level in alert.levels
                            if warned or level.severity == "critical"))
    )
    texts = " ".join([rule.when for rule in harness.early_stop] +
                     [level.when for alert in alerts for level in alert.levels])
    read = {alert.metric for alert in alerts} | {
        m.name for m in harness.metrics if re.search(rf"\b{re.escape(m.name)}\b", texts)}
    kept = dataclasses.replace(
        harness, metrics=tuple(m for m in harness.metrics if m.name in read), alerts=alerts)
    content = {field: dataclasses.asdict(kept)[field]
               for field in ("params", "metrics", "alerts", "early_stop", "analyzers")}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode())
    return dataclasses.replace(kept, digest=digest.hexdigest())


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


def replay_stop(ws: Workspace, states: dict[str, VersionState], name: str,
                harness: HarnessRevision) -> dict[str, Any] | None:
    """The first early stop `harness` (a revision's `stop_inputs`) would have made on
    `name`'s recorded run, or None."""
    if not harness.early_stop:
        return None
    memo = _memo(ws, states, name, harness)
    found, stop = _kept(memo)
    if not found:
        stop = _replay(ws, states[name], harness, ws.resolved_recipe(name, states))
        _remember(memo, {"stop": stop})
    return stop


def _memo(ws: Workspace, states: dict[str, VersionState], name: str,
          harness: HarnessRevision) -> Path:
    """Where this revision's replay of this run is kept, from an earlier harness diff."""
    state = states[name]
    key = _memo_key(harness, state.name, state.sha, ws.resolved_recipe(name, states))
    return ws.state_dir / "cache" / "backtest" / f"stop-{key}.json"


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


def _replay(ws: Workspace, state: VersionState, harness: HarnessRevision, recipe: dict
            ) -> dict[str, Any] | None:
    """The replay itself: the run's evidence up to each recorded step diagnosed and looked
    at as the live look does; every step's metrics from one pass where they all combine
    (`diagnose_prefixes`), else each step's diagnosis carried to the next."""
    name = state.name
    files = RunArtifacts(ws.run_dir(name, state.records["run"]))
    table = read_rollouts(files.rollouts_dir)
    steps = read_steps(files.steps) if files.steps.is_file() else None
    seeds = recipe.get("seeds") or [0]
    total = int(recipe["grpo"]["steps"]) * len(seeds)
    looks = _looks(table, total)
    prefixes = diagnose_prefixes(table, steps, harness, [look.step for look in looks])
    carried = None
    for i, look in enumerate(looks):
        if prefixes is not None:
            metrics, latest = prefixes[i]
            diagnosis = {"metrics": metrics, "alerts": _alerts(harness, metrics),
                         "series": {name: [point] for name, point in latest.items()}}
        else:
            so_far = table.filter(pc.less_equal(table["step"], look.step))
            steps_so_far = steps.filter(pc.less_equal(steps["step"], look.step)) \
                if steps is not None and "step" in steps.column_names else steps
            diagnosis, carried = diagnose_incremental(so_far, steps_so_far, harness, carried)
        view = LiveView(name, "replay", recipe.get("backend") or "local", step=look.done,
                        steps=total, rows=look.rows, val_rows=look.val_rows,
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
    rows: int
    val_rows: int


def _looks(table: pa.Table, total: int) -> list[_Look]:
    """A look at each recorded train step while steps are left to save (at the last one the
    live look stops nothing: early_stop), counted from one grouping of the rows."""
    counts = table.group_by(["split", "seed", "step"]).aggregate([([], "count_all")])
    keys = [row for row in counts.to_pylist() if row["step"] is not None]
    looks = []
    for step in sorted({k["step"] for k in keys if k["split"] == "train"}):
        upto = [k for k in keys if k["step"] <= step]
        done = sum(k["split"] == "train" for k in upto)
        if done >= total:
            break
        looks.append(_Look(step, done, *(sum(k["count_all"] for k in upto if k["split"] == s)
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
    old, new = stop_inputs(old), stop_inputs(new)
    out = []
    for name in replayed_versions(ws, states):
        before, after = replay_stop(ws, states, name, old), replay_stop(ws, states, name, new)
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
