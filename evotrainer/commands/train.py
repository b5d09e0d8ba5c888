"""`evotrainer train RECIPE.yaml --out DIR`: one standalone job on the embedded engine."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from evotrainer.errors import EvoError
from evotrainer.store import recipe as recipes
from evotrainer.store import specs
from evotrainer.terminal import console, safe


def load_recipe(path: Path) -> dict:
    """A (possibly partial) recipe mapping from YAML, resolved onto BASE_RECIPE. Read with
    the spec loader's bounds (size, aliases, depth) and checked against the same recipe
    schema as a workspace's `recipe:` blocks, so a typo (`grpo: {stesp: 3}`) is refused with
    its line and a "did you mean" here too instead of training the defaults."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise EvoError(f"cannot read the recipe: {err.strerror}", where=str(path)) from None
    doc = specs.parse(raw, str(path))
    if doc.data is None:
        doc.data = {}
    if not isinstance(doc.data, dict):
        raise EvoError(
            "a recipe file must hold a mapping", where=str(path), hint="e.g. `grpo: {steps: 20}`"
        )
    problems = specs.recipe_problems(doc)
    if problems:
        raise problems[0]
    return recipes.resolve(doc.data, [])


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train(
        recipe_file: Path = typer.Argument(
            ..., help="Recipe YAML (partial: merged onto the base recipe).", metavar="RECIPE.yaml"
        ),
        out: Path = typer.Option(
            ..., "--out", help="Artifact directory for the run.", metavar="DIR"
        ),
        version: str = typer.Option("adhoc", "--version", help="Version name on the rows."),
        as_json: bool = typer.Option(False, "--json", help="Print the job's result as JSON."),
    ) -> None:
        """Train one job on the embedded GRPO engine (warm start, GRPO, evaluation) and write
        rollouts, steps, scores, checkpoint and result.json under DIR."""
        recipe = load_recipe(recipe_file)
        from evotrainer.contract.recipe import check_recipe
        from evotrainer.engine import run_job

        try:
            check_recipe(recipe)
        except EvoError as err:
            err.where = err.where or str(recipe_file)
            raise
        result = run_job(recipe, out, version, progress=True)  # progress goes to stderr
        if as_json:
            print(json.dumps(result, indent=2, default=str))
            return
        console().print(
            f"{safe(version)}: {safe(result['status'])}, {result['steps_done']} steps, "
            f"val avg@{result['eval_k']} {result['val_avg']:.3f} "
            f"in {result['wall_time_s']:.1f}s → {safe(out)}"
        )
