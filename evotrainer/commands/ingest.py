"""`evotrainer ingest verl DIR`: verl rollout / validation dumps to the canonical table."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import typer

from evotrainer.errors import EvoError
from evotrainer.evidence.verl import derive_lengths, ingest_dump, read_metrics_log
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe


def register(app: typer.Typer) -> None:
    ingest = typer.Typer(
        help="Bring external training evidence into the canonical tables.", no_args_is_help=True
    )
    app.add_typer(ingest, name="ingest")

    @ingest.command("verl")
    def verl(
        directory: Path = typer.Argument(..., help="verl rollout_data_dir or validation_data_dir."),
        version: str = typer.Option(..., "--version", help="Version label for the rows."),
        split: str = typer.Option(..., "--split", help="train or val."),
        out: Path = typer.Option(
            None, "--out", help="Parquet to write [default: rollouts/<split>.parquet]."
        ),
        metrics: Path = typer.Option(
            None,
            "--metrics",
            help="verl file-logger JSONL ({step, data} lines) to write as steps.parquet.",
        ),
        seed: int = typer.Option(0, "--seed", help="Seed label for the rows."),
        group_size: int = typer.Option(
            None,
            "--group-size",
            help="verl's n for this split (rollout.n for train, val_kwargs.n for val): legacy "
            "dumps (no uid) are checked against it, groups of k×n rows (duplicate prompts "
            "merged) reported; legacy validation dumps are grouped by position.",
        ),
        tokenizer: Path = typer.Option(
            None,
            "--tokenizer",
            help="The checkpoint's local directory: derive response_tokens and truncated.",
        ),
        response_length: int = typer.Option(
            None, "--response-length", help="rollout.response_length (with --tokenizer)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Read `<step>.jsonl` dumps into the canonical rollout table, counted as verl counts
        them. Reports the dump's flavour (legacy / v1), what was derived and what is missing.
        Corrupt or cut-off lines are skipped and listed with file:line; the rest is kept."""
        if not directory.is_dir():
            raise EvoError("no such directory", where=str(directory))
        if (tokenizer is None) != (response_length is None):
            raise EvoError(
                "--tokenizer and --response-length go together",
                field="--response-length" if tokenizer else "--tokenizer",
                hint="truncation is response_tokens >= verl's rollout.response_length",
            )
        out = out or Path("rollouts") / f"{split}.parquet"
        result = ingest_dump(
            directory, version=version, split=split, seed=seed, group_size=group_size
        )
        rollouts = result.rollouts
        if tokenizer is not None and rollouts.num_rows:
            rollouts = derive_lengths(rollouts, tokenizer, response_length)
            result.lengths_derived(tokenizer, response_length)
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(rollouts, out)
        skipped = list(result.skipped)
        summary = {
            "rollouts": str(out),
            "files": result.files,
            "rows": rollouts.num_rows,
            "megabytes": round(result.bytes / 1e6, 3),
            "flavour": "+".join(result.flavours),
            "earlier_outputs_folded": result.earlier_outputs,
            "derived": result.derived,
            "missing": result.missing,
            "ambiguous": result.ambiguous,
        }
        if metrics is not None:
            steps, bad = read_metrics_log(metrics, version=version, seed=seed)
            steps_out = out.parent.parent if out.parent.name == "rollouts" else out.parent
            steps_out = steps_out / "steps.parquet"
            pq.write_table(steps, steps_out)
            skipped.extend(bad)
            summary.update(steps=str(steps_out), step_metric_rows=steps.num_rows)
        summary["skipped"] = [f"{s.file}:{s.line}: {s.reason}" for s in skipped]
        if as_json:
            typer.echo(json.dumps(summary, indent=2))
            return
        console = make_console()
        console.print(
            f"Wrote {summary['rows']} rollouts from {summary['files']} file(s) "
            f"({summary['megabytes']} MB, {safe(summary['flavour'])} dump) to {safe(out)}"
        )
        for line in result.derived:
            console.print(f"  derived: {safe(line)}")
        for line in result.missing:
            console.print(f"  [yellow]missing:[/] {safe(line)}")
        for line in result.ambiguous:
            console.print(f"  [yellow]ambiguous:[/] {safe(line)}")
        if metrics is not None:
            console.print(
                f"Wrote {summary['step_metric_rows']} step metrics to {safe(summary['steps'])}"
            )
        if skipped:
            console.print(f"[yellow]Skipped {len(skipped)} unreadable line(s):[/]")
            for line in summary["skipped"]:
                console.print(f"  {safe(line)}")
