"""The `verl` backend: GRPO on GPU nodes with verl 0.9.1, locally or on a Ray cluster.

A job runs `python3 -m verl.trainer.main_ppo` once per recipe seed, one after another (see
`verl_render` for the overrides). Everything it reads and writes lives under the artifact dir
(`JobFiles`): the domain's train/val parquet, the reward module and its config, the group-filter
sampler, and per seed the rollout and validation dumps, the file-logger metrics and the
checkpoints. On a cluster that dir must be on storage the head node shares.

- `verl.ray_address` unset: a detached local process group (`job.json` records it, the shell
  wrapper writes `exit_code` when the seeds are done, `job.log` has the output).
- `verl.ray_address: http://HEAD:8265`: a Ray job whose submission id is the job id, with the
  version's worktree as working_dir, the evotrainer package as a py_module (the reward module
  imports it) and the job's environment variables.

A watchdog reports Stalled when a running job has written no metrics line and no dump file for
`verl.stall_after_s` seconds: verl waits forever, silently, when Ray cannot place its actors.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

import evotrainer
from evotrainer.backends.base import (
    Collected,
    JobSpec,
    JobStatus,
    LiveEvidence,
    job_environment,
)
from evotrainer.backends.local import adopt_orphan, live_process, spawn_detached
from evotrainer.backends.verl_episode import tool_config, tools_kwargs
from evotrainer.backends.verl_live import RowChunks
from evotrainer.backends.verl_render import (
    DUAL_SAMPLER_CLASS,
    SAMPLER_CLASS,
    SAMPLER_NAME,
    JobFiles,
    Override,
    RenderedRun,
    entrypoint,
    job_env,
    recipe_environment,
    render_job,
    verl_settings,
)
from evotrainer.contract.recipe import check_contract
from evotrainer.domains import Task, make_domain
from evotrainer.engine.outputs import JobProgress
from evotrainer.errors import EvoError
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.evidence.schema import ROLLOUT_SCHEMA, SCORE_SCHEMA
from evotrainer.evidence.steps import STEPS_SCHEMA
from evotrainer.evidence.verl import (
    IngestResult,
    derive_lengths,
    ingest_dump,
    read_metrics_log,
    read_new,
)
from evotrainer.store.checkpoints import check_job_start
from evotrainer.store.clock import now_iso
from evotrainer.store.files import atomic_write, read_json
from evotrainer.store.records import JobState
from evotrainer.trackers import RunIdentity, logger_names
from evotrainer.trackers.mlflow_tracker import tracking_uri
from evotrainer.trackers.verl import verl_tracker_env

JOB_FILE = "job.json"
EXIT_FILE = "exit_code"
CANCEL_FILE = "cancelled"
KILL_GRACE_S = 10.0
# Copied beside the job's data. The sampler imports verl, so it is only ever read as a file.
REWARD_TEMPLATE = Path(__file__).with_name("verl_reward.py")
SAMPLER_TEMPLATES = {
    SAMPLER_CLASS: Path(__file__).with_name("verl_sampler.py"),
    DUAL_SAMPLER_CLASS: Path(__file__).with_name("verl_dual_sampler.py"),
}

# Ray's job states → ours. STOPPED is a cancel (ours or an operator's): the run did not finish.
RAY_STATES = {
    "PENDING": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "STOPPED": JobState.FAILED,
    "SUCCEEDED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
}


class VerlBackend:
    name = "verl"
    # Each seed's FSDP shards (JobFiles.checkpoint_dir), beside the merged policies.
    weight_folders = ("verl/seed*/checkpoints",)

    def check(self, recipe: dict) -> None:
        """The backend-independent recipe contract first, then render every seed's overrides
        (pure: nothing written), so a bad recipe fails here and not after run.yaml exists."""
        check_contract(recipe)
        check_judges_reachable(recipe)
        render_job(recipe, version="check", files=JobFiles(Path("/nonexistent")), workdir=Path("."))

    # ---- submit ------------------------------------------------------------------------

    def submit(self, job: JobSpec) -> None:
        if self.status(job).state is not JobState.UNKNOWN:
            return  # already launched (or finished): adopt it, never launch twice
        prepare(job)
        command = job_command(job, job_runs(job))
        address = verl_settings(job.recipe)["ray_address"]
        if address is None:
            self._submit_local(job, command)
        else:
            self._submit_ray(job, address, command)

    def _submit_local(self, job: JobSpec, command: str) -> None:
        files = JobFiles(job.artifact_dir)
        exit_file = files.root / EXIT_FILE
        # The wrapper records the exit status, so a later reconcile (another process, which
        # cannot wait() on this one) still learns how the job ended.
        script = f'{command}\nstatus=$?\necho "$status" > {shlex.quote(str(exit_file))}\n'
        script_file = files.root / "run.sh"
        script_file.write_text(script)
        env = job_environment(local_env(job))  # no secret of the controller reaches it
        record = {
            **spawn_detached(["sh", str(script_file)], job, env, files.log_file),
            "mode": "local",
            "command": command,
        }
        atomic_write(files.root / JOB_FILE, json.dumps(record, indent=2))

    def _submit_ray(self, job: JobSpec, address: str, command: str) -> None:
        client = _ray_client(address)
        client.submit_job(
            entrypoint=command,
            submission_id=job.job_id,
            runtime_env=ray_runtime_env(job),
            metadata={"evotrainer_version": job.version},
        )
        record = {
            "job_id": job.job_id,
            "mode": "ray",
            "address": address,
            "started_at": now_iso(),
            "command": command,
        }
        atomic_write(JobFiles(job.artifact_dir).root / JOB_FILE, json.dumps(record, indent=2))

    # ---- status / cancel / logs --------------------------------------------------------

    def status(self, job: JobSpec) -> JobStatus:
        files = JobFiles(job.artifact_dir)
        settings = verl_settings(job.recipe)
        if settings["ray_address"] is not None:
            status = self._ray_status(job, settings["ray_address"])
        else:
            status = self._local_status(job, files)
        if status.state in (JobState.UNKNOWN, JobState.PENDING):
            return status
        status.progress = _progress(job.recipe, files)
        if status.state is JobState.RUNNING:
            idle = time.time() - _last_activity(job.recipe, files)
            if idle > settings["stall_after_s"]:
                status.state = JobState.STALLED
                status.detail = (
                    f"no metrics line or dump file for {idle:.0f} s (verl.stall_after_s = "
                    f"{settings['stall_after_s']}); verl waits silently when Ray cannot place "
                    "its actors: check the GPUs and CPUs the job asks for, then cancel it"
                )
        return status

    def _local_status(self, job: JobSpec, files: JobFiles) -> JobStatus:
        record = read_json(files.root / JOB_FILE) or adopt_local_orphan(job, files)
        if record is None or record.get("job_id") != job.job_id:
            return JobStatus(JobState.UNKNOWN, "no such job")
        exit_text = _read_text(files.root / EXIT_FILE)
        if exit_text is not None and exit_text.strip().lstrip("-").isdigit():
            code = int(exit_text)
            if code == 0:
                return JobStatus(JobState.SUCCEEDED, "finished", exit_code=0)
            return JobStatus(
                JobState.FAILED,
                f"verl exited with status {code}; see {files.log_file}",
                exit_code=code,
            )
        if live_process(record) is not None:
            return JobStatus(JobState.RUNNING, f"pid {record['pid']}")
        if (files.root / CANCEL_FILE).is_file():
            return JobStatus(JobState.FAILED, "cancelled")
        return JobStatus(
            JobState.FAILED,
            f"process {record['pid']} disappeared without an "
            "exit status (killed, or the machine restarted)",
        )

    def _ray_status(self, job: JobSpec, address: str) -> JobStatus:
        client = _ray_client(address)
        try:
            info = client.get_job_info(job.job_id)
        except RuntimeError as err:  # the job server answers 404 for an unknown id
            if "does not exist" in str(err) or "404" in str(err):
                return JobStatus(JobState.UNKNOWN, "no such Ray job")
            raise
        state = RAY_STATES.get(str(info.status.value), JobState.UNKNOWN)
        detail = info.message or str(info.status.value)
        if str(info.status.value) == "STOPPED":
            detail = f"stopped: {detail}"
        return JobStatus(state, detail, exit_code=info.driver_exit_code)

    def cancel(self, job: JobSpec) -> None:
        settings = verl_settings(job.recipe)
        if settings["ray_address"] is not None:
            _ray_client(settings["ray_address"]).stop_job(job.job_id)
            return
        files = JobFiles(job.artifact_dir)
        record = read_json(files.root / JOB_FILE)
        process = live_process(record) if record else None
        if process is None:
            return
        (files.root / CANCEL_FILE).write_text(now_iso())
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(KILL_GRACE_S)
        except psutil.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # Ray's own shutdown hung

    def logs(self, job: JobSpec, tail: int = 50) -> str:
        settings = verl_settings(job.recipe)
        if settings["ray_address"] is not None:
            text = _ray_client(settings["ray_address"]).get_job_logs(job.job_id)
        else:
            text = _read_text(JobFiles(job.artifact_dir).log_file) or ""
        return "\n".join(text.splitlines()[-tail:])

    # ---- collect -----------------------------------------------------------------------

    def collect(self, job: JobSpec) -> Collected:
        files = JobFiles(job.artifact_dir)
        seeds = job.recipe.get("seeds") or [0]
        policies = trained_policies(job, files)  # the product first: no policy, no collect
        shape = rendered_shape(job)
        train, val, steps, skipped = [], [], [], []
        notes = IngestResult(rollouts=ROLLOUT_SCHEMA.empty_table())
        for seed in seeds:
            rollout_dir = files.rollout_dir(seed)
            if rollout_dir.is_dir() and any(rollout_dir.glob("*.jsonl")):
                result = ingest_dump(
                    rollout_dir,
                    version=job.version,
                    split="train",
                    seed=seed,
                    group_size=shape["train_n"],
                )
                table = join_tasks(result.rollouts, files.train_file)
                train.append(complete_lengths(table, shape, result))
                merge_notes(notes, result)
            val_dir = files.validation_dir(seed)
            if not val_dir.is_dir() or not any(val_dir.glob("*.jsonl")):
                raise EvoError(
                    f"seed {seed} left no validation dump, so there is nothing to score",
                    where=str(val_dir),
                    hint=f"see the job log ({files.log_file}): did verl reach its last step?",
                )
            result = ingest_dump(
                val_dir, version=job.version, split="val", seed=seed, group_size=shape["val_n"]
            )
            val.append(complete_lengths(result.rollouts, shape, result))
            merge_notes(notes, result)
            if files.metrics_file(seed).is_file():
                table, bad = read_metrics_log(
                    files.metrics_file(seed), version=job.version, seed=seed
                )
                steps.append(table)
                skipped += bad
        skipped = notes.skipped + skipped

        # The canonical evidence goes where the embedded engine writes it (evidence/layout).
        canonical = RunArtifacts(job.artifact_dir)
        canonical.rollouts_dir.mkdir(parents=True, exist_ok=True)
        train_path = _write(train, ROLLOUT_SCHEMA, canonical.rollouts("train"))
        val_path = _write(val, ROLLOUT_SCHEMA, canonical.rollouts("val"))
        steps_path = _write(steps, STEPS_SCHEMA, canonical.steps)
        scores = final_scores(pa.concat_tables(val), files)
        scores_path = canonical.scores
        pacsv.write_csv(scores.drop_columns(["version"]), scores_path)
        correct = scores.column("correct")
        result: dict[str, Any] = {
            "backend": "verl",
            "seeds": list(seeds),
            # The step budget's unit, over every seed, as the embedded engine counts it.
            "steps": job.recipe["grpo"]["steps"],
            "steps_done": sum(_last_step(files.metrics_file(seed)) for seed in seeds),
            "tasks": len(set(scores.column("task_id").to_pylist())),
            "avg_correct": pc.mean(correct).as_py(),
            "skipped_lines": len(skipped),
            "dump_flavours": notes.flavours,
            "derived": notes.derived,
            "missing": notes.missing,
            "ambiguous": notes.ambiguous,
            "checkpoints": {str(seed): str(path) for seed, path in policies.items()},
        }
        if skipped:
            result["skipped"] = [f"{s.file}:{s.line} ({s.reason})" for s in skipped[:10]]
        return Collected(train_path, val_path, steps_path, scores_path, result,
                         checkpoint=policies.get(seeds[0]))


    # ---- what the controller asks of a job besides its state --------------------------

    def resources(self, recipe: dict) -> dict[str, int]:
        """`trainer.nnodes` × `trainer.n_gpus_per_node` as the rendered config sets them (a
        Hydra override in `verl.overrides` wins over the `verl:` section, as it does in the
        rendered command)."""
        settings = verl_settings(recipe)
        overrides = settings["overrides"] or {}
        nodes = int(overrides.get("trainer.nnodes", settings["nnodes"]))
        per_node = int(overrides.get("trainer.n_gpus_per_node", settings["n_gpus_per_node"]))
        return {"nodes": nodes, "gpus_per_node": per_node, "gpus": nodes * per_node}

    def progress(self, job: JobSpec) -> JobProgress | None:
        return None  # verl keeps no per-step record beyond its metrics log (the evidence)

    def live_evidence(self, job: JobSpec, cache: Path, read: dict, force: bool) -> LiveEvidence:
        """The dumps' new lines since the last look (`evidence.verl.read_new`: new files
        whole, grown files from their byte offset, complete lines only), appended to the rows
        read before (`RowChunks`); every seed's metrics log."""
        files = JobFiles(job.artifact_dir)
        shape = rendered_shape(job)
        offsets: dict = dict(read.get("offsets") or {})
        rows = RowChunks(cache / "rows")
        changed = False
        steps = []
        for seed in job.recipe.get("seeds") or [0]:
            for split, directory, n in (
                ("train", files.rollout_dir(seed), shape["train_n"]),
                ("val", files.validation_dir(seed), shape["val_n"]),
            ):
                key = f"{seed}-{split}"
                result, offsets[key] = read_new(
                    directory, offsets.get(key), version=job.version, split=split, seed=seed,
                    group_size=n,
                )
                if result.restarted:
                    rows.drop(key)
                    changed = True
                if result.rollouts.num_rows:
                    table = result.rollouts
                    if split == "train" and files.train_file.is_file():
                        table = join_tasks(table, files.train_file)
                    rows.append(key, table.cast(ROLLOUT_SCHEMA))
                    changed = True
            if files.metrics_file(seed).is_file():
                steps.append(read_metrics_log(files.metrics_file(seed), version=job.version,
                                              seed=seed)[0])
        return LiveEvidence(
            rows.read_all(),
            pa.concat_tables(steps) if steps else None,
            changed,
            {"offsets": offsets},
            "live:" + json.dumps(offsets, sort_keys=True),
            (read_json(files.root / JOB_FILE) or {}).get("started_at"),
        )


