"""The command line's own surface: --version, one-line usage errors, help labels, and error
text that cannot inject Rich markup or terminal escapes."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import yaml

from evotrainer import __version__


def test_version_flag(cli):
    result = cli("--version")
    assert result.code == 0 and result.out == f"evotrainer {__version__}\n"


def test_missing_argument_is_one_line(cli):
    result = cli("version", "show")
    assert result.code == 1 and result.out == ""
    assert result.err.count("\n") == 1
    assert result.err.startswith("error: Missing argument 'NAME'.")
    assert "see `evotrainer version show --help`" in result.err


def test_unknown_option_and_command_are_one_line(cli):
    for args, text in [(("diagnose", "--jsn"), "no such option: --jsn"),
                       (("nosuch",), "No such command 'nosuch'")]:
        result = cli(*args)
        assert result.code == 1 and result.err.count("\n") == 1 and text in result.err
        assert "╭" not in result.err


def test_bare_command_prints_help_and_succeeds(cli):
    result = cli()
    assert result.code == 0 and "Usage: evotrainer" in result.out


def test_help_shows_no_type_for_flags_and_element_type_for_repeatable_options(cli):
    out = cli("version", "new", "--help").out
    assert "<bool>" not in out and "list[" not in out
    assert next(line for line in out.splitlines() if "--set" in line).count("<str>") == 1
    assert "<bool>" not in cli("diagnose", "--help").out


def test_help_names_arguments_in_capitals_and_lists_each_command_on_one_line(cli):
    assert "Usage: evotrainer approve [OPTIONS] {NAME}" in cli("approve", "--help").out
    listing = cli("--help").out  # 200 columns: every short help fits on its line
    line = next(line for line in listing.splitlines() if "│ validate" in line)
    assert "the spec at the tip of every evo/* branch and the specs in the working" in line


def test_exit_code_of_a_command_is_kept(cli, workspace):
    # `plan` exits 2 when there are changes (terraform-style); the baseline is unreconciled.
    assert cli("plan", cwd=workspace.root).code == 2


def test_error_text_is_shown_not_interpreted(cli, tmp_path):
    # A directory name is user text inside an EvoError: markup is shown literally and an OSC
    # escape (which could retitle or hyperlink the terminal) never reaches it raw.
    hostile = "[/bold]x\x1b]0;pwned\x07y[red]"
    result = cli("-C", str(tmp_path / hostile), "plan")
    assert result.code == 1 and "Traceback" not in result.err
    assert "\x1b" not in result.err and "\x07" not in result.err
    assert "[/bold]xy[red]" in result.err


# ---- standalone `train FILE`: the workspace's recipe schema, the same wording -------------


def test_train_file_refuses_an_unknown_key_as_a_workspace_spec_does(cli, workspace, tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text("grpo:\n  stesp: 3\n")
    result = cli("train", str(recipe), "--out", str(tmp_path / "run1"))
    assert result.code == 1 and result.err.count("\n") == 1, result.output
    assert f"{recipe}:2:3: grpo.stesp: unknown key 'stesp'" in result.err
    assert "did you mean 'steps'?" in result.err
    assert not (tmp_path / "run1").exists()  # refused before any work
    # Inside a workspace the same typo, in the project's recipe, reads the same.
    project = workspace.root / "spec" / "project.yaml"
    text = project.read_text()
    assert "\n  grpo:\n" in text
    project.write_text(text.replace("\n  grpo:\n", "\n  grpo:\n    stesp: 3\n", 1))
    checked = cli("validate", cwd=workspace.root)
    assert checked.code == 1 and "recipe.grpo.stesp: unknown key 'stesp'" in checked.output
    assert "did you mean 'steps'?" in checked.output


def test_every_example_recipe_is_a_valid_train_file(tmp_path):
    from evotrainer.commands.train import load_recipe
    from evotrainer.control.scaffold import EXAMPLES_DIR, examples

    for name in examples():
        recipe = yaml.safe_load((EXAMPLES_DIR / f"{name}.yaml").read_text())["recipe"]
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        resolved = load_recipe(path)
        assert resolved["domain"]["name"] == recipe["domain"]["name"]


def test_compare_with_missing_files_names_the_file_not_a_branch(cli, tmp_path):
    for missing in ("A.csv", str(tmp_path / "runs" / "scores.parquet"), "some/run/folder"):
        result = cli("compare", missing, "B.csv", cwd=tmp_path)  # outside any workspace
        assert result.code == 1 and result.err.count("\n") == 1, result.output
        assert f"error: {missing}: no such file" in result.err
        assert "branch" not in result.err and "git" not in result.err


def test_export_help_says_it_exports_a_policy_to_a_folder(cli):
    out = cli("export", "--help").out
    assert "export V --to DIR" in out and "Hugging Face directory" in out
    assert "Export a trained policy to a folder" in cli("--help").out


# ---- start-up: a command imports what it needs, nothing more --------------------------------

HEAVY = ("torch", "transformers", "duckdb", "pyarrow", "scipy", "numpy", "git", "jsonschema",
         "celpy", "jinja2", "pandas")


def _heavy_modules_after(*argv: str, among: tuple[str, ...] = HEAVY) -> list[str]:
    """The modules of `among` (by default the top-level heavy packages) imported by
    `evotrainer ARGV` (or by importing the CLI alone when ARGV is empty), in a fresh
    interpreter."""
    code = (
        "import sys\n"
        f"sys.argv = ['evotrainer', *{list(argv)!r}]\n"
        "from evotrainer.cli import main\n"
        "if sys.argv[1:]:\n"
        "    try:\n"
        "        main()\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted(m for m in {among!r} if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, "COLUMNS": "200"})
    return ast.literal_eval(done.stderr.strip().splitlines()[-1])


def test_importing_the_cli_version_and_help_import_no_heavy_package():
    assert _heavy_modules_after() == []
    assert _heavy_modules_after("--version") == []
    assert _heavy_modules_after("--help") == []


# What checking specs never runs: the reconcile loop, a diagnosis, the analyzer sandbox, and
# (for revisions that declare no analyzer, as the built-in ones) numpy and pyarrow: the
# analyzers' code, the rollout table's types and the paired statistics; nor, for the
# built-in revisions' text, DuckDB, which parses a revision's SQL.
NOT_FOR_CHECKS = ("evotrainer.control.reconcile", "evotrainer.diagnosis.diagnose",
                  "evotrainer.diagnosis.declared", "evotrainer.sandbox.process",
                  "numpy", "pyarrow", "duckdb")
CHECKS_REVISIONS = "evotrainer.diagnosis.harness"


def test_validate_and_plan_import_no_diagnosis_and_no_reconcile_loop(workspace):
    # The workspace holds the built-in revisions, and both commands check them.
    for command in ("validate", "plan"):
        assert _heavy_modules_after("-C", str(workspace.root), command,
                                    among=(*NOT_FOR_CHECKS, CHECKS_REVISIONS)) == [
            CHECKS_REVISIONS], command


def test_the_listing_shows_each_commands_own_help(cli):
    """`--help` reads each command's help from its source without importing it: it must be
    the help the command itself shows once imported."""
    from evotrainer.cli import _command_modules, declared_help, load_command

    for name in _command_modules():
        assert declared_help(name) == (load_command(name).help or ""), name
    listing = cli("--help").out
    assert all(f"│ {name} " in listing for name in _command_modules())
