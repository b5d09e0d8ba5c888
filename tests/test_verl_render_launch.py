"""`render V` prints what reconcile submits for V: the same job recipe (0 steps and no merge
for an evaluation-only baseline, the parent's recorded policy for `model.init: parent`), the
same job id and artifact dir, and the same command, tracker environment included.

Real: the workspace, reconcile (launch, poll, collect, diagnose, gate), the verl backend's
submit and the CLI. Stand-in: verl itself (tests/verl_standin, put first on the jobs'
PYTHONPATH), which reads the same overrides and writes verl's dumps and a merged policy.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import git
import pytest
import yaml

from evotrainer.backends.base import JobSpec
from evotrainer.backends.verl import VerlBackend
from evotrainer.backends.verl_render import JobFiles
from evotrainer.control.reconcile import Reconciler
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import approve, new_version
from evotrainer.store.files import read_json
from evotrainer.store.workspace import Workspace

STANDIN = Path(__file__).parent / "verl_standin"
TOKENIZER = Path(__file__).parent / "golden" / "verl" / "tokenizer"
STEPS = 2
RECIPE = {
    "backend": "verl",
    "loggers": ["console", "tensorboard"],  # the tracker environment is part of the command
    "domain": {"train_size": 8, "val_size": 4},
    "grpo": {"steps": STEPS, "prompts_per_step": 4, "group_size": 2, "eval_every": STEPS,
             "eval_k": 2},
    # The stand-in's own setting reaches the job as a recipe's `verl.env` does: a job
    # inherits nothing else of ours but the allow-listed environment.
    "verl": {"python": sys.executable, "env": {"STANDIN_TOKENIZER": str(TOKENIZER)}},
}
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


class CapturingVerl(VerlBackend):
    """The verl backend, keeping each JobSpec it is asked to submit and the command it ran."""

    def __init__(self) -> None:
        self.submitted: dict[str, tuple[JobSpec, str]] = {}

    def submit(self, job: JobSpec) -> None:
        super().submit(job)
        record = read_json(JobFiles(job.artifact_dir).root / "job.json")
        self.submitted[job.version] = (job, record["command"])


@pytest.fixture
def verl_workspace(tmp_path, monkeypatch) -> Workspace:
    root = init_workspace(tmp_path / "ws", "arith")
    shutil.copytree(TOKENIZER, root / "models" / "tiny")  # verl's stand-in loads no model
    project = root / "spec" / "project.yaml"
    doc = yaml.safe_load(project.read_text())
    doc["recipe"] = {**doc["recipe"], **RECIPE, "model": {"path": str(root / "models" / "tiny")},
                     "domain": {**doc["recipe"]["domain"], **RECIPE["domain"]},
                     "grpo": {**doc["recipe"]["grpo"], **RECIPE["grpo"]}}
    project.write_text(yaml.safe_dump(doc, sort_keys=False))
    repo = git.Repo(root)
    repo.git.add("-A")
    repo.git.commit("-m", "verl project", env=GIT_ENV)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(STANDIN), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.chdir(root)
    ws = Workspace(root)
    approve(ws, "v0", by="tester")  # the project's recipe changed after init approved v0
    return ws


def render_shell(cli, name: str) -> str:
    result = cli("render", name, "--format", "shell")
    assert result.code == 0, result.output
    return result.out


def converge(ws: Workspace, backend: CapturingVerl) -> None:
    Reconciler(ws, log=lambda _: None, backends={"verl": backend}).run(wait=True, poll_s=0.05)


def assert_render_is_the_launch(rendered: str, job: JobSpec, command: str) -> None:
    """The rendered job is the submitted one: its last line the exact command, `cd` into
    the job's worktree, every path under the job's artifact dir (named by its job id)."""
    *exports, cd, rendered_command = rendered.splitlines()
    assert rendered_command == command
    assert cd == f"cd {shlex.quote(str(job.workdir))}"
    for key, value in job.env.items():  # the job's own variables, as submit sets them
        assert f"export {key}={shlex.quote(value)}" in exports
    assert job.artifact_dir.name == job.job_id and f"{job.artifact_dir}/" in command


def test_render_prints_the_job_reconcile_submits(verl_workspace, cli):
    ws = verl_workspace
    new_version(ws, "v1", "v0", rationale="GRPO on verl")
    approve(ws, "v1", by="tester")
    before = {name: render_shell(cli, name) for name in ("v0", "v1")}
    # The child continues from v1's policy, which exists only once v1 is collected.
    new_version(ws, "v2", "v1", rationale="continue v1", settings=["model.init=parent"])
    refused = cli("render", "v2")
    assert refused.code == 1 and "v1 has no recorded policy yet" in refused.err
    assert "Traceback" not in refused.output

    backend = CapturingVerl()
    converge(ws, backend)
    assert set(backend.submitted) == {"v0", "v1"}  # v2 waits for its parent's policy
    before["v2"] = render_shell(cli, "v2")
    approve(ws, "v2", by="tester")  # approval changes neither its job id nor its command
    converge(ws, backend)
    assert set(backend.submitted) == {"v0", "v1", "v2"}

    for name, rendered in before.items():
        job, command = backend.submitted[name]
        assert ws.version(name).records["run"]["job_id"] == job.job_id
        assert_render_is_the_launch(rendered, job, command)
        # TensorBoard's dir reaches verl's tracker in the job's own artifact dir.
        tensorboard = job.artifact_dir / "tensorboard" / "seed0"
        assert f"env_vars.TENSORBOARD_DIR={tensorboard}" in command
        # The same job after it ran renders the same again (its recorded attempt).
        assert render_shell(cli, name) == rendered

    v0, v0_command = backend.submitted["v0"]
    assert "trainer.total_training_steps=0" in v0_command.split()  # evaluation only
    assert "verl.model_merger" not in v0_command
    _, v1_command = backend.submitted["v1"]
    assert f"trainer.total_training_steps={STEPS}" in v1_command.split()
    assert "verl.model_merger" in v1_command
    v1_policy = ws.root / ws.version("v1").records["run"]["artifacts"]["checkpoint"]["path"]
    _, v2_command = backend.submitted["v2"]
    assert f"actor_rollout_ref.model.path={v1_policy}" in v2_command.split()

    # --format overrides is the first seed's run of the same command.
    overrides = cli("render", "v2").out.splitlines()
    assert shlex.join([sys.executable, "-m", "verl.trainer.main_ppo", *overrides]) in v2_command


def test_render_on_a_local_backend_version_says_render_is_for_verl(workspace, cli):
    result = cli("-C", str(workspace.root), "render", "v0")
    assert result.code == 1
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.err
    assert "local backend" in lines[0] and "verl" in lines[0]
    assert "--set backend=verl" in lines[0]
    assert "model.path" not in lines[0].split("Hint")[0]  # not a complaint about model.path


def test_render_opens_no_tracker_run_and_shows_where_the_launch_puts_its_id(tmp_path,
                                                                           monkeypatch):
    """Submit creates the MLflow run (a side effect) and hands its id to verl: render shows
    a placeholder there and creates nothing; every other tracker variable is the launch's."""
    from evotrainer.backends.verl import MLFLOW_RUN_AT_LAUNCH, job_runs
    from evotrainer.store.recipe import BASE_RECIPE, deep_merge
    from evotrainer.trackers import RunIdentity

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = deep_merge(BASE_RECIPE, {"backend": "verl", "model": {"path": "/m"},
                                      "loggers": ["console", "mlflow", "wandb"]})
    folder = tmp_path / "art" / "evo-v1-a1-x"
    job = JobSpec("evo-v1-a1-x", "v1", recipe, tmp_path / "wt", folder)
    identity = RunIdentity("p", "v1", "evo-v1-a1-x", str(tmp_path / "store"))
    values = {o.key.rsplit(".", 1)[-1]: o.value for o in job_runs(job, identity)[0].overrides}
    assert values["MLFLOW_RUN_ID"] == MLFLOW_RUN_AT_LAUNCH
    assert values["MLFLOW_TRACKING_URI"].startswith(f"sqlite:///{tmp_path / 'store'}")
    assert values["WANDB_RUN_ID"] == identity.run_key(0) and values["WANDB_DIR"] == str(folder)
    assert not (tmp_path / "store").exists() and not folder.exists()