def adopt_local_orphan(job: JobSpec, files: JobFiles) -> dict | None:
    """A job spawned by a reconcile that died before writing job.json: `adopt_orphan` finds
    it by its environment and writes the local backend's record (artifact_dir/job.json);
    a verl job keeps its record under verl/, so it moves there."""
    record = adopt_orphan(job)
    if record is not None:
        atomic_write(files.root / JOB_FILE, json.dumps(record, indent=2))
        (job.artifact_dir / JOB_FILE).unlink(missing_ok=True)
    return record


def trained_policies(job: JobSpec, files: JobFiles) -> dict[int, Path]:
    """Each trained seed's merged policy directory (the first seed's is `checkpoint`, the
    one reconcile records); a finished job without it lost the product, so say so."""
    runs = render_job(job.recipe, version=job.version, files=files, workdir=job.workdir)
    policies = {}
    for run in runs:
        if run.merge is None:
            continue
        if not (run.merge.target / "config.json").is_file():
            raise EvoError(
                f"seed {run.seed} left no merged policy",
                where=str(run.merge.target),
                hint=f"see the job log ({files.log_file}): did verl save global_step_"
                f"{job.recipe['grpo']['steps']} and did `python -m verl.model_merger` succeed?",
            )
        policies[run.seed] = run.merge.target
    return policies


