"""The trained policy as a product: a job continues from its parent's recorded policy (and
only from exactly those weights), export writes it as an HF directory with a model card, and
gc drops what the retention policy no longer keeps, recording the drop."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from evotrainer.commands.init import init_workspace
from evotrainer.control.policy_export import export_policy
from evotrainer.control.reconcile import record_text
from evotrainer.control.retention import apply_gc, plan_gc
from evotrainer.control.versions import new_version
from evotrainer.engine import run_job
from evotrainer.engine.model import load_checkpoint, save_checkpoint
from evotrainer.errors import EvoError
from evotrainer.store.checkpoints import checkpoint_record
from evotrainer.store.git import branch_name
from evotrainer.store.recipe import resolve
from evotrainer.store.workspace import Workspace, run_path

torch.set_num_threads(1)

TINY = {
    "model": {
        "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                 "num_heads": 2, "num_kv_heads": 2},
        "warm_start": {"steps": 5, "batch_size": 8},
    },
    "domain": {"train_size": 16, "val_size": 4},
    "grpo": {"group_size": 2, "prompts_per_step": 2, "steps": 1, "eval_k": 1, "lr": 1.0e-3},
}


@pytest.mark.slow
def test_a_child_starts_from_exactly_its_parents_recorded_weights(tmp_path):
    parent = run_job(resolve(TINY, []), tmp_path / "parent", "v1")
    assert parent["status"] == "ok"
    policy = tmp_path / "parent" / "checkpoint"
    record = checkpoint_record(policy, str(policy))
    start = {"path": str(policy), "digest": record["digest"]}
    child_recipe = resolve(TINY, [{"model": {"init": "parent", "init_checkpoint": start},
                                   "grpo": {"steps": 0}}])
    child = run_job(child_recipe, tmp_path / "child", "v2")
    # No warm start, and an evaluation-only child saves the very weights it loaded.
    assert child["warm_start"]["0"] == {"steps": 0, "cached": False,
                                        "continued_from": record["digest"]}
    before = load_file(policy / "model.safetensors")
    after = load_file(tmp_path / "child" / "checkpoint" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)

    # Swapped weights under the recorded path: the child refuses to start from them.
    tensors = dict(before)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    from safetensors.torch import save_file

    save_file(tensors, policy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EvoError) as err:
        run_job(child_recipe, tmp_path / "child2", "v2")
    assert "changed since it was recorded" in err.value.message
    assert not (tmp_path / "child2" / "checkpoint").exists()

    no_start = resolve(TINY, [{"model": {"init": "parent"}}])
    with pytest.raises(EvoError) as err:
        run_job(no_start, tmp_path / "child3", "v2")
    assert err.value.field == "recipe.model.init"


def test_a_saved_policy_keeps_its_tokenizer_and_chat_template(tmp_path):
    from real_checkpoint import chat_tokenizer, tiny_llama

    tokenizer = chat_tokenizer()
    save_checkpoint(tiny_llama(tokenizer), tokenizer, tmp_path / "checkpoint")
    model, loaded = load_checkpoint(tmp_path / "checkpoint")
    assert loaded.chat_template == tokenizer.chat_template
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False)
    assert loaded.eos_token == "<|im_end|>" and model.config.vocab_size == len(tokenizer)


# ---- a workspace with recorded runs (records written as reconcile writes them) ----------


def _record(ws: Workspace, name: str, verdict: str | None, weights: bytes) -> Path:
    job = f"evo-{name}-a1-0000000000"
    artifact_dir = ws.artifact_dir(name, job)
    policy = artifact_dir / "checkpoint"
    policy.mkdir(parents=True)
    (policy / "config.json").write_text('{"model_type": "qwen2"}')
    (policy / "model.safetensors").write_bytes(weights)
    (artifact_dir / "rollouts").mkdir()
    (artifact_dir / "rollouts" / "val.parquet").write_bytes(b"evidence")
    run = {
        "apiVersion": "evotrainer/v1", "kind": "Run", "version": name, "attempt": 1,
        "job_id": job, "backend": "local", "state": "Succeeded", "recipe_digest": "sha256:x",
        "artifact_dir": ws.record_path(artifact_dir),
        "artifacts": {"checkpoint": checkpoint_record(policy, ws.record_path(policy))},
        "result": {"val_avg": 0.5, "steps_done": 3, "eval_k": 2, "seeds": [0]},
    }
    files = {run_path(name, "run.yaml"): record_text("run", run).encode()}
    if verdict:
        decision = {"verdict": verdict, "reason": "test", "decided_at": f"2026-01-0{len(name)}",
                    "comparison": {"delta": 0.1, "ci_low": 0.02, "ci_high": 0.18}}
        files[run_path(name, "decision.yaml")] = yaml.safe_dump(decision).encode()
    ws.git.commit_files(branch_name(name), files, f"record {name}", {})
    if verdict == "promote":
        ws.git.merge_into("main", branch_name(name), f"Promote {name}")
    return policy


@pytest.fixture
def lineage(tmp_path) -> tuple[Workspace, dict[str, Path]]:
    ws = Workspace(init_workspace(tmp_path / "ws", "arith"))
    new_version(ws, "v1", "v0", rationale="promoted")
    new_version(ws, "v2", "v1", rationale="pruned")
    new_version(ws, "v3", "v1", rationale="open")
    policies = {
        "v1": _record(ws, "v1", "promote", b"w1" * 1000),
        "v2": _record(ws, "v2", "prune", b"w2" * 3000),
        "v3": _record(ws, "v3", None, b"w3" * 1000),
    }
    return ws, policies


def test_gc_drops_the_pruned_policy_keeps_promoted_and_open_and_records_it(lineage, cli):
    ws, policies = lineage
    result = cli("-C", str(ws.root), "gc", "--dry-run")
    assert result.code == 0, result.output
    assert "drop v2: prune, 5.9 KiB" in result.out and "would free 5.9 KiB" in result.out
    assert policies["v2"].is_dir()  # a dry run deletes nothing

    result = cli("-C", str(ws.root), "gc")
    assert result.code == 0, result.output
    assert not policies["v2"].exists()
    assert policies["v1"].is_dir() and policies["v3"].is_dir()
    assert (policies["v2"].parent / "rollouts" / "val.parquet").read_bytes() == b"evidence"
    run = ws.version("v2").records["run"]
    checkpoint = run["artifacts"]["checkpoint"]
    assert checkpoint["dropped"]["reason"] == "retention keep-promoted-and-open: prune"
    assert checkpoint["digest"].startswith("sha256:")  # what it was stays recorded
    assert plan_gc(ws)[0] == []  # nothing left to do

    with pytest.raises(EvoError) as err:  # a dropped policy is refused with a clear line
        export_policy(ws, "v2", ws.root.parent / "out")
    assert "dropped by the retention policy" in err.value.message


def test_export_main_writes_the_frontier_policy_with_a_model_card(lineage, cli):
    ws, policies = lineage
    target = ws.root.parent / "exported"
    result = cli("-C", str(ws.root), "export", "main", "--to", str(target))
    assert result.code == 0, result.output
    card_free = {f.name for f in target.iterdir()} - {"README.md"}
    assert card_free == {f.name for f in policies["v1"].iterdir()}
    assert (target / "model.safetensors").read_bytes() == b"w1" * 1000
    card = (target / "README.md").read_text()
    assert "| version | `v1` |" in card and "| lineage | v0 → v1 |" in card
    assert "| verdict | promote |" in card and "| 95% CI of Δ | [0.0200, 0.1800] |" in card
    assert "| Δ vs parent | +0.1000 |" in card
    result = cli("-C", str(ws.root), "export", "v1", "--to", str(target))
    assert result.code != 0 and "not an empty directory" in result.output

    (policies["v3"] / "model.safetensors").write_bytes(b"swapped")
    with pytest.raises(EvoError) as err:
        export_policy(ws, "v3", ws.root.parent / "v3-out")
    assert "changed since it was recorded" in err.value.message
    assert not (ws.root.parent / "v3-out").exists()


def test_a_record_pointing_elsewhere_cannot_make_gc_delete_it(lineage, tmp_path):
    """The attack: a branch edits v2's run.yaml so its checkpoint path names a victim folder
    outside the artifact root. gc refuses; the victim survives."""
    ws, policies = lineage
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    branch, path = branch_name("v2"), run_path("v2", "run.yaml")
    run = yaml.safe_load(ws.git.read(branch, path))
    run["artifacts"]["checkpoint"]["path"] = str(victim)
    ws.git.commit_files(branch, {path: yaml.safe_dump(run).encode()}, "tamper", {})
    with pytest.raises(EvoError) as err:
        drops, _ = plan_gc(ws)
        apply_gc(ws, drops, "keep-promoted-and-open")
    assert err.value.field == "artifacts.checkpoint.path"
    assert (victim / "precious.txt").read_text() == "keep me"
    shutil.rmtree(victim)
