"""`evotrainer compare A B`: paired comparison of two per-task score tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.table import Table

from evotrainer.errors import EvoError, unreadable_table
from evotrainer.evidence.io import read_scores
from evotrainer.gate.decision import recorded_scores
from evotrainer.stats import GateProcedure, confidence_label
from evotrainer.stats.paired import compare_tables
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console as make_console

SCORE_SUFFIXES = (".csv", ".parquet")


def register(app: typer.Typer) -> None:
    @app.command("compare")
    def compare(
        a: str = typer.Argument(..., help="Parent: a version, scores csv/parquet or run folder."),
        b: str = typer.Argument(..., help="Candidate: likewise."),
        resamples: int = typer.Option(GateProcedure.resamples, "--resamples",
                                       help="Bootstrap resamples."),
        seed: int = typer.Option(0, "--seed", help="Bootstrap RNG seed."),
        alpha: float = typer.Option(GateProcedure.alpha, "--alpha",
                                     help="1 - confidence level."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ) -> None:
        """Delta = B - A over common tasks: paired bootstrap CI and p (stratified by
        data_source, seeds pooled hierarchically), Wilcoxon signed-rank, pass@k."""
        result = compare_tables(_scores(a), _scores(b), B=resamples, seed=seed, alpha=alpha)
        if as_json:
            # Strict JSON: a float that is not finite (a NaN p-value) is null, never `NaN`.
            typer.echo(json.dumps(_finite(result), indent=2, allow_nan=False))
            return
        label = confidence_label(result)
        table = Table(
            title=f"B - A over {result['n_tasks']} tasks "
            f"({result['samples_per_task']} samples/task, seeds "
            f"{result['n_seeds_a']}/{result['n_seeds_b']})"
        )
        for column in (
            "stratum",
            "tasks",
            "A",
            "B",
            "delta",
            label,
            "p boot",
            "p wilcoxon",
        ):
            table.add_column(column, justify="left" if column == "stratum" else "right")
        rows = result["strata"] if len(result["strata"]) > 1 else []
        for row in [*rows, {**result, "data_source": "all", "n_tasks": result["n_tasks"]}]:
            table.add_row(
                row["data_source"],
                str(row["n_tasks"]),
                f"{row['mean_a']:.4f}",
                f"{row['mean_b']:.4f}",
                f"{row['delta']:+.4f}",
                f"[{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]",
                f"{row['p_bootstrap']:.4g}",
                f"{row['p_wilcoxon']:.4g}",
            )
        console = make_console()
        console.print(table)
        for row in result["pass_at_k"]:
            console.print(
                f"pass@{row['k']}: A {row['a']:.4f}  B {row['b']:.4f}  delta {row['delta']:+.4f}"
            )
        if result["n_only_a"] or result["n_only_b"]:
            console.print(
                f"[yellow]Left out {result['n_only_a']} task(s) only in A and "
                f"{result['n_only_b']} only in B.[/]"
            )


def _scores(ref: str):
    """A path to a score table or run folder, else a workspace version's recorded scores. A
    reference that can only be a path (a table's suffix, a folder separator) and is missing is
    a missing file, not a version."""
    path = Path(ref)
    if path.exists():
        with unreadable_table(path, "give a scores .csv or .parquet file, or a run folder"):
            return read_scores(path)
    if path.suffix in SCORE_SUFFIXES or len(path.parts) > 1:
        raise EvoError("no such file", where=ref, hint="give a scores .csv or .parquet file, "
                       "a run folder, or a version name (`evotrainer lineage` lists them)")
    return recorded_scores(Workspace.find(), ref)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
