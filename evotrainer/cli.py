"""The `evotrainer` command line. Each command lives in its own module under
`evotrainer/commands/` and registers itself on the app (as pre-commit's `commands/`).

A command's module is imported only when that command runs (or shows its own `--help`):
most of them pull in pyarrow, duckdb, GitPython or jsonschema, and importing all of them made
every command, `--version` included, take seconds to start. `evotrainer --help` lists each
command with the help its module's source declares, read without importing it.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import sys
from functools import cache
from pathlib import Path

import typer

try:  # typer >= 0.26 carries its own copy of click; older releases use click itself
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_errors
from evotrainer import __version__, commands
from evotrainer.errors import EvoError
from evotrainer.terminal import console, safe

# Raised (with the help as its message) for a group called without a command; click < 8.2
# printed the help itself.
_NO_ARGS_IS_HELP = getattr(click_errors, "NoArgsIsHelpError", ())

# Order here is the order of `evotrainer --help`; command modules not listed follow, by name.
COMMAND_ORDER = [
    "init",
    "validate",
    "version",
    "lineage",
    "approve",
    "pr",
    "plan",
    "reconcile",
    "unlock",
    "train",
    "ingest",
    "diagnose",
    "compare",
    "skills",
    "backtest",
    "propose",
    "evolve",
    "harness",
    "render",
    "report",
]



def _command_modules() -> list[str]:
    found = {m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")}
    return [n for n in COMMAND_ORDER if n in found] + sorted(found - set(COMMAND_ORDER))


class LazyCommandGroup(typer.core.TyperGroup):
    """The root command. Each command starts as a stand-in carrying only its name (so a typo
    gets a "did you mean"), and its help once `--help` lists it; the first time it is looked
    up for anything else (to run it, or for its own --help) its module is imported and the
    real command takes the stand-in's place."""

    def __init__(self, **attrs: object) -> None:
        super().__init__(**attrs)
        self._listing = False
        self._standing_in = set(_command_modules()) - set(self.commands)
        for name in self._standing_in:
            self.commands[name] = typer.core.TyperCommand(name)
        self.commands = {n: self.commands[n] for n in _command_modules() if n in self.commands}

    def get_command(self, ctx: typer.Context, cmd_name: str) -> typer.core.TyperCommand | None:
        if cmd_name in self._standing_in and not self._listing:
            self.commands[cmd_name] = load_command(cmd_name)
            self._standing_in.discard(cmd_name)
        return self.commands.get(cmd_name)

    def format_help(self, ctx: typer.Context, formatter: object) -> None:
        self._listing = True  # the listing needs names and help only: import nothing
        for name in self._standing_in:  # read here, not at start-up: only a listing shows it
            help_text = declared_help(name)
            self.commands[name].help = help_text
            self.commands[name].short_help = " ".join(help_text.split("\n\n")[0].split())
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


def load_command(name: str) -> typer.core.TyperCommand:
    """The real command `name`: its module imported and registered on an app of its own."""
    holder = typer.Typer()
    importlib.import_module(f"evotrainer.commands.{name}").register(holder)
    command = typer.main.get_group(holder).commands[name]
    _tidy_help(command)
    return command


@cache
def declared_help(name: str) -> str:
    """A command's help as its module's source declares it, read without importing the
    module: the docstring of the function registered with `@app.command("name")`, or the
    `help=` of the `typer.Typer(...)` group it adds under that name."""
    source = Path(commands.__path__[0]) / f"{name}.py"
    tree = ast.parse(source.read_text(encoding="utf-8"), str(source))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
            and d.func.attr == "command" and d.args and isinstance(d.args[0], ast.Constant)
            and d.args[0].value == name
            for d in node.decorator_list
        ):
            return ast.get_docstring(node) or ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Typer":
            for keyword in node.keywords:
                if keyword.arg == "help" and isinstance(keyword.value, ast.Constant):
                    return str(keyword.value.value)
    return ""


app = typer.Typer(
    name="evotrainer",
    cls=LazyCommandGroup,
    help="RL post-training as reviewable git history: versions are branches, "
    "the harness is data, reconcile makes the records match the specs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"evotrainer {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    directory: Path = typer.Option(
        None, "-C", help="Run as if started in DIR (like git -C).", metavar="DIR"
    ),
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True,
        callback=_print_version,
    ),
) -> None:
    if directory is not None:
        if not directory.is_dir():
            raise EvoError(f"-C {directory}: no such directory")
        os.chdir(directory)


