"""Live runs: a growing run's evidence diagnosed as it is written, early stop as harness data,
the records a stop commits, and `evotrainer watch`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import typer
import yaml
from typer.testing import CliRunner

from evotrainer.commands import watch as watch_cmd
from evotrainer.control.live import LiveView, observe_running, stop_records
from evotrainer.control.reconcile import record_text
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import load_harness, parse_harness, resolve_harness
from evotrainer.diagnosis.incremental import DiagnosisState, diagnose_incremental
from evotrainer.engine.outputs import ProgressRecord, read_progress
from evotrainer.errors import EvoError
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.evidence.synthetic import random_rollouts, rollout_table
from evotrainer.evidence.verl import ingest_dump, read_new
from evotrainer.store.builtin import builtin_dir

H0 = resolve_harness("h0")
H0_TEXT = (builtin_dir("harness_revisions") / "h0.yaml").read_text()
STEPS = 30


def _workspace(tmp_path: Path) -> tuple[SimpleNamespace, SimpleNamespace, dict, Path]:
    """What observe_running reads of a workspace, a version and its run record."""
    ws = SimpleNamespace(root=tmp_path, state_dir=tmp_path / ".evotrainer",
                         worktree_path=lambda name: tmp_path / "worktrees" / name)
    artifact = tmp_path / ".evotrainer" / "artifacts" / "v1" / "job"
    (artifact / "rollouts").mkdir(parents=True)
    (artifact / "recipe.json").write_text(
        json.dumps({"backend": "local", "seeds": [0], "grpo": {"steps": STEPS}})
    )
    state = SimpleNamespace(name="v1", parent="v0")
    run = {"job_id": "job-1", "backend": "local", "artifact_dir": str(artifact.relative_to(
        tmp_path)), "created_at": "2026-01-01T00:00:00+00:00", "attempt": 1}
    return ws, state, run, artifact


def _flush(artifact: Path, table: pa.Table, step: int) -> None:
    """What the engine leaves at an evaluation: the rows so far and its progress record."""
    for split in ("train", "val"):
        rows = table.filter(pc.equal(table.column("split"), split))
        pq.write_table(rows, artifact / "rollouts" / f"{split}.parquet")
    progress = ProgressRecord(RunArtifacts(artifact).progress)
    progress.begin_seed(0, STEPS)
    for done in range(1, step + 1):
        progress.stepped(done, 1.0)


def _run_rows(leak_from_step: int | None) -> pa.Table:
    """A training run: 24 steps of 4 groups of 4 (some calling `reveal` from a step on), and
    validation rows at steps 0, 8, 16, 24."""
    rows = []
    for step in range(1, 25):
        for g in range(4):
            for i in range(4):
                leaky = leak_from_step is not None and step >= leak_from_step and i < 2
                rows.append(dict(
                    step=step, task_id=f"t{g}", group_id=f"g{g}", sample_idx=i,
                    reward=float((i + step) % 3 == 0), correct=float(i % 2),
                    tool_calls=[{"name": "reveal" if leaky else "compare", "args": "5"}],
                    turns=2, response_tokens=10 + i, truncated=False, mean_logprob=-0.3,
                ))
    for step in (0, 8, 16, 24):
        rows += [dict(split="val", step=step, task_id=f"t{g}", group_id=f"t{g}", sample_idx=i,
                      correct=float(i % 2), tool_calls=[{"name": "compare", "args": "1"}])
                 for g in range(4) for i in range(2)]
    return rollout_table(rows)


def _upto(table: pa.Table, step: int) -> pa.Table:
    return table.filter(pc.less_equal(table.column("step"), step))


def test_live_diagnosis_of_a_growing_run_equals_the_full_diagnosis(tmp_path):
    ws, state, run, artifact = _workspace(tmp_path)
    table = _run_rows(leak_from_step=None)
    views = []
    for step in (8, 16, 24):
        _flush(artifact, _upto(table, step), step)
        views.append(observe_running(ws, state, run, H0))
    full = diagnose(table, None, H0)
    last = views[-1].diagnosis
    for name, value in full["metrics"].items():
        assert last["metrics"][name] == (value if value is None else pytest.approx(value)), name
    assert [a["name"] for a in last["alerts"]] == [a["name"] for a in full["alerts"]]
    assert last["series"]["leak_ratio"] == full["series"]["leak_ratio"]
    assert (views[-1].step, views[-1].steps, views[-1].rows) == (24, STEPS, 24 * 16)
    assert all(v.fresh for v in views) and all(v.stop is None for v in views)
    # A second look at unchanged evidence reuses the diagnosis instead of diagnosing again.
    again = observe_running(ws, state, run, H0)
    assert not again.fresh and again.diagnosis["metrics"] == last["metrics"]
    assert again.rows == views[-1].rows
    # Nothing of this reaches git: the live state sits in the git-ignored state dir.
    assert {p.name for p in (tmp_path / ".evotrainer" / "live" / "v1").iterdir()} >= {
        "state.json", "diagnosis.json", "diagnosis-state.json"}


def test_diagnosis_state_round_trips_through_json():
    table = random_rollouts(600, steps=6)
    _, state = diagnose_incremental(table, None, H0)
    restored = DiagnosisState.from_json(state.to_json())
    assert restored == state
    assert DiagnosisState.from_json("{not json") is None
    weird = DiagnosisState("d", {}, {"m": {(0, 1): {b"bytes": 2}}})
    assert weird.to_json() is None  # a value JSON cannot carry: start afresh, never half


def test_early_stop_fires_on_a_leaky_run_and_records_a_pruned_stop(tmp_path):
    ws, state, run, artifact = _workspace(tmp_path)
    table = _run_rows(leak_from_step=5)
    _flush(artifact, _upto(table, 4), 4)
    assert observe_running(ws, state, run, H0).stop is None  # no leak yet
    _flush(artifact, _upto(table, 8), 8)
    view = observe_running(ws, state, run, H0)
    assert view.stop is not None and view.stop["rule"] == "leak"
    assert (view.stop["step"], view.stop["steps"]) == (8, STEPS)
    # The stop is kept for the job: the next look (say, reconcile's) sees the same one.
    assert observe_running(ws, state, run, H0).stop["at"] == view.stop["at"]
    records = stop_records(state, run, H0, view)
    assert records.run["state"] == "Stopped" and records.run["result"]["steps_done"] == 8
    assert records.decision["verdict"] == "prune"
    assert records.decision["blocked_by"] == ["leak"]
    assert records.decision["rule"] == "early_stop.leak"
    assert records.trailers["Action"] == "stop"
    # The diagnosis and the decision are valid records as reconcile commits them.
    record_text("decision", records.decision)
    text = record_text("diagnosis", records.diagnosis)
    assert "leak" in yaml.safe_load(text.split("\n", 1)[1])["alerts"][0]["name"]


def test_a_clean_run_and_a_finished_one_are_not_stopped(tmp_path):
    ws, state, run, artifact = _workspace(tmp_path)
    table = _run_rows(leak_from_step=None)
    for step in (8, 24):
        _flush(artifact, _upto(table, step), step)
        assert observe_running(ws, state, run, H0).stop is None
    # A leaky run at its last step: nothing left to save, it finishes and the gate decides.
    ws, state, run, artifact = _workspace(tmp_path / "done")
    (artifact / "recipe.json").write_text(
        json.dumps({"backend": "local", "seeds": [0], "grpo": {"steps": 24}}))
    leaky = _run_rows(leak_from_step=1)
    _flush(artifact, leaky, 24)
    assert observe_running(ws, state, run, H0).stop is None


def _collapsed(mean_logprob: float | None) -> pa.Table:
    """Every group's rewards equal at every step."""
    return rollout_table([
        dict(step=s, group_id=f"g{g}", task_id=f"t{g}", sample_idx=i, reward=1.0, correct=1.0,
             mean_logprob=mean_logprob)
        for s in range(1, 9) for g in range(4) for i in range(4)
    ])


