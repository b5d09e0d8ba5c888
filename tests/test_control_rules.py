"""Reconcile's decision rules over observed facts, without a backend or git: each case is
what `observe` would read, and the plan `decide_next` must make of it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from evotrainer.backends.base import JobStatus
from evotrainer.control.decide import Observed, decide_next, progress_text
from evotrainer.store.records import DecisionRecord, DiagnosisRecord, JobState, RunRecord

RUN = RunRecord(state="Succeeded", attempt=1, job_id="evo-v1-a1-x", backend="local",
                artifact_dir="a", spec_digest="d1", created_at="2025-01-01T00:00:00Z")
DONE = Observed(
    name="v1", run=RUN, approval="approved", spec_digest="d1", parent="v0",
    parent_run_state="Succeeded", harness_name="h0", harness_digest="H",
    diagnosis=DiagnosisRecord("h0", "H"), decision=DecisionRecord("promote", "better", "H"),
    on_main=True,
)


def kind(observed: Observed) -> str | None:
    decided = decide_next(observed)
    return decided.action.kind if decided.action else None


def test_a_version_never_run_launches_only_when_approved_and_a_slot_is_free():
    fresh = replace(DONE, run=None, diagnosis=None, decision=None, on_main=False)
    assert kind(fresh) == "launch"
    assert "max_concurrent_jobs" in decide_next(replace(fresh, slot_free=False)).note
    assert "awaiting approval" in decide_next(replace(fresh, approval="unapproved")).note
    assert "re-approval" in decide_next(replace(fresh, approval="stale")).note
    assert kind(replace(fresh, approval="unapproved", auto_approvable=True)) == "approve"


@pytest.mark.parametrize(("job", "health", "expected"), [
    (JobStatus(JobState.SUCCEEDED), "Running", "collect"),
    (JobStatus(JobState.FAILED, "boom"), "Running", "fail"),
    (JobStatus(JobState.UNKNOWN), "Running", "fail"),
    (JobStatus(JobState.UNKNOWN), "Pending", "launch"),  # recorded, never started
    (JobStatus(JobState.RUNNING), "Pending", "poll"),
    (JobStatus(JobState.RUNNING), "Running", None),
])
def test_an_active_run_follows_its_job(job, health, expected):
    observed = replace(DONE, run=replace(RUN, state=health), job=job, diagnosis=None,
                       decision=None)
    assert kind(observed) == expected


def test_a_running_job_shows_its_progress():
    job = JobStatus(JobState.RUNNING, steps_done=3, steps_total=8, seconds_left=125.0)
    decided = decide_next(replace(DONE, run=replace(RUN, state="Running"), job=job))
    assert decided.note == "job running: step 3 of 8, ~2m05s left"
    assert progress_text(JobStatus(JobState.RUNNING)) == ""


def test_failed_runs_retry_within_max_attempts_unless_the_machine_failed():
    failed = replace(DONE, run=replace(RUN, state="Failed", detail="loss is nan"),
                     diagnosis=None, decision=None)
    assert kind(failed) == "retry"
    assert "negative evidence" in decide_next(replace(failed, max_attempts=1)).note
    disk = replace(failed, run=replace(failed.run, detail="[Errno 28] No space left"))
    assert kind(disk) is None and "infrastructure" in decide_next(disk).note


def test_a_cancelled_run_waits_for_retry():
    cancelled = replace(DONE, run=replace(RUN, state="Cancelled", detail="cancelled by ann"),
                        diagnosis=None, decision=None)
    decided = decide_next(cancelled)
    assert decided.action is None and decided.health == "Cancelled"
    assert "evotrainer retry v1" in decided.note


def test_drift_waits_for_reapproval_then_retrains():
    drifted = replace(DONE, spec_digest="d2")
    assert decide_next(drifted).sync == "Drifted" and kind(drifted) is None
    assert kind(replace(drifted, reapproved_after_run=True)) == "retry"


def test_evidence_is_diagnosed_then_gated_then_promoted_in_order():
    collected = replace(DONE, diagnosis=None, decision=None, on_main=False)
    assert kind(collected) == "diagnose"
    assert "waiting for parent" in decide_next(
        replace(collected, parent_run_state="Running")).note
    assert kind(replace(collected, diagnosis=DiagnosisRecord("h-1", "OLD"))) == "rediagnose"
    diagnosed = replace(collected, diagnosis=DiagnosisRecord("h0", "H"))
    assert kind(diagnosed) == "gate"
    assert kind(replace(diagnosed, parent_diagnosed=False)) is None
    assert kind(replace(diagnosed, decision=DecisionRecord("promote", "", "OLD"))) == "gate"
    assert kind(replace(DONE, on_main=False)) == "promote"
    pruned = replace(DONE, decision=DecisionRecord("prune", "leak", "H"))
    assert kind(pruned) == "prune" and kind(replace(pruned, pruned=True)) is None
    assert kind(replace(DONE, evidence_pending=True)) == "evidence"
    assert decide_next(DONE).note == "done: promote"


def test_a_continuing_child_waits_for_its_parents_policy_and_reports_a_dropped_one():
    child = replace(DONE, run=None, diagnosis=None, decision=None, on_main=False)
    waiting = decide_next(replace(child, parent_policy="waiting for v0's trained policy"))
    assert waiting.action is None and "waiting for v0" in waiting.note
    dropped = decide_next(replace(child, parent_policy="error: v0's policy was dropped"))
    assert dropped.action is None and dropped.error == "v0's policy was dropped"


STOP = {"rule": "leak", "alert": "leak", "reason": "rollouts leak", "step": 8, "steps": 200,
        "rows": 768}


def test_an_early_stop_stops_a_running_job_before_it_is_polled():
    running = replace(DONE, run=replace(RUN, state="Running"), job=JobStatus(JobState.RUNNING),
                      diagnosis=None, decision=None, live_stop=STOP)
    decided = decide_next(running)
    assert decided.action.kind == "stop" and decided.health == "Stopped"
    assert decided.action.reason == "early stop leak at step 8 of 200: rollouts leak"
    # Recorded Pending while the job already runs: stopped, not first polled.
    assert kind(replace(running, run=replace(RUN, state="Pending"))) == "stop"
    # A job that finished meanwhile is collected and gated as usual.
    assert kind(replace(running, job=JobStatus(JobState.SUCCEEDED))) == "collect"
    # A failed live look is shown; the job keeps running.
    failed_look = decide_next(replace(running, live_stop=None, live_error="ArrowInvalid: torn"))
    assert failed_look.action is None
    assert failed_look.note == "job running; live diagnosis failed: ArrowInvalid: torn"


def test_a_stopped_run_goes_to_its_verdict_and_a_job_left_running_is_cancelled_again():
    stopped = replace(DONE, run=replace(RUN, state="Stopped"), stopped=STOP, on_main=False,
                      diagnosis=DiagnosisRecord("h0", "H"),
                      decision=DecisionRecord("prune", "stopped early", "H"))
    # No final scores: never collected, diagnosed, re-diagnosed or re-gated, even under a
    # harness changed since.
    assert kind(stopped) == "prune"
    assert kind(replace(stopped, harness_digest="NEW", diagnosis=DiagnosisRecord("h0", "H"),
                        decision=DecisionRecord("prune", "", "H"))) == "prune"
    done = decide_next(replace(stopped, pruned=True))
    assert done.action is None and done.health == "Stopped"
    assert done.note == "stopped early by alert leak at step 8 of 200; done: prune"
    assert kind(replace(stopped, pruned=True, evidence_pending=True)) == "evidence"
    # A pass died between the stop's commit and the cancel: the job is cancelled first,
    # never followed as an active job, nor stopped by a live look again.
    alive = replace(stopped, job=JobStatus(JobState.RUNNING))
    assert kind(alive) == "stop" and "still running" in decide_next(alive).action.reason
    assert decide_next(replace(alive, live_stop=STOP)).action.reason == (
        "the stopped job is still running")
    assert kind(replace(stopped, job=JobStatus(JobState.FAILED, "killed"))) == "prune"


def test_a_child_of_a_stopped_parent_is_refused_before_it_spends_compute():
    fresh = replace(DONE, run=None, diagnosis=None, decision=None, on_main=False,
                    parent_run_state="Stopped")
    decided = decide_next(fresh)
    assert decided.action is None
    assert "stopped early" in decided.error and "v0's parent" in decided.error
    # A child that already ran (before the parent was stopped) keeps its records.
    assert decide_next(replace(DONE, parent_run_state="Stopped")).error is None
