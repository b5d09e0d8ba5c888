"""Every command, given bad paths and bad files, answers with one `error:` line (or does its
job) and never a traceback. The commands and their path parameters are read from the CLI
itself (every registered command and subcommand; a parameter typed Path, or a string whose
help says it takes a file or directory), so a new command is covered when it is added."""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

from evotrainer.cli import app

# A string parameter that takes a path says so in its help.
PATH_HELP = re.compile(r"\bfile\b|\bdirectory\b|run folder|file/folder", re.IGNORECASE)
# Commands that wait for jobs or follow a log until interrupted: nothing to do with paths.
NEVER_ENDING = {"logs", "watch", "evolve"}


def commands() -> Iterator[tuple[list[str], object]]:
    """(argv prefix, click command) of every leaf command the CLI registers."""
    root = typer.main.get_command(app)
    context = typer.Context(root)

    def walk(group, prefix: list[str]) -> Iterator[tuple[list[str], object]]:
        for name in group.list_commands(context):
            command = group.get_command(context, name)
            if hasattr(command, "list_commands"):
                yield from walk(command, [*prefix, name])
            else:
                yield [*prefix, name], command

    yield from walk(root, [])


def is_path(param) -> bool:
    if param.name == "help":
        return False
    kind = param.bare_type()
    return kind == "Path" or (kind in ("str", "list[str]") and bool(PATH_HELP.search(
        param.help or "")))


def bad_values(tmp: Path) -> dict[str, str]:
    """What a user mistypes or finds on a disk, by name."""
    tmp.mkdir(parents=True, exist_ok=True)
    plain = tmp / "plain.txt"
    plain.write_text("not a folder\n")
    junk = tmp / "junk.parquet"
    junk.write_bytes(b"PAR1 this is not parquet \x00\xff\xfe" * 40)
    text = tmp / "notes.csv"
    text.write_text("this,is\nnot,\"a score table\n")
    yaml_junk = tmp / "junk.yaml"
    yaml_junk.write_text("key: [unclosed\n  - : :\n")
    empty_dir = tmp / "empty-dir"
    empty_dir.mkdir()
    (tmp / "empty.csv").write_text("")
    return {
        "missing": str(tmp / "no-such-thing"),
        "under a file": str(plain / "sub" / "x"),
        "unwritable": "/proc/version/x",
        "not a folder": str(plain),
        "not parquet": str(junk),
        "broken csv": str(text),
        "broken yaml": str(yaml_junk),
        "empty file": str(tmp / "empty.csv"),
        "a folder": str(empty_dir),
    }


def invocations(tmp: Path) -> Iterator[tuple[str, list[str]]]:
    for prefix, command in commands():
        if prefix[0] in NEVER_ENDING:
            continue
        params = [p for p in command.params if p.name != "help"]
        for target in filter(is_path, params):
            # Fresh files per parameter: a command that wrote somewhere (init into the
            # "missing" folder) leaves nothing another case would read.
            bad = bad_values(tmp / "-".join([*prefix, target.name]))
            for label, value in bad.items():
                argv = list(prefix)
                for param in params:
                    chosen = value if param is target else None
                    if chosen is None and param.required:
                        # Another required path: one that fails if ever written or read,
                        # so no command starts real work with it.
                        chosen = bad["under a file"] if is_path(param) else "v0"
                    if chosen is None:
                        continue
                    if param.param_type_name == "argument":
                        argv.append(chosen)
                    else:
                        argv += [param.opts[-1], chosen]
                yield f"{' '.join(argv[:len(prefix)])} {target.name}={label}", argv


def test_every_command_answers_bad_paths_and_files_with_one_error_line(
    cli, workspace, tmp_path, monkeypatch
):
    # No planner, tracker or GitHub call may leave this machine.
    for name in ("ANTHROPIC_API_KEY", "GITHUB_TOKEN", "GITHUB_REPOSITORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    problems = []
    seen = 0
    for case, argv in invocations(tmp_path / "bad"):
        seen += 1
        try:
            result = cli(*argv, cwd=workspace.root)
        except Exception:  # what `main()` let through reaches the user as a traceback
            problems.append(f"{case}: traceback\n{traceback.format_exc(limit=-3)}")
            continue
        if result.code == 0:
            continue
        lines = result.err.splitlines()
        if len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in result.err:
            problems.append(f"{case}: exit {result.code}, stderr {result.err[-400:]!r}")
    assert seen > 100  # every path parameter of every command, with each bad value
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", ["report", "diagnose", "train", "init", "export", "compare"])
def test_the_walk_reaches_the_commands_the_issue_names(tmp_path, name):
    reached = {case.split(" ")[0] for case, _ in invocations(tmp_path)}
    assert name in reached


def test_the_cases_the_issue_names_say_which_path_and_why(cli, workspace, tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("a file\n")
    result = cli("report", "--out", str(plain / "site"), cwd=workspace.root)
    assert result.err.startswith(f"error: {plain}: File exists: a file stands where")
    result = cli("report", "--out", "/proc/version/site", cwd=workspace.root)
    assert result.code == 1 and result.err.startswith("error: /proc/version: ")
    result = cli("diagnose", "--rollouts", str(plain), cwd=workspace.root)
    assert result.code == 1 and result.err.count("\n") == 1
    assert result.err.startswith(f"error: {plain}: not a readable table: ")
    assert "canonical rollouts (.parquet)" in result.err