# ---- job files -------------------------------------------------------------------------


# What `render` shows for the MLflow run id: only the launch creates the run (a side effect).
MLFLOW_RUN_AT_LAUNCH = "<the MLflow run created at launch>"


def job_runs(job: JobSpec, identity: RunIdentity | None = None) -> list[RenderedRun]:
    """Every seed's run as the job launches it: rendered from the job's recipe (the one
    reconcile submits, not the version's resolved recipe), each with its tracker environment
    (TensorBoard dir, W&B run, MLflow run) handed to verl's trackers the way the file
    logger's path is: through the runtime_env main_ppo gives ray.init, so it reaches the
    TaskRunner actor locally and on a cluster.

    Without `identity` (submit) the identity is the one the launcher left in the artifact
    dir and the MLflow run is created now. With it (`render`: nothing launched) nothing is
    written or opened, and the MLflow run id, which only a launch creates, is a placeholder:
    otherwise the two give the same runs, so render prints what submit runs."""
    files = JobFiles(job.artifact_dir)
    runs = render_job(job.recipe, version=job.version, files=files, workdir=job.workdir)
    loggers = logger_names(job.recipe)
    launching = identity is None
    identity = identity or RunIdentity.read(job.artifact_dir, job.version)
    prefix = "+ray_kwargs.ray_init.runtime_env.env_vars."
    tracked = []
    for run in runs:
        tracker_run = identity.tracker_run(job.artifact_dir, run.seed)
        if launching:
            env = verl_tracker_env(loggers, tracker_run)
        else:
            env = verl_tracker_env([n for n in loggers if n != "mlflow"], tracker_run)
            if "mlflow" in loggers:
                env |= {
                    "MLFLOW_TRACKING_URI": tracking_uri(tracker_run),
                    "MLFLOW_RUN_ID": MLFLOW_RUN_AT_LAUNCH,
                }
        tracked.append(run.with_overrides([Override(prefix + k, v) for k, v in env.items()]))
    return tracked


