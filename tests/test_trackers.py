"""Trackers: what is written is read back with each library's own reader (TensorBoard's
EventAccumulator, the MLflow client on the local store, `wandb leet inspect` on W&B's
offline transaction log, our verl file-logger reader) and checked for values, steps and
tags. Nothing reaches the network: W&B runs offline, MLflow on a SQLite file."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from sealing import controller_commit
from standin import StandinBackend, standin_settings

from evotrainer.backends import BACKEND_TYPES
from evotrainer.control.reconcile import Reconciler
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import approve, new_version
from evotrainer.errors import EvoError
from evotrainer.evidence.verl import read_metrics_log
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import Workspace, run_path
from evotrainer.trackers import RunIdentity, logger_names, open_trackers, require
from evotrainer.trackers.records import export_version, gate_summary, log_gate, run_identity
from evotrainer.trackers.verl import verl_loggers, verl_tracker_env

TESTS = Path(__file__).resolve().parent
STEPS = {1: {"loss": 0.5, "kl": 0.01}, 2: {"loss": 0.25, "kl": 0.02}, 3: {"loss": 0.125}}
GATE = {"gate/delta": 0.2, "gate/ci_low": 0.05, "gate/ci_high": 0.35}
VERDICT = {"gate/verdict": "promote", "alerts": "dead_groups"}


@pytest.fixture(autouse=True)
def offline_trackers(monkeypatch, tmp_path):
    """No tracker server or user config: the defaults (local stores, W&B offline) only; and
    any connection this process opens (tracker threads included) other than to a local
    socket is refused and recorded, so a test that phoned home fails."""
    for name in list(os.environ):
        if name.startswith(("WANDB_", "MLFLOW_")) or name == "DO_NOT_TRACK":
            monkeypatch.delenv(name)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    outbound: list[object] = []
    connect = socket.socket.connect

    def local_only(sock: socket.socket, address: object) -> None:
        host = address[0] if isinstance(address, tuple) else None
        if sock.family != socket.AF_UNIX and host not in ("127.0.0.1", "::1", "localhost"):
            outbound.append(address)
            raise OSError(f"test: no network ({address})")
        connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    yield
    assert outbound == [], f"a tracker tried to reach the network: {outbound}"


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, made once: creating its tables takes seconds, and each
    test copies it to where the tracker opens its default store."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def identity(store: Path) -> RunIdentity:
    return RunIdentity(project="demo", version="v1", job_id="v1-a1-abc", store_root=str(store),
                       tags={"version": "v1", "parent": "v0", "skills": "close-leak",
                             "harness": "h0", "spec_commit": "c0ffee"})


def log_run(loggers: list[str], run_dir: Path, seed: int = 0, **kwargs) -> None:
    with open_trackers(loggers, run_dir, identity(run_dir.parent), seed=seed,
                       **kwargs) as trackers:
        for step, metrics in STEPS.items():
            trackers.log(step, metrics)
        trackers.summary(GATE, VERDICT)


def tensorboard_events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def tensorboard_text(events, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode())
            for e in events.Tensors(f"{tag}/text_summary")]


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of every offline run under `run_dir`, through W&B's own reader."""
    records = []
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect",
                              "--json", str(log)], capture_output=True, text=True, check=True)
        records += [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return records


# ---- each tracker, written and read back ----------------------------------------------------


def test_tensorboard_event_files_hold_steps_values_tags_and_summary(tmp_path):
    pytest.importorskip("tensorboard")
    log_run(["tensorboard"], tmp_path / "run", seed=1)
    events = tensorboard_events(tmp_path / "run" / "tensorboard" / "seed1")
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25),
                                                                   (3, 0.125)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("kl")] == [(1, 0.01), (2, 0.02)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("gate/ci_low")] == [(3, 0.05)]
    assert tensorboard_text(events, "tags/parent") == [(0, "v0")]
    assert tensorboard_text(events, "tags/seed") == [(0, "1")]
    assert tensorboard_text(events, "gate/verdict") == [(3, "promote")]


