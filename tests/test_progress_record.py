"""The engine's progress record (progress.json): what reconcile's time left
and `watch` read instead of parsing train.log. A record that is missing, torn or not what
the engine writes gives no estimate, never a traceback."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from evotrainer.backends.base import JobSpec
from evotrainer.backends.local import running_status
from evotrainer.control.live import observe_running
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.engine.outputs import ProgressRecord, read_progress
from evotrainer.evidence.layout import RunArtifacts

STEPS = 40


def _job(artifact: Path) -> JobSpec:
    return JobSpec("evo-v1-a1-0123456789", "v1", {"grpo": {"steps": STEPS}, "seeds": [0]},
                   artifact, artifact)


def _record(artifact: Path, steps: int, step_s: float) -> None:
    """What the engine leaves after `steps` training steps of `step_s` seconds each."""
    now = [100.0]
    progress = ProgressRecord(RunArtifacts(artifact).progress, clock=lambda: now[0])
    progress.begin_seed(0, STEPS)
    for step in range(1, steps + 1):
        now[0] += step_s
        progress.stepped(step, step_s)


def _observe(tmp_path: Path):
    """`watch`'s look at a running local job whose artifact dir is `tmp_path / job`."""
    artifact = tmp_path / "job"
    (artifact / "recipe.json").write_text(
        json.dumps({"backend": "local", "seeds": [0], "grpo": {"steps": STEPS}}))
    ws = SimpleNamespace(root=tmp_path, state_dir=tmp_path / ".evotrainer",
                         worktree_path=lambda name: tmp_path / "worktrees" / name)
    run = {"job_id": "job-1", "backend": "local", "artifact_dir": "job",
           "created_at": "2026-01-01T00:00:00+00:00", "attempt": 1}
    return observe_running(ws, SimpleNamespace(name="v1", parent="v0"), run,
                           resolve_harness("h0"))


def test_the_record_gives_reconcile_and_watch_the_steps_and_the_time_left(tmp_path):
    artifact = tmp_path / "job"
    artifact.mkdir()
    _record(artifact, steps=4, step_s=1.5)
    status = running_status(_job(artifact), {"pid": 1})
    assert (status.steps_done, status.steps_total, status.progress) == (4, STEPS, 0.1)
    assert status.seconds_left == pytest.approx(36 * 1.5)
    view = _observe(tmp_path)
    assert (view.step, view.steps) == (4, STEPS)
    assert view.eta_s == pytest.approx(36 * 1.5)


def test_train_log_text_is_not_progress(tmp_path):
    """The log is for people: step lines in it, without the record, are no progress."""
    artifact = tmp_path / "job"
    artifact.mkdir()
    (artifact / "train.log").write_text("".join(
        f"2026-01-01 10:10:{2 * s:02d} seed 0 step {s}: reward 0.100 (x)\n" for s in (1, 2, 3)))
    status = running_status(_job(artifact), {"pid": 1})
    assert status.steps_done is None and status.seconds_left is None
    view = _observe(tmp_path)
    assert view.step == 0 and view.eta_s is None


VALID = {"seed": 0, "step": 4, "steps_done": 4, "steps_total": STEPS, "step_s": 1.0,
         "stepping_s": 4.0, "evaluation": None}


@pytest.mark.parametrize("content", [
    json.dumps(VALID)[:37],  # torn mid-write (a writer that did not rename atomically)
    b"",
    b"\xff\xfe not utf-8",
    "[4, 40]",
    "null",
    json.dumps({**VALID, "steps_done": "4"}),
    json.dumps({**VALID, "steps_done": True}),
    json.dumps({**VALID, "steps_done": -1}),
    json.dumps({**VALID, "steps_done": 41}),  # more steps than it says it has
    json.dumps({**VALID, "stepping_s": "NaN"}),
    json.dumps({**VALID, "stepping_s": -4.0}),
    json.dumps({**VALID, "stepping_s": float("nan")}),
    json.dumps(VALID).replace("4.0", "Infinity"),
    json.dumps({k: v for k, v in VALID.items() if k != "stepping_s"}),
    "dir",
], ids=lambda content: repr(content)[:24])
def test_a_torn_or_foreign_record_gives_no_estimate_and_no_traceback(tmp_path, content):
    artifact = tmp_path / "job"
    artifact.mkdir()
    path = RunArtifacts(artifact).progress
    if content == "dir":
        path.mkdir()
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert read_progress(artifact) is None
    status = running_status(_job(artifact), {"pid": 1, "create_time": time.time() - 600})
    assert status.steps_done is None and status.seconds_left is None
    view = _observe(tmp_path)
    assert view.step == 0 and view.eta_s is None


def test_a_missing_record_gives_no_estimate(tmp_path):
    artifact = tmp_path / "job"
    artifact.mkdir()
    assert read_progress(artifact) is None
    assert running_status(_job(artifact), {"pid": 1}).seconds_left is None
    assert _observe(tmp_path).eta_s is None


def test_the_record_is_rewritten_whole_at_each_step_and_evaluation(tmp_path):
    """Each write replaces the file (temp file, then rename) with the whole record: seed,
    step, steps done and total, the step's wall time, the last evaluation."""
    now = [0.0]
    progress = ProgressRecord(RunArtifacts(tmp_path).progress, clock=lambda: now[0])
    path = RunArtifacts(tmp_path).progress

    progress.begin_seed(7, 6)
    progress.evaluated(0, 0.25)
    assert json.loads(path.read_text()) == {
        "seed": 7, "step": 0, "steps_done": 0, "steps_total": 6, "step_s": None,
        "stepping_s": 0.0, "evaluation": {"seed": 7, "step": 0, "val_avg": 0.25}}
    now[0] = 50.0  # the step-0 evaluation and start-up: not a step
    now[0] += 3.0
    progress.stepped(1, 3.0)
    now[0] += 1.0  # an evaluation between steps counts in their pace
    progress.evaluated(1, 0.5)
    assert json.loads(path.read_text()) == {
        "seed": 7, "step": 1, "steps_done": 1, "steps_total": 6, "step_s": 3.0,
        "stepping_s": 4.0, "evaluation": {"seed": 7, "step": 1, "val_avg": 0.5}}
    assert read_progress(tmp_path).seconds_per_step == 4.0
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]  # no temp file left
