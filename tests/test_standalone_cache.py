"""`evotrainer train RECIPE --out DIR` keeps its warm-start (and converted-model) cache inside
DIR: nothing is written beside it in the current directory. EVOTRAINER_CACHE_DIR (what a
workspace's `local` backend sets to the artifact root's cache) still moves it."""

from __future__ import annotations

import json

import pytest
import torch
import typer
import yaml
from typer.testing import CliRunner

from evotrainer.commands.train import register

torch.set_num_threads(1)

RECIPE = {
    "model": {
        "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                 "num_kv_heads": 2},
        "warm_start": {"steps": 2, "batch_size": 8},
    },
    "domain": {"train_size": 16, "val_size": 2},
    "grpo": {"group_size": 2, "prompts_per_step": 2, "steps": 1, "eval_every": 1, "eval_k": 1},
}


def _train(tmp_path, monkeypatch, out: str) -> None:
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `train` a subcommand
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(RECIPE))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "tiny.yaml", "--out", out])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_standalone_run_writes_only_inside_out(tmp_path, monkeypatch):
    monkeypatch.delenv("EVOTRAINER_CACHE_DIR", raising=False)
    _train(tmp_path, monkeypatch, "run1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run1", "tiny.yaml"]
    cached = [p for p in (tmp_path / "run1" / "cache").rglob("*") if p.is_file()]
    assert cached, "the warm start was not cached under run1/cache"
    # A second run elsewhere starts its own cache: it reads nothing from run1's.
    _train(tmp_path, monkeypatch, "run2")
    result = json.loads((tmp_path / "run2" / "result.json").read_text())
    assert result["warm_start"]["0"]["cached"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run1", "run2", "tiny.yaml"]


@pytest.mark.slow
def test_the_cache_variable_moves_the_cache(tmp_path, monkeypatch):
    shared = tmp_path / "shared-cache"
    monkeypatch.setenv("EVOTRAINER_CACHE_DIR", str(shared))
    _train(tmp_path, monkeypatch, "run1")
    assert not (tmp_path / "run1" / "cache").exists()
    assert any(p.is_file() for p in shared.rglob("*"))
    _train(tmp_path, monkeypatch, "run2")
    result = json.loads((tmp_path / "run2" / "result.json").read_text())
    assert result["warm_start"]["0"]["cached"] is True