def test_mlflow_local_store_run_and_the_gate_reopening_it(tmp_path, mlflow_template):
    from mlflow.tracking import MlflowClient

    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    run_dir = tmp_path / "run"
    with open_trackers(["mlflow"], run_dir, identity(tmp_path), seed=0) as trackers:
        for step, metrics in STEPS.items():
            trackers.log(step, metrics)
    # The gate, later and in another process, adds its summary to the same run.
    with open_trackers(["mlflow"], run_dir, identity(tmp_path), seed=0) as trackers:
        trackers.summary(GATE, VERDICT, step=3)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "v1/seed0" and run.info.status == "FINISHED"
    assert {k: run.data.tags[k] for k in ("version", "parent", "skills", "spec_commit",
                                          "gate/verdict", "alerts")} == {
        "version": "v1", "parent": "v0", "skills": "close-leak", "spec_commit": "c0ffee",
        "gate/verdict": "promote", "alerts": "dead_groups"}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                 "gate/delta")] == [(3, 0.2)]


def test_wandb_offline_run_files_read_back_with_wandbs_reader(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    log_run(["wandb"], run_dir)
    records = wandb_records(run_dir)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["display_name"] == "v1/seed0" and run["run_group"] == "v1"
    assert run["project"] == "demo" and run["run_id"] == identity(tmp_path).run_key(0)
    assert {"version:v1", "parent:v0", "harness:h0", "skill:close-leak"} <= set(run["tags"])
    assert run["config"]["update"]["spec_commit"] == "c0ffee"
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [(h["step"]["num"], h["item"]["loss"]) for h in history] == [
        (1, 0.5), (2, 0.25), (3, 0.125)]
    summary: dict = {}
    for record in records:
        if record["type"] == "summary":
            summary |= record["summary"].get("update", {})
    assert summary["gate/delta"] == 0.2 and summary["gate/verdict"] == "promote"


def test_file_logger_is_verls_jsonl_which_ingest_reads_back(tmp_path):
    run_dir = tmp_path / "run"
    log_run(["file"], run_dir)
    steps, skipped = read_metrics_log(run_dir / "metrics" / "seed0.jsonl", version="v1")
    assert skipped == []
    assert sorted(zip(steps.column("step").to_pylist(), steps.column("metric").to_pylist(),
                      steps.column("value").to_pylist(), strict=True)) == sorted(
        (step, name, value) for step, metrics in STEPS.items() for name, value in metrics.items())
    summary = json.loads((run_dir / "metrics" / "seed0.summary.json").read_text())
    assert summary["parent"] == "v0" and summary["gate/ci_high"] == 0.35
    assert summary["summary_step"] == 3


def test_console_logger_prints_one_line_per_step_without_control_bytes(tmp_path):
    lines: list[str] = []
    with open_trackers(["console"], tmp_path, identity(tmp_path), seed=0,
                       emit=lines.append) as trackers:
        # A numpy scalar is a number; NaN and booleans are left out.
        trackers.log(2, {"loss": np.float32(0.25), "kl": float("nan"), "ok": True})
        trackers.summary({}, {"gate/reason": "leak \x1b]52;c;evil\x07found"})
    assert lines == ["v1/seed0 step:2 - loss:0.25",
                     "v1/seed0 summary at step:2 - gate/reason:leak found"]


# ---- the recipe field and errors ------------------------------------------------------------


def test_loggers_field_defaults_and_rejects_unknown_names():
    assert logger_names({}) == ["console", "file"]
    assert logger_names({"loggers": ["file", "wandb", "file"]}) == ["file", "wandb"]
    with pytest.raises(EvoError) as err:
        logger_names({"loggers": ["console", "swanlab"]}, where="spec/versions/v1.yaml")
    assert err.value.field == "loggers" and "tensorboard" in err.value.hint


def test_missing_library_is_one_line_naming_the_extra_before_anything_is_written(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(EvoError) as err:
        open_trackers(["file", "wandb"], tmp_path / "run", identity(tmp_path), seed=0)
    assert "pip install 'evotrainer[wandb]'" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_tracker_libraries_do_not_phone_home_unless_the_user_says_so(monkeypatch):
    """MLflow's usage telemetry and W&B's error reports are off by default; pytest alone
    would switch MLflow's off, so that escape is closed here to test our default."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    require("mlflow")
    require("wandb")
    from mlflow.telemetry import utils as telemetry
    from wandb import env as wandb_env

    monkeypatch.setattr(telemetry, "_IS_IN_CI_ENV_OR_TESTING", False)
    assert telemetry.is_telemetry_disabled() and not wandb_env.error_reporting_enabled()
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "false")  # the user's explicit choice
    require("mlflow")
    assert not telemetry.is_telemetry_disabled()


# ---- export of recorded versions ------------------------------------------------------------


class StepsBackend(StandinBackend):
    engine_module = "standin_steps_engine"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Workspace:
    """A workspace where v1 (two seeds, 3 steps) trained, was diagnosed and gated."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(
            [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
        patch.setitem(BACKEND_TYPES, "local", StepsBackend)  # what `version new` checks
        ws = Workspace(init_workspace(tmp_path_factory.mktemp("trackers") / "ws", "arith"))
        new_version(ws, "v1", "v0", rationale="more steps", settings=[
            *standin_settings(standin_skill=0.7), "seeds=[0, 1]", "grpo.steps=3"])
        approve(ws, "v1", by="tester")
        Reconciler(ws, log=lambda _: None, backends={"local": StepsBackend()}).run(
            wait=True, poll_s=0.05)
    return ws


def test_export_to_tensorboard_replays_steps_lineage_and_gate(recorded, cli):
    pytest.importorskip("tensorboard")
    from standin_steps_engine import metric_value

    state = recorded.version("v1")
    decision = state.records["decision"]
    assert decision["verdict"] == "promote"
    for _ in range(2):  # exporting again replaces the run, it does not add to it
        result = cli("-C", str(recorded.root), "export", "v1", "--to", "tensorboard")
        assert result.code == 0, result.output
    assert "v1: 2 seed(s), 8 step(s) → tensorboard" in result.out
    run_dir = recorded.root / state.records["run"]["artifact_dir"]
    spec_commit = run_identity(recorded, state, recorded.versions()).tags["spec_commit"]
    for seed in (0, 1):
        events = tensorboard_events(run_dir / "tensorboard" / f"seed{seed}")
        assert [(e.step, round(e.value, 6)) for e in events.Scalars("entropy")] == [
            (step, metric_value("entropy", seed, step)) for step in (1, 2, 3)]
        assert [e.step for e in events.Scalars("val_avg")] == [0, 3]
        assert [round(e.value, 6) for e in events.Scalars("gate/delta")] == [
            round(decision["comparison"]["delta"], 6)]
        assert tensorboard_text(events, "tags/spec_commit") == [(0, spec_commit)]
        assert tensorboard_text(events, "tags/recipe_digest") == [
            (0, state.records["run"]["recipe_digest"])]
        assert tensorboard_text(events, "gate/verdict") == [(3, "promote")]


def test_export_to_mlflow_and_wandb_write_one_run_per_seed(recorded, mlflow_template):
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    shutil.copy(mlflow_template, recorded.artifact_root / "mlflow.db")
    exported = export_version(recorded, "v1", ["mlflow", "wandb"])
    assert exported.seeds == [0, 1]
    client = MlflowClient(tracking_uri=f"sqlite:///{recorded.artifact_root / 'mlflow.db'}")
    project = recorded.project["name"]
    runs = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["v1/seed0", "v1/seed1"]
    summary = gate_summary(recorded.version("v1").records["decision"],
                           recorded.version("v1").records["diagnosis"])
    for run in runs:
        assert run.data.tags["gate/verdict"] == "promote"
        assert run.data.tags["alerts"] == summary.tags["alerts"]
        assert run.data.metrics["gate/ci_low"] == pytest.approx(summary.values["gate/ci_low"])
    records = wandb_records(exported.where)
    assert sorted(r["run"]["display_name"] for r in records if r["type"] == "run") == [
        "v1/seed0", "v1/seed1"]


@pytest.mark.usefixtures("standin")  # `version new` checks the stand-in's recipe
def test_export_to_a_directory_writes_the_policy_once_and_unfinished_versions_are_refused(
    recorded, cli, tmp_path
):
    target = tmp_path / "policy"
    result = cli("-C", str(recorded.root), "export", "v1", "--to", str(target))
    assert result.code == 0, result.output
    assert "v1: trained policy →" in result.out
    # The recorded policy's files, as the job wrote them, and a model card naming the version.
    policy = recorded.root / recorded.version("v1").records["run"]["artifacts"]["checkpoint"][
        "path"]
    for name in ("config.json", "model.safetensors"):
        assert (target / name).read_bytes() == (policy / name).read_bytes()
    assert "v1" in (target / "README.md").read_text()
    # A directory already written is never written into.
    result = cli("-C", str(recorded.root), "export", "v1", "--to", str(target))
    assert result.code == 1 and "not an empty directory" in result.err
    result = cli("-C", str(recorded.root), "export", "--to", "tensorboard")  # every trained one
    assert result.code == 0 and "v0: 1 seed(s)" in result.out and "v1: 2 seed(s)" in result.out
    new_version(recorded, "v2", "v1", rationale="never trained")
    result = cli("-C", str(recorded.root), "export", "v2", "--to", "tensorboard")
    assert result.code == 1 and "no finished run" in result.err
    result = cli("-C", str(recorded.root), "export", "v2", "--to", str(tmp_path / "v2"))
    assert result.code == 1 and "no finished run" in result.err


def test_identity_handed_to_the_job_round_trips(tmp_path, recorded):
    state = recorded.version("v1")
    written = run_identity(recorded, state, recorded.versions())
    written.write(tmp_path)
    assert RunIdentity.read(tmp_path, "v1") == written
    assert yaml.safe_load((tmp_path / "tracking.json").read_text())["tags"]["parent"] == "v0"
    bare = RunIdentity.read(tmp_path / "elsewhere", "v9")
    assert bare.version == "v9" and bare.run_key(0) != written.run_key(0)


def test_gate_summary_reaches_the_runs_the_training_logged(recorded):
    """What gate/decision.py calls after its decision: with the recipe's default loggers
    (console, file), every seed's summary gets the verdict, Δ, CI and alerts."""
    states = recorded.versions()
    state = states["v1"]
    decision = state.records["decision"]
    lines: list[str] = []
    log_gate(recorded, state, states, decision, emit=lines.append)
    run_dir = recorded.root / state.records["run"]["artifact_dir"]
    for seed in (0, 1):
        summary = json.loads((run_dir / "metrics" / f"seed{seed}.summary.json").read_text())
        assert summary["gate/verdict"] == decision["verdict"] == "promote"
        assert summary["gate/delta"] == pytest.approx(decision["comparison"]["delta"])
        assert summary["summary_step"] == 3 and summary["parent"] == "v0"
    assert [line.split(" summary")[0] for line in lines] == ["v1/seed0", "v1/seed1"]


def test_verl_gets_its_logger_list_and_logs_into_our_tagged_mlflow_run(
    tmp_path, mlflow_template
):
    import mlflow

    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    assert verl_loggers(["console", "mlflow"]) == ["console", "mlflow", "file"]
    assert verl_loggers(["file", "wandb"]) == ["file", "wandb"]
    run = identity(tmp_path).tracker_run(tmp_path / "run", seed=0)
    env = verl_tracker_env(["tensorboard", "wandb", "mlflow"], run)
    assert env["TENSORBOARD_DIR"] == str(tmp_path / "run" / "tensorboard" / "seed0")
    assert env["WANDB_MODE"] == "offline" and env["WANDB_RUN_ID"] == run.key
    # What verl/utils/tracking.py does with that environment (set_tracking_uri also sets
    # MLFLOW_TRACKING_URI in os.environ: unset both after).
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    try:
        with mlflow.start_run(run_id=env["MLFLOW_RUN_ID"]):
            mlflow.log_metrics({"actor/entropy": 0.7}, step=1)
    finally:
        mlflow.set_tracking_uri(None)
    client = mlflow.tracking.MlflowClient(env["MLFLOW_TRACKING_URI"])
    logged = client.get_run(env["MLFLOW_RUN_ID"])
    assert logged.data.tags["parent"] == "v0" and logged.info.run_name == "v1/seed0"
    assert logged.data.metrics == {"actor/entropy": 0.7}


def test_a_run_record_pointing_elsewhere_cannot_make_export_replace_files_there(
    recorded, tmp_path
):
    """The attack: a branch edits runs/v1/run.yaml so that artifact_dir names a victim folder
    holding a `tensorboard/seed0` (what an export replaces) and a steps.parquet. The export
    refuses; the victim's file survives."""
    victim = tmp_path / "victim"
    precious = victim / "tensorboard" / "seed0" / "precious.txt"
    precious.parent.mkdir(parents=True)
    precious.write_text("keep me")
    branch, path = branch_name("v1"), run_path("v1", "run.yaml")
    original = recorded.git.read(branch, path)
    real_dir = recorded.root / yaml.safe_load(original)["artifact_dir"]
    shutil.copy(real_dir / "steps.parquet", victim / "steps.parquet")
    tampered = {**yaml.safe_load(original), "artifact_dir": str(victim)}
    # Sealed as the controller's (a leaked key): the path check still holds on its own.
    controller_commit(recorded, "v1", {path: yaml.safe_dump(tampered).encode()}, "tamper")
    try:
        with pytest.raises(EvoError) as err:
            export_version(recorded, "v1", ["tensorboard"])
        assert err.value.field == "artifact_dir"
        assert precious.read_text() == "keep me"
    finally:
        controller_commit(recorded, "v1", {path: original}, "restore")
