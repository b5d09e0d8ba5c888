"""A job reads its model only from its own folders, and its caches are keyed by content:
a link committed on a version branch in place of `models/m` (or of
one weight file) cannot load a model from elsewhere, and a warm start trained on poisoned
demonstrations never seeds a later job whose data differs behind the same path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from real_checkpoint import save_hf

from evotrainer.domains.data import DATA_ROOTS_ENV
from evotrainer.engine import run_job
from evotrainer.engine.model import initial_model, model_digest
from evotrainer.errors import EvoError
from evotrainer.store.recipe import resolve

torch.set_num_threads(1)


@pytest.fixture
def worktree(tmp_path, monkeypatch) -> Path:
    """The job's working directory (a version's worktree, as the local backend starts it),
    with no data root declared."""
    root = tmp_path / "worktree"
    root.mkdir()
    monkeypatch.chdir(root)
    monkeypatch.delenv(DATA_ROOTS_ENV, raising=False)
    return root


def test_a_model_path_linked_outside_the_worktree_is_refused(worktree, tmp_path, monkeypatch):
    outside = save_hf(tmp_path / "outside" / "model")
    (worktree / "models").mkdir()
    (worktree / "models" / "m").symlink_to(outside)  # committed on the branch as a link
    with pytest.raises(EvoError) as err:
        initial_model({"path": "models/m"}, 0)
    assert err.value.field == "model.path"
    assert "outside the job's workspace" in err.value.message
    assert str(outside) in err.value.message
    with pytest.raises(EvoError):  # the key of the warm-start cache reads it the same way
        model_digest({"path": "models/m"})
    # A declared data root makes the same link legitimate.
    monkeypatch.setenv(DATA_ROOTS_ENV, str(outside.parent))
    model, tokenizer = initial_model({"path": "models/m"}, 0)
    assert tokenizer.eos_token == "<|im_end|>"


def test_one_weight_file_linked_outside_is_refused(worktree, tmp_path):
    model = save_hf(worktree / "models" / "m")
    elsewhere = tmp_path / "elsewhere.safetensors"
    (model / "model.safetensors").rename(elsewhere)
    (model / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(EvoError) as err:
        initial_model({"path": "models/m"}, 0)
    assert "model file" in err.value.message and err.value.field == "model.path"

    # A hub snapshot's links to blobs in the same tree are fine.
    blobs = worktree / "blobs"
    blobs.mkdir()
    (model / "model.safetensors").unlink()
    elsewhere.rename(blobs / "abc123")
    (model / "model.safetensors").symlink_to(blobs / "abc123")
    initial_model({"path": "models/m"}, 0)
    assert model_digest({"path": "models/m"}).startswith("sha256:")


def test_a_directory_link_inside_a_checkpoint_is_refused(worktree, tmp_path):
    model = save_hf(worktree / "models" / "m")
    (tmp_path / "outside").mkdir()
    (model / "extra").symlink_to(tmp_path / "outside")
    with pytest.raises(EvoError, match="link to a directory"):
        initial_model({"path": "models/m"}, 0)


def test_the_model_digest_follows_content_not_the_path(worktree):
    first = model_digest({"path": str(save_hf(worktree / "m", seed=0))})
    assert model_digest({"path": "m"}) == first
    save_hf(worktree / "m", seed=1)  # other weights behind the same path
    assert model_digest({"path": "m"}) != first


# ---- the warm-start cache -------------------------------------------------------------------


def _problems(answer_of) -> str:
    rows = []
    for i in range(12):
        answer = answer_of(i)
        rows.append({"id": f"p{i}", "problem": f"What is {i} + {i}?", "answer": answer,
                     "solution": f"The answer is $\\boxed{{{answer}}}$."})
    return "".join(json.dumps(row) + "\n" for row in rows)


def _recipe() -> dict:
    return resolve({
        "model": {
            "tiny": {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1,
                     "num_heads": 2, "num_kv_heads": 2},
            "warm_start": {"steps": 1, "batch_size": 4},
        },
        "domain": {"name": "math", "train_size": 8, "val_size": 2,
                   "data": {"train": "data/train.jsonl"}},
        "grpo": {"group_size": 2, "prompts_per_step": 2, "steps": 0, "eval_k": 1,
                 "max_response_tokens": 8},
    }, [])


def test_a_poisoned_warm_start_never_seeds_a_job_on_clean_data(worktree, tmp_path):
    """The attack: a job warm-starts on demonstrations whose every answer is 666; the data is
    then cleaned behind the same path. Before, the cache key held only the path's text and
    the settings, so the clean job loaded the poisoned weights ("cached": true)."""
    (worktree / "data").mkdir()
    train = worktree / "data" / "train.jsonl"
    cache = tmp_path / "cache"
    train.write_text(_problems(lambda i: "666"))
    poisoned = run_job(_recipe(), tmp_path / "poisoned", "v1", cache_dir=cache)
    assert poisoned["warm_start"]["0"]["cached"] is False

    train.write_text(_problems(lambda i: str(2 * i)))
    clean = run_job(_recipe(), tmp_path / "clean", "v2", cache_dir=cache)
    assert clean["warm_start"]["0"]["cached"] is False
    assert clean["warm_start"]["0"]["key"] != poisoned["warm_start"]["0"]["key"]
    assert len(os.listdir(cache)) == 2  # one entry per content

    again = run_job(_recipe(), tmp_path / "again", "v3", cache_dir=cache)
    assert again["warm_start"]["0"]["cached"] is True  # same content: shared as before
    assert again["warm_start"]["0"]["key"] == clean["warm_start"]["0"]["key"]