def _tidy_help(command: typer.core.TyperGroup | typer.core.TyperCommand) -> None:
    """Typer labels a flag `<bool>` and a repeatable option `<list[str]>`, but a flag takes
    no value and a repeatable option one value each time it is given: say so in `--help`.
    It shows an argument as `{name}` in the usage line (click's convention is NAME), and
    lists a command with its docstring's line breaks: one line each instead."""
    help_option = command.get_help_option(typer.Context(command))  # made once, then cached
    for param in [*command.params, *filter(None, [help_option])]:
        if param.metavar is not None:
            continue
        if param.param_type_name == "argument":
            param.metavar = param.name.upper()
            continue
        if param.param_type_name != "option":
            continue
        if param.is_flag:
            param.metavar = ""
        elif param.multiple and hasattr(param, "bare_type"):  # typer's own labels: list[X]
            param.metavar = f"<{param.bare_type().removeprefix('list[').removesuffix(']')}>"
    for sub in getattr(command, "commands", {}).values():
        if sub.short_help is None and sub.help:
            sub.short_help = " ".join(sub.help.split("\n\n")[0].split())
        _tidy_help(sub)


# Options users reach for by another tool's name, and the one each means here.
OPTION_SYNONYMS = {"--from": "--parent", "--base": "--parent", "--on": "--parent",
                   "--seeds": "--seed", "--yes": "--approve"}


def _meant_option(err: click_errors.NoSuchOption) -> str | None:
    """The option the user meant: a synonym's, where the command has it, else click's
    closest spelling (it offers the nearest by edit distance, which can be unrelated)."""
    options = {opt for param in (err.ctx.command.params if err.ctx else [])
               for opt in getattr(param, "opts", [])}
    synonym = OPTION_SYNONYMS.get(err.option_name)
    if synonym in options:
        return synonym
    return ", ".join(sorted(err.possibilities or [])) or None


def _fail(err: EvoError) -> None:
    # The message can carry user text (a spec key, a --set value): shown, never interpreted.
    console(stderr=True).print(f"[bold red]error:[/] {safe(err)}")
    sys.exit(1)


def _os_error_reason(err: OSError) -> str:
    # mkdir(exist_ok=True) says "File exists" and a path through a file "Not a directory":
    # both mean a file stands where the path needs a folder.
    if isinstance(err, (FileExistsError, NotADirectoryError)):
        return f"{err.strerror}: a file stands where this path needs a folder"
    return err.strerror or str(err)


def _os_error_path(err: OSError) -> str | None:
    paths = [str(p) for p in (err.filename, err.filename2) if p is not None]
    return " → ".join(paths) or None


def main() -> None:
    """Run the CLI. An EvoError or a usage error becomes one line on stderr and exit code 1;
    a command's `typer.Exit(code)` becomes the exit code."""
    command = typer.main.get_command(app)
    _tidy_help(command)
    try:
        result = command.main(prog_name="evotrainer", standalone_mode=False)
    except _NO_ARGS_IS_HELP as err:  # `evotrainer` or `evotrainer version` alone: the help
        if err.format_message():  # typer's rich help is printed as it is made; plain is not
            typer.echo(err.format_message())
        sys.exit(0)
    except EvoError as err:
        _fail(err)
    except click_errors.NoSuchOption as err:
        where = err.ctx.command_path if err.ctx else "evotrainer"
        meant = _meant_option(err)
        _fail(EvoError(f"no such option: {err.option_name}",
                       hint=f"did you mean {meant}?" if meant else f"see `{where} --help`"))
    except click_errors.UsageError as err:
        where = err.ctx.command_path if err.ctx else "evotrainer"
        _fail(EvoError(err.format_message(), hint=f"see `{where} --help`"))
    except click_errors.ClickException as err:
        _fail(EvoError(err.format_message()))
    except typer.Abort:
        _fail(EvoError("aborted"))
    except OSError as err:
        # A path given on the command line (or one under it) that cannot be read or written:
        # under a file, on a read-only or missing mount, a folder where a file belongs. The
        # system's reason and the path say what to fix; a traceback would not.
        _fail(EvoError(_os_error_reason(err), where=_os_error_path(err),
                       hint="check that path: a folder to write must be creatable there, "
                       "a file to read must exist"))
    # Without standalone mode click returns an exit code from `typer.Exit`, else the
    # command's own return value (None).
    sys.exit(result if isinstance(result, int) else 0)