def job_command(job: JobSpec, runs: list[RenderedRun]) -> str:
    """The job's shell command: each seed's run and policy merge (`entrypoint`)."""
    return entrypoint(runs, verl_settings(job.recipe)["python"])


def local_env(job: JobSpec) -> dict[str, str]:
    """What a local job's processes get on top of the launcher's environment: the recipe's
    `verl.env`, the job's own variables, and evotrainer on PYTHONPATH (the reward module
    imports it)."""
    path = os.pathsep.join(p for p in (_package_parent(), os.environ.get("PYTHONPATH", "")) if p)
    # PYTHONSAFEPATH: the working directory (the version's worktree, branch content) is not
    # put first on sys.path, so a branch's `verl/` or `evotrainer/` never shadows the
    # installed ones (`python -m` would otherwise import them from there).
    return {**job_env(job.recipe), **job.env, "PYTHONPATH": path, "PYTHONSAFEPATH": "1"}


def ray_runtime_env(job: JobSpec) -> dict[str, Any]:
    """A Ray job's runtime_env: the worktree as working_dir, the evotrainer package as a
    py_module (the reward module imports it) and the job's environment variables."""
    return {
        "working_dir": str(job.workdir),
        "py_modules": [str(Path(evotrainer.__file__).parent)],
        "env_vars": {**job_env(job.recipe), **job.env},
        "excludes": [".git"],
    }


