"""The command line's own surface: --version, one-line usage errors, help labels, and error
text that cannot inject Rich markup or terminal escapes."""

from __future__ import annotations

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
    for args, text in [(("diagnose", "--jsn"), "No such option: --jsn"),
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
