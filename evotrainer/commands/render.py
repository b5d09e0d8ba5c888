"""`evotrainer render V`: print the verl job reconcile would submit for a version — the same
JobSpec (its job recipe, job id and artifact dir, from reconcile's own `pending_launch`) made
into a command by the same function the backend's submit uses (`job_runs`), so a reviewer or
a cluster operator sees exactly what would be launched. An evaluation-only version renders 0
steps and no merge; a continuing one (`model.init: parent`) starts from its parent's
recorded policy. `--recipe FILE` previews any recipe as a verl job."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

import typer
import yaml

from evotrainer.backends.base import JobSpec, job_id
from evotrainer.backends.verl import job_command, job_runs, local_env, ray_runtime_env
from evotrainer.backends.verl_render import RenderedRun, verl_settings
from evotrainer.commands.train import load_recipe
from evotrainer.errors import EvoError
from evotrainer.store import recipe as recipes
from evotrainer.store.records import RETRIED_STATES
from evotrainer.trackers import RunIdentity

FORMATS = ("overrides", "yaml", "shell")
BACKENDS = ("verl",)


def register(app: typer.Typer) -> None:
    @app.command("render")
    def render(
        version: str = typer.Argument(None, help="Version name (omit with --recipe)."),
        backend: str = typer.Option("verl", "--backend", help="Backend to render for: verl."),
        fmt: str = typer.Option(
            "overrides",
            "--format",
            help="overrides (one Hydra override per line), yaml, or shell (the whole job).",
        ),
        recipe_file: Path = typer.Option(
            None,
            "--recipe",
            help="Render this recipe YAML (merged over the base recipe) "
            "instead of a version's; no workspace needed.",
            metavar="FILE",
        ),
        seed: int = typer.Option(
            None,
            "--seed",
            help="Only this seed (default: the first "
            "seed for overrides/yaml, every seed for shell).",
        ),
        attempt: int = typer.Option(
            None,
            "--attempt",
            help="Attempt number (names the job and its artifact dir) [default: the one "
            "reconcile launches next: the run's attempt, or the next after a failed one].",
        ),
        artifact_dir: Path = typer.Option(
            None,
            "--artifact-dir",
            help="With --recipe: artifact dir to render paths under "
            "[default: ./.evotrainer/artifacts/NAME/JOB].",
            metavar="DIR",
        ),
    ) -> None:
        """Print the verl 0.9.1 command reconcile would submit for a version (checked,
        nothing launched)."""
        if backend not in BACKENDS:
            raise EvoError(
                f"cannot render for backend {backend!r}",
                field="--backend",
                hint=f"choose one of: {', '.join(BACKENDS)}",
            )
        if fmt not in FORMATS:
            raise EvoError(
                f"unknown format {fmt!r}",
                field="--format",
                hint=f"choose one of: {', '.join(FORMATS)}",
            )
        if attempt is not None and attempt < 1:
            raise EvoError(f"attempt must be 1 or more, not {attempt}", field="--attempt")
        if recipe_file is not None:
            job, identity = recipe_job(recipe_file, version, attempt or 1, artifact_dir)
        elif version is None:
            raise EvoError("name a version, or pass --recipe FILE", hint="evotrainer render v1")
        else:
            if artifact_dir is not None:
                raise EvoError(
                    "a version's job has its artifact dir under the workspace's artifact root",
                    field="--artifact-dir",
                    hint="drop --artifact-dir, or render a recipe file with --recipe",
                )
            job, identity = version_job(version, attempt)
        runs = job_runs(job, identity)
        if seed is not None:
            runs = [r for r in runs if r.seed == seed]
            if not runs:
                raise EvoError(
                    f"the recipe has no seed {seed}",
                    field="seeds",
                    hint=f"seeds: {job.recipe.get('seeds')}",
                )
        typer.echo(_format(fmt, runs, job), nl=False)


def version_job(name: str, attempt: int | None) -> tuple[JobSpec, RunIdentity]:
    """The JobSpec reconcile's launch would hand the backend for version `name`, and the
    tracker identity it would write beside it, built by reconcile's own functions without
    launching, committing or writing anything."""
    from evotrainer.control.reconcile import load_context, pending_launch
    from evotrainer.store.workspace import Workspace
    from evotrainer.trackers.records import run_identity

    ws = Workspace.find()
    ctx = load_context(ws)
    state = ws.version(name, ctx.states)
    backend = ws.resolved_recipe(name, ctx.states).get("backend")
    if backend not in BACKENDS:
        raise EvoError(
            f"{name} runs on the {backend} backend; render prints verl jobs only",
            field="backend",
            hint=f"for verl: evotrainer version new NAME --parent {name} --rationale WHY "
            "--set backend=verl --set model.path=HF_DIR",
        )
    refusal = ctx.validation.refusal(name, ctx.states)
    if refusal:
        raise EvoError(f"{name} is invalid, so reconcile launches nothing: {refusal}",
                       hint="fix it; `evotrainer validate` lists every problem")
    previous = state.records.get("run") or {}
    if attempt is None and previous.get("state") in RETRIED_STATES:
        attempt = int(previous["attempt"]) + 1
    run, job = pending_launch(ctx, state, attempt)
    launched = replace(state, records={**state.records, "run": run})
    return job, run_identity(ws, launched, ctx.states)


def recipe_job(
    recipe_file: Path, name: str | None, attempt: int, artifact_dir: Path | None
) -> tuple[JobSpec, RunIdentity]:
    """A recipe file as a verl job of its own (whatever backend it names): a preview."""
    recipe = load_recipe(recipe_file)
    name = name or recipe_file.stem
    jid = job_id(name, attempt, recipes.digest(recipe))
    folder = (artifact_dir or Path(".evotrainer") / "artifacts" / name / jid).resolve()
    job = JobSpec(jid, name, recipe, Path.cwd(), folder)
    return job, RunIdentity.read(folder, name)


def _format(fmt: str, runs: list[RenderedRun], job: JobSpec) -> str:
    if fmt == "overrides":
        return "".join(o.hydra() + "\n" for o in runs[0].overrides)
    if fmt == "yaml":
        return yaml.safe_dump(runs[0].as_yaml_tree(), sort_keys=False)
    settings = verl_settings(job.recipe)
    command = job_command(job, runs)
    if settings["ray_address"] is None:
        exports = [f"export {k}={shlex.quote(v)}" for k, v in sorted(local_env(job).items())]
        return "\n".join([*exports, f"cd {shlex.quote(str(job.workdir))}", command]) + "\n"
    # The equivalent of what the backend submits through the Python job client.
    runtime_env = ray_runtime_env(job)
    working_dir = runtime_env.pop("working_dir")
    return (
        f"ray job submit --address {shlex.quote(settings['ray_address'])} "
        f"--submission-id {job.job_id} --working-dir {shlex.quote(working_dir)} "
        f"--runtime-env-json {shlex.quote(json.dumps(runtime_env))} --no-wait -- {command}\n"
    )