def test_collapse_stops_and_a_null_metric_never_fires(tmp_path):
    ws, state, run, artifact = _workspace(tmp_path)
    _flush(artifact, _collapsed(-0.01), 8)
    view = observe_running(ws, state, run, H0)
    assert view.stop is not None and view.stop["rule"] == "collapse"
    # The same collapse without recorded logprobs: latest.mean_logprob is null, no stop.
    ws, state, run, artifact = _workspace(tmp_path / "null")
    _flush(artifact, _collapsed(None), 8)
    view = observe_running(ws, state, run, H0)
    assert view.diagnosis["metrics"]["mean_logprob"] is None and view.stop is None


def test_a_rule_reading_a_missing_series_never_fires(tmp_path):
    doc = yaml.safe_load(H0_TEXT)
    doc["early_stop"] = [{"name": "odd", "when": "latest.no_such_metric > 0.0", "reason": "x"}]
    harness = parse_harness(doc, source="h.yaml")
    ws, state, run, artifact = _workspace(tmp_path)
    _flush(artifact, _run_rows(leak_from_step=1), 8)
    assert observe_running(ws, state, run, harness).stop is None


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize(
    ("old", "new", "needle", "field", "message"),
    [
        # A folded `when: >-` is located where its value starts, on the key's line.
        ("rows >= params.stop_min_rollouts", "rowz >= params.stop_min_rollouts",
         ("rowz", -1), "early_stop[1].when", "unknown name(s) rowz"),
        ("    alert: dead_groups\n", "    alert: dead_group\n", ("alert: dead_group", 0),
         "early_stop[1].alert", "unknown alert 'dead_group'"),
        ("    alert: dead_groups\n", "    alerts: dead_groups\n", ("alerts: dead_groups", 0),
         "early_stop[1]", "unknown key 'alerts'"),
    ],
)
def test_early_stop_errors_carry_file_line_and_column(tmp_path, old, new, needle, field,
                                                      message):
    assert old in H0_TEXT
    path = tmp_path / "h1.yaml"
    path.write_text(H0_TEXT.replace(old, new, 1))
    with pytest.raises(EvoError) as err:
        load_harness(path)
    assert message in err.value.message
    line = _line_of(path.read_text(), needle[0]) + needle[1]
    assert err.value.where.startswith(f"{path}:{line}:")
    assert err.value.field.startswith(field)


