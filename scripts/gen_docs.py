"""Write the reference pages generated from their source: docs/cli.md from the command line's
own help, docs/evidence.md from the canonical table's schema. `tests/test_docs.py` fails when
either page differs from what this writes, so run it after changing a command or a column:

    .venv/bin/python scripts/gen_docs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _command_section(command, path: list[str], ctx: typer.Context) -> list[str]:
    lines = [f"## `{' '.join(path)}`", "", _cell(command.help), ""]
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines += ["```", f"{' '.join(path)} {usage}".rstrip(), "```", ""]
    rows = []
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        names = ", ".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts))
        kind = param.param_type_name  # argument | option
        rows.append(f"| {names} | {kind} | {_cell(getattr(param, 'help', None))} |")
    if rows:
        lines += ["| name | kind | what it does |", "|---|---|---|", *rows, ""]
    if hasattr(command, "list_commands"):  # a group: its subcommands follow
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                sub_ctx = typer.Context(sub, info_name=name, parent=ctx)
                lines += _command_section(sub, [*path, name], sub_ctx)
    return lines


def cli_page() -> str:
    from evotrainer.cli import app

    root = typer.main.get_command(app)
    ctx = typer.Context(root, info_name="evotrainer")
    lines = ["# Command-line reference", "",
             "Generated from each command's own help by `scripts/gen_docs.py`; "
             "`evotrainer COMMAND --help` shows the same.", "",
             _cell(root.help), ""]
    for name in root.list_commands(ctx):
        command = root.get_command(ctx, name)
        if command is not None and not command.hidden:
            lines += _command_section(command, ["evotrainer", name],
                                      typer.Context(command, info_name=name, parent=ctx))
    return "\n".join(lines).rstrip() + "\n"


def evidence_page() -> str:
    from evotrainer.evidence.columns import COLUMN_DOCS
    from evotrainer.evidence.schema import ROLLOUT_SCHEMA, SCORE_SCHEMA

    lines = ["# Evidence: the canonical rollout table", "",
             "Generated from `evotrainer/evidence/schema.py` and `columns.py` by "
             "`scripts/gen_docs.py`.", "",
             "One row per trajectory, Parquet (`rollouts/train.parquet`, `rollouts/val.parquet` "
             "in a run's artifact folder), written by the embedded engine and by the verl "
             "ingest alike. Null means \"not recorded\". A rollout id is "
             "`version/seed/split/step/group_id/sample_idx`.", "",
             "| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{f.name}` | `{f.type}` | {_cell(COLUMN_DOCS[f.name])} |"
              for f in ROLLOUT_SCHEMA]
    lines += ["", "Per-step metrics are `steps.parquet` in long format (`version, seed, step, "
              "metric, value`). The per-task score table of the final evaluation, committed "
              "as `runs/<name>/scores.csv` and the unit of every comparison, has the columns "
              + ", ".join(f"`{f.name}` (`{f.type}`)" for f in SCORE_SCHEMA) + "."]
    return "\n".join(lines) + "\n"


PAGES = {"cli.md": cli_page, "evidence.md": evidence_page}


def main() -> int:
    for name, make in PAGES.items():
        (DOCS / name).write_text(make())
        print(f"wrote docs/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