def check_judges_reachable(recipe: dict) -> None:
    """verl's reward workers reach a judge at an endpoint: `serve:` starts a server only for
    the embedded engine's run."""
    for index, judge in enumerate(recipe["reward"].get("judges") or []):
        if judge.get("serve") is not None:
            raise EvoError("verl's reward workers reach a judge at an endpoint; serve: starts "
                           "one only for the embedded engine",
                           field=f"reward.judges[{index}].serve",
                           hint="run `evotrainer judge serve --package smollm2 --host 0.0.0.0` "
                           "(or vLLM) where the workers reach it, and set endpoint: to its URL")


def prepare(job: JobSpec) -> None:
    """Render the job and write its inputs: data, reward module and config, sampler, and
    for a multi-turn domain without a tool config of the recipe's own, the domain's."""
    files = JobFiles(job.artifact_dir)
    runs = render_job(job.recipe, version=job.version, files=files, workdir=job.workdir)
    check_job_start(job.recipe)
    recipe = job.recipe
    domain = make_domain(recipe["domain"], recipe["reward"].get("judges"))
    for component in (recipe.get("reward") or {}).get("components") or []:
        if component["name"] not in domain.components:
            raise EvoError(
                f"domain {domain.name!r} has no reward component {component['name']!r}",
                field="reward.components",
                hint=f"components of {domain.name!r}: {', '.join(domain.components)}",
            )
    train, val = domain.split(recipe["domain"]["train_size"], recipe["domain"]["val_size"])
    files.train_file.parent.mkdir(parents=True, exist_ok=True)
    environment = recipe_environment(recipe)
    tools = domain.name if environment is not None else None
    write_verl_parquet(train, files.train_file, split="train", tools=tools)
    write_verl_parquet(val, files.val_file, split="val", tools=tools)
    config = {
        "domain": recipe["domain"],
        "reward": recipe["reward"],
        "group_filter": recipe.get("group_filter") or {"name": "none"},
    }
    files.reward_config.write_text(json.dumps(config, indent=2, sort_keys=True))
    if environment is not None and verl_settings(recipe)["tool_config_path"] is None:
        # JSON is YAML: verl reads the file with OmegaConf.load.
        files.tool_config.write_text(
            json.dumps(tool_config(recipe["domain"], environment), indent=2, sort_keys=True)
        )
    shutil.copyfile(REWARD_TEMPLATE, files.reward_module)
    for override in runs[0].overrides:
        if override.key == SAMPLER_NAME:
            shutil.copyfile(SAMPLER_TEMPLATES[override.value], files.sampler_module)
    for run in runs:
        files.seed_dir(run.seed).mkdir(parents=True, exist_ok=True)


