"""Early stops replayed over recorded runs: which stop a harness revision would (not) have made.

A revision's `early_stop` rules (and the alert thresholds and params they read) decide when a
running job is stopped. To show what revising them changes, every recorded run (succeeded or
stopped, its rollouts still on disk) is replayed step by step: the rows of the steps so far
are diagnosed as the live look diagnoses them (diagnose_incremental, carrying its state from
one step to the next) and the rules are evaluated by the controller's own `early_stop` over
the same variables (`stop_variables`: rows, step, latest.<metric>, critical, ...). The first
step where a rule holds is the stop that revision would have made.

A replay re-diagnoses each recorded step, so `harness diff` runs it only when the two
revisions differ in what a stop reads (`stops_may_differ`), and each replay's outcome is kept
beside the backtest's diagnoses (.evotrainer/cache/backtest), keyed by what it depends on:
the revision's digest, the version's branch, its resolved recipe and the code that replays.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from evotrainer.control.live import LiveView, early_stop
from evotrainer.diagnosis.harness import HarnessRevision
from evotrainer.diagnosis.incremental import diagnose_incremental
from evotrainer.evidence.io import read_rollouts, read_steps
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.gate.harness_backtest import _code_digest, _remember
from evotrainer.store.lineage import tree_order
from evotrainer.store.records import JobState
from evotrainer.store.workspace import VersionState, Workspace

REPLAYED_STATES = (JobState.SUCCEEDED, JobState.STOPPED)


def stops_may_differ(old: HarnessRevision, new: HarnessRevision) -> bool:
    """Whether a stop could differ: the rules, or what they read — alerts (`critical`),
    params, or a metric a rule names whose definition changed. A revision that only adds
    metrics no rule reads is not replayed."""
    if not (old.early_stop or new.early_stop):
        return False
    if old.early_stop != new.early_stop or old.alerts != new.alerts or \
            old.params != new.params:
        return True
    a, b = {m.name: m for m in old.metrics}, {m.name: m for m in new.metrics}
    redefined = {n for n in set(a) | set(b) if a.get(n) != b.get(n)}
    read = " ".join(rule.when for rule in new.early_stop)
    return any(re.search(rf"\b{re.escape(n)}\b", read) for n in redefined)


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
    """The first early stop `harness` would have made on `name`'s recorded run, or None."""
    if not harness.early_stop:
        return None
    state = states[name]
    recipe = ws.resolved_recipe(name, states)
    key = _memo_key(harness, state.name, state.sha, recipe)
    memo = ws.state_dir / "cache" / "backtest" / f"stop-{key}.json"
    try:  # this revision's replay of this very run, from an earlier harness diff
        kept = json.loads(memo.read_bytes())
        if isinstance(kept, dict) and (kept.get("stop") is None or
                                       isinstance(kept["stop"], dict)):
            return kept["stop"]
    except (OSError, ValueError, KeyError):
        pass
    stop = _replay(ws, state, harness, recipe)
    _remember(memo, {"stop": stop})
    return stop


def _memo_key(harness: HarnessRevision, name: str, sha: str, recipe: dict) -> str:
    """What a replay depends on: the revision, the version's branch (its run record and
    artifacts' digests), the recipe it ran (its steps and seeds, inherited from ancestors)
    and the code that diagnoses, reads the evidence and decides a stop."""
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
    """The replay itself: every recorded step diagnosed and looked at as the live look
    does."""
    name = state.name
    files = RunArtifacts(ws.run_dir(name, state.records["run"]))
    table = read_rollouts(files.rollouts_dir)
    steps = read_steps(files.steps) if files.steps.is_file() else None
    seeds = recipe.get("seeds") or [0]
    total = int(recipe["grpo"]["steps"]) * len(seeds)
    train = table.filter(pc.equal(table["split"], "train"))
    points = sorted(set(train["step"].to_pylist()))
    carried = None
    for step in points:
        so_far = table.filter(pc.less_equal(table["step"], step))
        steps_so_far = steps.filter(pc.less_equal(steps["step"], step)) \
            if steps is not None and "step" in steps.column_names else steps
        diagnosis, carried = diagnose_incremental(so_far, steps_so_far, harness, carried)
        view = LiveView(name, "replay", recipe.get("backend") or "local",
                        step=_steps_done(so_far), steps=total,
                        rows=_count(so_far, "train"), val_rows=_count(so_far, "val"),
                        diagnosis=diagnosis)
        stop = early_stop(harness, view)
        if stop is not None:
            # What the rule decided on; not when this replay ran.
            return {k: stop[k] for k in ("rule", "alert", "step", "steps", "rows")}
    return None


def _count(table: pa.Table, split: str) -> int:
    return int(pc.sum(pc.equal(table["split"], split)).as_py() or 0)


def _steps_done(table: pa.Table) -> int:
    """Training steps with train rollouts so far, summed over seeds (as the live look
    counts them)."""
    train = table.filter(pc.equal(table["split"], "train"))
    return len(set(zip(train["seed"].to_pylist(), train["step"].to_pylist(), strict=True)))


def stop_changes(ws: Workspace, old: HarnessRevision, new: HarnessRevision
                 ) -> list[dict[str, Any]]:
    """Each recorded run whose early stop differs between `old` and `new`: {version,
    recorded (the stop its run record holds), before, after} — a stop that would (not) have
    fired, or fired by another rule or at another step."""
    states = ws.versions()
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
