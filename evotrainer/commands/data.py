"""`evotrainer data convert FORMAT SRC OUT`: benchmark files to the dataset domains' rows."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from evotrainer.domains.data.convert import convert_file, write_rows
from evotrainer.terminal import console as make_console
from evotrainer.terminal import safe


def register(app: typer.Typer) -> None:
    data = typer.Typer(
        help="Bring datasets into the domains' row formats.", no_args_is_help=True
    )
    app.add_typer(data, name="data")

    @data.command("convert")
    def convert(
        fmt: str = typer.Argument(
            ...,
            metavar="FORMAT",
            help="aime (math: AIME/CNMO/MATH-style {problem, answer}), taco, livecodebench, "
            "code_contests (code: stdin/stdout tests), swe_rebench (swe_rebench: SWE-rebench "
            "/ SWE-bench instances, with --repos).",
        ),
        src: Path = typer.Argument(..., help="The file to convert (JSONL or Parquet)."),
        out: Path = typer.Argument(..., help="The JSONL to write (domain.data.train / val)."),
        data_source: str = typer.Option(
            None,
            "--data-source",
            help="The stratum its rows belong to (e.g. aime24) [default: the row's own, else "
            "SRC's name]; code rows add /<difficulty>.",
        ),
        repos: Path = typer.Option(
            None,
            "--repos",
            help="swe_rebench: the folder of local repository mirrors, owner__name.bundle "
            "(or .git, or a clone) per repository; nothing is downloaded.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Convert a benchmark file to the rows of the math, code or swe_rebench domain, each
        checked by building its task. Rows whose tests are not stdin/stdout (or whose
        repository has no local mirror) are skipped and counted; a malformed row stops the
        conversion, named by its row number."""
        result = convert_file(fmt, src, data_source=data_source, repos=repos)
        write_rows(result.rows, out)
        strata: dict[str, int] = {}
        for row in result.rows:
            strata[row["data_source"]] = strata.get(row["data_source"], 0) + 1
        summary = {
            "domain": result.domain,
            "out": str(out),
            "rows": len(result.rows),
            "data_sources": strata,
            "skipped": dict(result.skipped),
            "notes": dict(result.notes),
        }
        if as_json:
            typer.echo(json.dumps(summary, indent=2))
            return
        console = make_console()
        console.print(
            f"Wrote {len(result.rows)} {result.domain} rows to {safe(out)} "
            f"(domain.data.train / val with domain name {result.domain})"
        )
        for source, count in sorted(strata.items()):
            console.print(f"  data_source {safe(source)}: {count}")
        for reason, count in sorted(result.skipped.items()):
            console.print(f"  [yellow]skipped {count}:[/] {safe(reason)}")
        for note, count in sorted(result.notes.items()):
            console.print(f"  [yellow]{count} row(s):[/] {safe(note)}")

