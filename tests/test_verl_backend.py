"""The verl backend end to end on CPU.

Real: the backend (render, data and reward files, detached local process group, Ray Jobs
through a real Ray head this module starts on loopback with 1 CPU, status mapping, watchdog,
cancel, logs), the reward module (it scores with the real `arith` domain) and the dump ingest.
Stand-in: `tests/verl_standin/verl/trainer/main_ppo.py` replaces verl itself (which cannot
train without a GPU): it takes the same overrides and writes verl 0.9.1's dump and metrics
formats, and can fail or hang on request.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import sys
import time
from pathlib import Path

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from evotrainer.backends.base import JobSpec, job_id
from evotrainer.backends.verl import VerlBackend
from evotrainer.backends.verl_render import JobFiles
from evotrainer.errors import EvoError
from evotrainer.store.recipe import BASE_RECIPE, deep_merge, digest
from evotrainer.store.records import JobState

STANDIN = Path(__file__).parent / "verl_standin"  # a Ray job ships it in its worktree


# The stand-in shadows the real verl through PYTHONPATH (conftest.py's `standin_verl`).
pytestmark = pytest.mark.usefixtures("standin_verl")


TOKENIZER = Path(__file__).parent / "golden" / "verl" / "tokenizer"  # a local word-level one
SEEDS = [0, 1]
VAL_SIZE, EVAL_K, STEPS = 4, 2, 3


def make_job(
    tmp_path: Path, name: str, mode: str = "ok", merge: str = "ok", **verl: object
) -> JobSpec:
    workdir = tmp_path / name / "worktree"
    workdir.mkdir(parents=True)
    if verl.get("ray_address"):  # a Ray job's code is its working_dir (the worktree)
        shutil.copytree(STANDIN / "verl", workdir / "verl")
    recipe = deep_merge(
        BASE_RECIPE,
        {
            "backend": "verl",
            "model": {"path": "/models/not-loaded-by-the-stand-in"},
            "domain": {"train_size": 16, "val_size": VAL_SIZE},
            "grpo": {
                "group_size": 2,
                "prompts_per_step": 4,
                "steps": STEPS,
                "eval_every": 2,
                "eval_k": EVAL_K,
            },
            "seeds": SEEDS,
            "verl": {"python": sys.executable, **verl},
        },
    )
    env = {
        "STANDIN_MODE": mode,
        "STANDIN_STEP_SLEEP": "0.3" if mode != "ok" else "0",
        "STANDIN_MERGE": merge,
        "STANDIN_TOKENIZER": str(TOKENIZER),
    }
    return JobSpec(
        job_id=job_id(name, 1, digest(recipe)),
        version=name,
        recipe=recipe,
        workdir=workdir,
        artifact_dir=tmp_path / name / "artifacts",
        env=env,
    )


def wait_for(backend: VerlBackend, job: JobSpec, states: set[JobState], limit: float = 60):
    deadline = time.monotonic() + limit
    while True:
        status = backend.status(job)
        if status.state in states or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def check_collected(backend: VerlBackend, job: JobSpec) -> None:
    collected = backend.collect(job)
    scores = pacsv.read_csv(collected.scores)
    assert scores.column_names == ["seed", "task_id", "data_source", "sample_idx", "correct"]
    assert scores.num_rows == len(SEEDS) * VAL_SIZE * EVAL_K
    assert set(scores.column("seed").to_pylist()) == set(SEEDS)
    assert all(t.startswith("arith:") for t in scores.column("task_id").to_pylist())
    assert set(scores.column("sample_idx").to_pylist()) == set(range(EVAL_K))
    assert 0 < sum(scores.column("correct").to_pylist()) < scores.num_rows
    val = pq.read_table(collected.val_rollouts)
    assert set(val.column("step").to_pylist()) == {0, 2, 3}  # before training, every 2, last
    train = pq.read_table(collected.train_rollouts)
    assert train.num_rows == len(SEEDS) * STEPS * 4 * 2
    steps = pq.read_table(collected.steps)
    assert "critic/score/mean" in steps.column("metric").to_pylist()
    assert collected.result["tasks"] == VAL_SIZE and collected.result["skipped_lines"] == 0
    # The step budget's unit: every seed's steps, from verl's own metrics files.
    assert collected.result["steps"] == STEPS
    assert collected.result["steps_done"] == len(SEEDS) * STEPS
    # V1 train dumps carry no reward extras: task and source are joined back to the data.
    assert all(t.startswith("arith:") for t in train.column("task_id").to_pylist())
    assert "unknown" not in set(train.column("data_source").to_pylist())
    assert collected.result["dump_flavours"] == ["v1"]
    # model.path is no local dir here: no tokenizer, so lengths stay null (never 0).
    assert train.column("response_tokens").null_count == train.num_rows
    assert any("model.path" in m for m in collected.result["missing"])


def test_local_job_end_to_end(tmp_path):
    backend, job = VerlBackend(), make_job(tmp_path, "v1")
    assert backend.status(job).state is JobState.UNKNOWN
    backend.submit(job)
    record = json.loads((JobFiles(job.artifact_dir).root / "job.json").read_text())
    backend.submit(job)  # adopts the job instead of launching it twice
    assert json.loads((JobFiles(job.artifact_dir).root / "job.json").read_text()) == record
    status = wait_for(backend, job, {JobState.SUCCEEDED, JobState.FAILED})
    assert status.state is JobState.SUCCEEDED, backend.logs(job)
    assert status.exit_code == 0 and status.progress == 1.0
    assert "Final validation metrics" in backend.logs(job, tail=20)
    check_collected(backend, job)
    # Each seed's policy was merged by the job itself into a plain HF directory.
    command = record["command"]
    assert command.count("-m verl.model_merger merge --backend fsdp") == len(SEEDS)
    shards = JobFiles(job.artifact_dir).checkpoint_dir(0) / f"global_step_{STEPS}" / "actor"
    assert f"--local_dir {shards} --target_dir {job.artifact_dir / 'checkpoint'}" in command
    collected = backend.collect(job)
    assert collected.checkpoint == job.artifact_dir / "checkpoint"  # the one reconcile records
    assert collected.result["checkpoints"] == {
        "0": str(job.artifact_dir / "checkpoint"),
        "1": str(job.artifact_dir / "checkpoint-seed1"),
    }
    for folder in collected.result["checkpoints"].values():
        assert {"config.json", "model.safetensors", "chat_template.jinja"} <= {
            f.name for f in Path(folder).iterdir()
        }

    # With the checkpoint's local dir, lengths come from its tokenizer.
    local_model = deep_merge(job.recipe, {"model": {"path": str(TOKENIZER)}})
    collected = backend.collect(dataclasses.replace(job, recipe=local_model))
    val = pq.read_table(collected.val_rollouts)
    assert val.column("response_tokens").null_count == 0
    assert val.column("truncated").null_count == 0
    assert any("re-tokenized" in d for d in collected.result["derived"])

    # A cut-off line (a dump being written when the job died) is skipped and reported.
    last = JobFiles(job.artifact_dir).validation_dir(0) / "3.jsonl"
    with last.open("a") as out:
        out.write('{"input": "12+3=", "outp')
    collected = backend.collect(job)
    assert collected.result["skipped_lines"] == 1
    assert "3.jsonl:" in collected.result["skipped"][0]


def test_a_branch_cannot_replace_verl_or_read_our_secrets(tmp_path, monkeypatch):
    """On verl too, the worktree (branch content, the job's working directory)
    carries its own `verl/trainer/main_ppo.py`; the job runs the installed verl (here the
    stand-in) and no secret of the controller reaches it."""
    monkeypatch.setenv("GITHUB_TOKEN", "secret-token")
    backend, job = VerlBackend(), make_job(tmp_path, "v9")
    marker = tmp_path / "branch-code-ran"
    for package in ("verl", "verl/trainer"):
        (job.workdir / package).mkdir(parents=True, exist_ok=True)
        (job.workdir / package / "__init__.py").write_text("")
    (job.workdir / "verl/trainer/main_ppo.py").write_text(
        "import os\n"
        f"open({str(marker)!r}, 'w').write(os.environ.get('GITHUB_TOKEN', 'none'))\n")
    backend.submit(job)
    status = wait_for(backend, job, {JobState.SUCCEEDED, JobState.FAILED})
    assert status.state is JobState.SUCCEEDED, backend.logs(job)
    assert not marker.exists()


def test_local_job_that_fails(tmp_path):
    backend, job = VerlBackend(), make_job(tmp_path, "v2", mode="fail")
    backend.submit(job)
    status = wait_for(backend, job, {JobState.SUCCEEDED, JobState.FAILED})
    assert status.state is JobState.FAILED and status.exit_code == 1
    assert "Error executing job with overrides" in backend.logs(job)


def test_a_failed_merge_fails_the_job_and_collect_wants_the_policy(tmp_path):
    backend, job = VerlBackend(), make_job(tmp_path, "v5", merge="fail")
    backend.submit(job)
    status = wait_for(backend, job, {JobState.SUCCEEDED, JobState.FAILED})
    assert status.state is JobState.FAILED and status.exit_code == 1
    assert "no model shards" in backend.logs(job)
    with pytest.raises(EvoError) as err:  # the dumps are there, the product is not
        backend.collect(job)
    assert "left no merged policy" in err.value.message
    assert err.value.where == str(job.artifact_dir / "checkpoint")


def test_a_job_whose_launcher_died_before_job_json_is_adopted(tmp_path):
    backend, job = VerlBackend(), make_job(tmp_path, "v6", mode="stall")
    backend.submit(job)
    files = JobFiles(job.artifact_dir)
    record = json.loads((files.root / "job.json").read_text())
    (files.root / "job.json").unlink()  # the reconcile that launched it died right there
    try:
        status = backend.status(job)
        assert status.state is JobState.RUNNING, status
        adopted = json.loads((files.root / "job.json").read_text())
        assert adopted["pid"] == record["pid"] and adopted["adopted"] is True
        backend.submit(job)  # never a second launch
        assert json.loads((files.root / "job.json").read_text())["pid"] == record["pid"]
    finally:
        backend.cancel(job)


def test_local_job_that_stalls_then_is_cancelled(tmp_path):
    backend, job = VerlBackend(), make_job(tmp_path, "v3", mode="stall", stall_after_s=1)
    backend.submit(job)
    status = wait_for(backend, job, {JobState.STALLED, JobState.FAILED, JobState.SUCCEEDED})
    # A loaded machine can leave a second between the start and the first step: silent too,
    # so the job reads as stalled then; it stalls for good after its first step.
    deadline = time.monotonic() + 60
    while status.state in (JobState.STALLED, JobState.RUNNING) and not (
            status.state is JobState.STALLED and status.progress) and (
            time.monotonic() < deadline):
        time.sleep(0.2)
        status = backend.status(job)
    assert status.state is JobState.STALLED, status
    assert "Ray cannot place" in status.detail
    assert 0 < status.progress < 1
    backend.cancel(job)
    status = backend.status(job)
    assert status.state is JobState.FAILED and status.detail == "cancelled"


def test_collect_rejects_missing_and_malformed_dumps(tmp_path):
    backend, job = VerlBackend(), make_job(tmp_path, "v4")
    files = JobFiles(job.artifact_dir)
    for index, seed in enumerate(SEEDS):  # the policies are there; the dumps are the question
        files.policy_dir(index, seed).mkdir(parents=True)
        (files.policy_dir(index, seed) / "config.json").write_text("{}")
    with pytest.raises(EvoError) as err:
        backend.collect(job)
    assert "no validation dump" in err.value.message
    for seed in SEEDS:
        files.validation_dir(seed).mkdir(parents=True)
        (files.validation_dir(seed) / "2.jsonl").write_text(
            json.dumps({"input": "1+1=", "output": "2", "score": 1.0, "step": 2, "uid": "abc_0_0"})
            + "\n"
        )
    with pytest.raises(EvoError) as err:  # a custom reward that forgot `acc`
        backend.collect(job)
    assert "without `acc`" in err.value.message and err.value.where.endswith("2.jsonl")
    (files.validation_dir(0) / "2.jsonl").write_text('{"prompt": "not a verl dump"}\n')
    with pytest.raises(EvoError):
        backend.collect(job)


# ---- Ray Jobs --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    pytest.importorskip("ray.job_submission", reason='Ray Jobs need `pip install "ray[default]"`')
    import ray

    port = _free_port()
    ray.init(
        num_cpus=1,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        log_to_driver=False,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        ray.shutdown()


def test_ray_job_end_to_end_and_cancel(tmp_path, ray_head):
    backend = VerlBackend()
    job = make_job(tmp_path, "r1", ray_address=ray_head)
    backend.submit(job)
    status = wait_for(backend, job, {JobState.SUCCEEDED, JobState.FAILED}, limit=120)
    assert status.state is JobState.SUCCEEDED, (status, backend.logs(job))
    assert "Final validation metrics" in backend.logs(job)
    check_collected(backend, job)

    stuck = make_job(tmp_path, "r2", mode="stall", ray_address=ray_head, stall_after_s=1)
    backend.submit(stuck)
    status = wait_for(backend, stuck, {JobState.STALLED, JobState.FAILED}, limit=120)
    assert status.state is JobState.STALLED, (status, backend.logs(stuck))
    backend.cancel(stuck)
    status = wait_for(backend, stuck, {JobState.FAILED}, limit=60)
    assert status.state is JobState.FAILED and status.detail.startswith("stopped")


@pytest.mark.parametrize(("override", "field"), [
    ({"grpo": {"clip_low": 0.2, "clip_high": 0.1}}, "grpo.clip_high"),
    ({"reward": {"components": [{"name": "bogus", "weight": 1.0}]}}, "reward.components[1].name"),
])
def test_the_verl_backend_checks_the_recipe_contract_before_anything_is_recorded(
    tmp_path, override, field
):
    """The contract every backend shares (contract/recipe.check_contract) runs in verl's check,
    so `validate` and `version new` refuse what the embedded engine would refuse."""
    job = make_job(tmp_path, "contract")
    with pytest.raises(EvoError) as err:
        VerlBackend().check(deep_merge(job.recipe, override))
    assert err.value.field == field


def test_version_new_refuses_an_invalid_verl_recipe(tmp_path):
    from evotrainer.control.scaffold import init_workspace
    from evotrainer.control.versions import new_version
    from evotrainer.store.workspace import Workspace

    ws = Workspace(init_workspace(tmp_path / "ws", "arith"))
    (ws.root / "models" / "m").mkdir(parents=True)
    (ws.root / "models" / "m" / "config.json").write_text("{}")
    with pytest.raises(EvoError) as err:
        new_version(ws, "v1", "v0", rationale="x", settings=[
            "backend=verl", "model.path=models/m", "grpo.clip_low=0.2", "grpo.clip_high=0.1"])
    assert err.value.field == "recipe.grpo.clip_high"
    assert ws.git.rev("refs/heads/evo/v1") is None  # nothing recorded
