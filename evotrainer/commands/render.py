"""`evotrainer render V`: print the verl run a version's recipe becomes, whatever backend the
recipe names, so a reviewer (or a cluster operator) sees exactly what would be launched."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import typer
import yaml

from evotrainer.backends.base import job_id
from evotrainer.backends.verl_render import (
    JobFiles,
    RenderedRun,
    entrypoint,
    job_env,
    render_job,
    verl_settings,
)
from evotrainer.commands.train import load_recipe
from evotrainer.errors import EvoError
from evotrainer.store import recipe as recipes

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
            1, "--attempt", help="Attempt number (names the job's artifact dir)."
        ),
        artifact_dir: Path = typer.Option(
            None,
            "--artifact-dir",
            help="Artifact dir to render paths under (default: the "
            "workspace's, or ./.evotrainer/artifacts/NAME/JOB with --recipe).",
            metavar="DIR",
        ),
    ) -> None:
        """Print the verl 0.9.1 command a version would run (checked, nothing launched)."""
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
        name, recipe, workdir, jid, default_artifacts = _resolve(version, recipe_file, attempt)
        files = JobFiles((artifact_dir or default_artifacts).resolve())
        runs = render_job(recipe, version=name, files=files, workdir=workdir)
        if seed is not None:
            runs = [r for r in runs if r.seed == seed]
            if not runs:
                raise EvoError(
                    f"the recipe has no seed {seed}",
                    field="seeds",
                    hint=f"seeds: {recipe.get('seeds')}",
                )
        typer.echo(_format(fmt, runs, recipe, workdir, jid), nl=False)


def _resolve(
    version: str | None, recipe_file: Path | None, attempt: int
) -> tuple[str, dict, Path, str, Path]:
    """(name, resolved recipe, worktree, job id, default artifact dir)."""
    if recipe_file is not None:
        recipe = load_recipe(recipe_file)
        name = version or recipe_file.stem
        jid = job_id(name, attempt, recipes.digest(recipe))
        return name, recipe, Path.cwd(), jid, Path(".evotrainer") / "artifacts" / name / jid
    if version is None:
        raise EvoError("name a version, or pass --recipe FILE", hint="evotrainer render v1")
    from evotrainer.store.workspace import Workspace

    ws = Workspace.find()
    recipe = ws.resolved_recipe(version)
    jid = job_id(version, attempt, recipes.digest(recipe))
    return version, recipe, ws.worktree_path(version), jid, ws.artifact_dir(version, jid)


def _format(fmt: str, runs: list[RenderedRun], recipe: dict, workdir: Path, jid: str) -> str:
    if fmt == "overrides":
        return "".join(o.hydra() + "\n" for o in runs[0].overrides)
    if fmt == "yaml":
        return yaml.safe_dump(runs[0].as_yaml_tree(), sort_keys=False)
    settings = verl_settings(recipe)
    command = entrypoint(runs, settings["python"])
    if settings["ray_address"] is None:
        exports = [f"export {k}={shlex.quote(v)}" for k, v in sorted(job_env(recipe).items())]
        return "\n".join([*exports, f"cd {shlex.quote(str(workdir))}", command]) + "\n"
    # The equivalent of what the backend submits through the Python job client.
    runtime_env = {"env_vars": job_env(recipe), "excludes": [".git"]}
    return (
        f"ray job submit --address {shlex.quote(settings['ray_address'])} "
        f"--submission-id {jid} --working-dir {shlex.quote(str(workdir))} "
        f"--runtime-env-json {shlex.quote(json.dumps(runtime_env))} --no-wait -- {command}\n"
    )