def test_duplicate_early_stop_rules_are_refused():
    doc = yaml.safe_load(H0_TEXT)
    doc["early_stop"].append(copy.deepcopy(doc["early_stop"][0]))
    with pytest.raises(EvoError, match="duplicate early-stop rule name 'leak'"):
        parse_harness(doc, source="h.yaml")


# ---- verl dumps read as they grow -----------------------------------------------------------


def _v1_lines(step: int, groups: int = 3, size: int = 4) -> list[str]:
    return [
        json.dumps({"input": f"prompt {g}", "output": f"answer {i}", "gts": "4",
                    "score": float(i == g % size), "acc": float(i == 0), "step": step,
                    "uid": f"p{step}x{g}_{i}_0"})
        for g in range(groups) for i in range(size)
    ]


def test_a_growing_verl_dump_is_read_from_where_the_last_read_stopped(tmp_path):
    dump = tmp_path / "rollouts"
    dump.mkdir()
    first = _v1_lines(1)
    kwargs = dict(version="v1", split="train", group_size=4)
    # Half of step 1's lines, the last one torn mid-write.
    torn = first[6][: len(first[6]) // 2]
    (dump / "1.jsonl").write_text("\n".join(first[:6]) + "\n" + torn)
    read, offsets = read_new(dump, None, **kwargs)
    assert read.rollouts.num_rows == 6 and not read.skipped
    assert offsets["1.jsonl"] == [len(("\n".join(first[:6]) + "\n").encode()), 6]
    # Nothing new: nothing read.
    again, same = read_new(dump, offsets, **kwargs)
    assert again.rollouts.num_rows == 0 and same == offsets
    # The torn line completed, the rest appended, and a new file for step 2.
    (dump / "1.jsonl").write_text("\n".join(first) + "\n")
    (dump / "2.jsonl").write_text("\n".join(_v1_lines(2)) + "\n")
    more, offsets = read_new(dump, offsets, **kwargs)
    assert more.rollouts.num_rows == len(first) - 6 + 12 and more.files == 2
    grown = pa.concat_tables([read.rollouts, more.rollouts])
    whole = ingest_dump(dump, **kwargs).rollouts
    key = [("step", "ascending"), ("group_id", "ascending"), ("sample_idx", "ascending")]
    assert grown.sort_by(key).equals(whole.sort_by(key))
    # A rewritten (shorter) file: read again from the start, flagged as a restart.
    (dump / "2.jsonl").write_text(_v1_lines(2)[0] + "\n")
    restart, offsets = read_new(dump, offsets, **kwargs)
    assert restart.restarted and restart.rollouts.num_rows == len(first) + 1


def test_a_corrupt_line_in_new_bytes_is_skipped_with_its_line_number(tmp_path):
    dump = tmp_path / "val"
    dump.mkdir()
    lines = _v1_lines(0, groups=1)
    (dump / "0.jsonl").write_text("\n".join(lines[:2]) + "\n")
    _, offsets = read_new(dump, None, version="v1", split="val")
    (dump / "0.jsonl").write_text("\n".join(lines[:2] + ["{broken", *lines[2:]]) + "\n")
    read, _ = read_new(dump, offsets, version="v1", split="val")
    assert read.rollouts.num_rows == 2
    assert [(s.line, s.file) for s in read.skipped] == [(3, str(dump / "0.jsonl"))]


# ---- watch ---------------------------------------------------------------------------------


def test_watch_once_prints_progress_alerts_and_the_stop(monkeypatch):
    hostile = "v[bold]9\x1b]0;pwned\x07"
    diagnosis = {"alerts": [{"name": "leak", "severity": "critical", "metric": "leak_ratio",
                             "value": 0.5}]}
    views = [
        LiveView("v1", "j1", "local", step=20, steps=60, rows=2560, val_rows=256,
                 elapsed_s=12.0, step_s=0.6, diagnosis=diagnosis,
                 stop={"rule": "leak", "step": 20}),
        LiveView(hostile, "j2", "local", steps=60),
    ]
    monkeypatch.setattr(watch_cmd, "watched", lambda ws, version: views)
    monkeypatch.setattr(watch_cmd.Workspace, "find", classmethod(lambda cls: None))
    app = typer.Typer()
    watch_cmd.register(app)
    app.command("other")(lambda: None)  # a group, so the command is invoked by name
    result = CliRunner().invoke(app, ["watch", "--once"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "step 20 of 60 (33%)" in out and "0m24s" in out  # 40 steps left at 0.6 s a step
    assert "2560 train, 256 val" in out and "leak" in out and "stop: leak" in out
    assert "no evidence yet" in out
    assert "v[bold]9" in out and "\x1b" not in out and "\x07" not in out
    result = CliRunner().invoke(app, ["watch", "--json"])
    assert json.loads(result.output)[0]["stop"]["rule"] == "leak"


def test_the_time_left_is_at_the_steps_own_pace_not_the_start_ups(tmp_path):
    """A 40-step job whose warm start took 10 minutes and whose steps take 2 s: after its
    second step it has 38 steps = 76 s left, not (10 min / 2) x 38. The gap between seeds
    (the next seed's warm start) is not a step either."""
    now = [0.0]
    progress = ProgressRecord(RunArtifacts(tmp_path).progress, clock=lambda: now[0])

    def steps(seed: int, start: float, step_s: float) -> None:
        progress.begin_seed(seed, 40)
        for step in (1, 2):
            now[0] = start + step * step_s
            progress.stepped(step, step_s)

    progress.begin_seed(0, 40)
    assert read_progress(tmp_path).seconds_per_step is None  # no step yet: no estimate
    assert LiveView("v1", "j1", "local", step=0, steps=40, elapsed_s=600.0).eta_s is None
    steps(0, start=600.0, step_s=2.0)  # the warm start took the first 10 minutes
    assert read_progress(tmp_path).seconds_per_step == 2.0
    view = LiveView("v1", "j1", "local", step=2, steps=40, elapsed_s=602.0,
                    step_s=read_progress(tmp_path).seconds_per_step)
    assert view.eta_s == 76.0
    steps(1, start=1200.0, step_s=4.0)  # seed 1's warm start: 10 minutes more
    two_seeds = read_progress(tmp_path)
    assert two_seeds.steps_done == 4
    assert two_seeds.seconds_per_step == 3.0  # (2 + 2 + 4 + 4) / 4; the gap is not a step