def write_verl_parquet(
    tasks: list[Task], path: Path, *, split: str, tools: str | None = None
) -> None:
    """Tasks as verl dataset rows: a chat `prompt`, `data_source`, `reward_model.ground_truth`
    and `extra_info` carrying what the reward function needs to rebuild the task; with
    `tools` (a multi-turn domain's name), `extra_info.tools_kwargs`, which verl hands to the
    trajectory's tools so they know the task they act on."""
    rows = [
        {
            "data_source": task.data_source,
            "prompt": [{"role": "user", "content": task.prompt}],
            "reward_model": {"style": "rule", "ground_truth": task.answer},
            "extra_info": {
                "split": split,
                "index": index,
                "task_id": task.task_id,
                "question": task.prompt,
                "meta": json.dumps(task.meta, sort_keys=True),
                **({"tools_kwargs": tools_kwargs(tools, task)} if tools else {}),
            },
        }
        for index, task in enumerate(tasks)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def final_scores(val: pa.Table, files: JobFiles) -> pa.Table:
    """SCORE_SCHEMA rows from each seed's last validation step (one row per sample)."""
    tables = []
    for seed in sorted(set(val.column("seed").to_pylist())):
        rows = val.filter(pc.equal(val.column("seed"), seed))
        last = pc.max(rows.column("step")).as_py()
        rows = rows.filter(pc.equal(rows.column("step"), last))
        if rows.column("correct").null_count:
            raise EvoError(
                f"validation step {last} has samples without `acc`",
                where=str(files.validation_dir(seed) / f"{last}.jsonl"),
                hint="the reward function must return a dict with `acc` (correctness in [0, 1])",
            )
        tables.append(rows.select(SCORE_SCHEMA.names).cast(SCORE_SCHEMA))
    return pa.concat_tables(tables).sort_by(
        [("seed", "ascending"), ("task_id", "ascending"), ("sample_idx", "ascending")]
    )


def rendered_shape(job: JobSpec) -> dict[str, Any]:
    """What ingest needs from the rendered config of the job's first seed: verl's group
    sizes (rollout.n, val_kwargs.n), the response budget and the checkpoint path."""
    run = render_job(
        job.recipe, version=job.version, files=JobFiles(job.artifact_dir), workdir=job.workdir
    )[0]
    values = {o.key.lstrip("+"): o.value for o in run.overrides}
    rollout = "actor_rollout_ref.rollout"
    return {
        "train_n": int(values[f"{rollout}.n"]),
        "val_n": int(values[f"{rollout}.val_kwargs.n"]),
        "response_length": int(values["data.max_response_length"]),
        "model_path": Path(str(values["actor_rollout_ref.model.path"])),
    }


def complete_lengths(table: pa.Table, shape: dict[str, Any], result: IngestResult) -> pa.Table:
    """`response_tokens` and `truncated` from the checkpoint's tokenizer when model.path is a
    local directory (no verl dump has them); otherwise they stay null, and say so."""
    if not table.num_rows or not (
        table.column("response_tokens").null_count or table.column("truncated").null_count
    ):
        return table
    if not shape["model_path"].is_dir():
        result.note(
            [],
            [
                "response_tokens, truncated: model.path is not a local directory, "
                "so there is no tokenizer to count with"
            ],
        )
        return table
    table = derive_lengths(table, shape["model_path"], shape["response_length"])
    result.lengths_derived(shape["model_path"], shape["response_length"])
    return table


def join_tasks(table: pa.Table, train_file: Path) -> pa.Table:
    """Task id and data source for V1 train rows, which carry neither (verl dumps no reward
    extras there): the prepared task whose question the prompt contains and whose answer is
    the row's ground truth (`gts`). Rows already carrying a data source are left alone."""
    if not train_file.is_file() or not table.num_rows:
        return table
    unknown = pc.equal(table.column("data_source"), "unknown").to_numpy(zero_copy_only=False)
    if not unknown.any():
        return table
    tasks = [
        (
            str(row["extra_info"]["question"]),
            str(row["reward_model"]["ground_truth"]),
            str(row["extra_info"]["task_id"]),
            str(row["data_source"]),
        )
        for row in pq.read_table(train_file).to_pylist()
    ]
    prompts = table.column("prompt").to_pylist()
    extras = table.column("extra").to_pylist()
    task_ids = table.column("task_id").to_pylist()
    sources = table.column("data_source").to_pylist()
    found: dict[tuple[str, str], tuple[str, str] | None] = {}
    for i in np.flatnonzero(unknown):
        truth = str(json.loads(extras[i] or "{}").get("gts"))
        key = (prompts[i] or "", truth)
        if key not in found:
            # The longest question the prompt contains: "2+2" is also inside "12+2".
            hits = [(len(q), t, d) for q, a, t, d in tasks if a == truth and q and q in key[0]]
            best = [(t, d) for n, t, d in hits if n == max(h[0] for h in hits)]
            found[key] = best[0] if len(set(best)) == 1 else None
        if found[key] is not None:
            task_ids[i], sources[i] = found[key]
    table = table.set_column(
        table.schema.get_field_index("task_id"), "task_id", pa.array(task_ids, pa.string())
    )
    return table.set_column(
        table.schema.get_field_index("data_source"), "data_source", pa.array(sources, pa.string())
    )


def merge_notes(into: IngestResult, result: IngestResult) -> None:
    into.skipped += result.skipped
    into.flavours += [f for f in result.flavours if f not in into.flavours]
    into.note(result.derived, result.missing)
    into.ambiguous += [a for a in result.ambiguous if a not in into.ambiguous]


def _write(tables: list[pa.Table], schema: pa.Schema, path: Path) -> Path | None:
    if not tables:
        return None
    pq.write_table(pa.concat_tables(tables).cast(schema), path)
    return path


def _last_activity(recipe: dict, files: JobFiles) -> float:
    """Newest mtime among the metrics files, dump files and the job record (the launch)."""
    paths = [files.root / JOB_FILE]
    for seed in recipe.get("seeds") or [0]:
        paths.append(files.metrics_file(seed))
        for folder in (files.rollout_dir(seed), files.validation_dir(seed)):
            if folder.is_dir():
                paths += folder.glob("*.jsonl")
    return max((p.stat().st_mtime for p in paths if p.is_file()), default=0.0)


def _progress(recipe: dict, files: JobFiles) -> float | None:
    """Finished steps over all seeds' steps, from the last line of each metrics file."""
    seeds = recipe.get("seeds") or [0]
    total = recipe["grpo"]["steps"] * len(seeds)
    if total <= 0:
        return None
    done = sum(_last_step(files.metrics_file(seed)) for seed in seeds)
    return min(1.0, done / total)


def _last_step(path: Path) -> int:
    text = _read_text(path)
    for line in reversed((text or "").splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line being written, or a foreign one
    return 0


def _ray_client(address: str) -> Any:
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as err:
        raise EvoError(
            "verl.ray_address is set, and Ray's job client is not installed here",
            field="verl.ray_address",
            hint='pip install "ray[default]"',
        ) from err
    try:
        return JobSubmissionClient(address)
    except ConnectionError as err:
        raise EvoError(
            f"cannot reach the Ray job server: {err}",
            field="verl.ray_address",
            hint="is the head's dashboard up (ray start --head --dashboard-host "
            "0.0.0.0) and reachable on port 8265?",
        ) from err


def _package_parent() -> str:
    return str(Path(evotrainer.__file__).resolve().parent.parent)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None
