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
from sealing import controller_commit

from evotrainer.backends.local import LocalBackend
from evotrainer.control.policy_export import export_policy
from evotrainer.control.reconcile import record_text
from evotrainer.control.retention import apply_gc, plan_gc
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import new_version
from evotrainer.engine import run_job
from evotrainer.engine.model import load_checkpoint, save_checkpoint
from evotrainer.errors import EvoError
from evotrainer.store.checkpoints import checkpoint_record, recorded_policy
from evotrainer.store.git import branch_name
from evotrainer.store.recipe import resolve
from evotrainer.store.workspace import Workspace, run_path

torch.set_num_threads(1)


class ShardedBackend(LocalBackend):
    """A backend that keeps folders of weights of its own (as verl keeps its FSDP shards)."""

    weight_folders = ("verl/seed*/checkpoints",)


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
                    "comparison": {"delta": 0.1, "ci_low": 0.02, "ci_high": 0.18,
                                   "confidence": 0.95}}
        files[run_path(name, "decision.yaml")] = yaml.safe_dump(decision).encode()
    controller_commit(ws, name, files, f"record {name}")
    if verdict in ("promote", "baseline"):
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
    """v2's run.yaml names a victim folder outside the artifact root as its checkpoint. gc
    refuses even a record that verifies (sealed here); the victim survives."""
    ws, policies = lineage
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    _tamper(ws, "v2", lambda run: run["artifacts"]["checkpoint"].update(path=str(victim)))
    with pytest.raises(EvoError) as err:
        drops, _ = plan_gc(ws)
        apply_gc(ws, drops, "keep-promoted-and-open")
    assert err.value.field == "artifacts.checkpoint.path"
    assert (victim / "precious.txt").read_text() == "keep me"
    shutil.rmtree(victim)


# ---- gc reaches only the dropped version's own folder --------------------


def _tamper(ws: Workspace, name: str, change, sealed: bool = True) -> None:
    """Commit an edited run.yaml onto `name`'s branch. Sealed (as if the controller had
    written it): gc's own checks must hold whatever a record that verifies says. Unsealed:
    as a branch author commits it."""
    branch, path = branch_name(name), run_path(name, "run.yaml")
    run = yaml.safe_load(ws.git.read(branch, path))
    change(run)
    if sealed:
        controller_commit(ws, name, {path: yaml.safe_dump(run).encode()}, "tamper")
    else:
        ws.git.commit_files(branch, {path: yaml.safe_dump(run).encode()}, "tamper", {})


@pytest.mark.parametrize("sealed", [True, False])
def test_a_pruned_record_naming_the_promoted_job_cannot_make_gc_delete_its_weights(
    lineage, cli, sealed
):
    """The attack: on pruned v2's branch, `job_id: ../v1/<v1's job>` and v1's checkpoint
    path. Before, the path resolved inside the artifact root, so gc deleted v1's policy and
    `export v1` failed. Sealed or not (a forged record is read by no one), v1 keeps it."""
    ws, policies = lineage
    v1_run = ws.version("v1").records["run"]

    def point_at_v1(run: dict) -> None:
        run["job_id"] = f"../v1/{v1_run['job_id']}"
        run["artifact_dir"] = v1_run["artifact_dir"]
        run["artifacts"]["checkpoint"] = dict(v1_run["artifacts"]["checkpoint"])

    _tamper(ws, "v2", point_at_v1, sealed)
    result = cli("-C", str(ws.root), "gc")
    assert result.code == 0 and "Traceback" not in result.output
    assert "keep v2: its records are refused" in result.out
    assert ("job_id '../v1/" if sealed else "forged records") in result.out
    assert (policies["v1"] / "model.safetensors").read_bytes() == b"w1" * 1000
    result = cli("-C", str(ws.root), "export", "v1", "--to", str(ws.root.parent / "v1-out"))
    assert result.code == 0, result.output
    assert (ws.root.parent / "v1-out" / "model.safetensors").read_bytes() == b"w1" * 1000


@pytest.mark.parametrize("job_id", ["../v1/evo-v1-a1-0000000000", "a/b", "..", ".", ""])
def test_gc_and_export_accept_only_a_job_folder_of_the_version_itself(lineage, job_id):
    """Whatever a record holds (the record reader's own job-id check aside), the folder gc
    deletes and export reads is one plain folder under the version's own."""
    ws, policies = lineage
    run = dict(ws.version("v2").records["run"], job_id=job_id)
    if job_id.startswith("../v1/"):
        run["artifacts"] = ws.version("v1").records["run"]["artifacts"]
    with pytest.raises(EvoError) as err:
        recorded_policy(ws, "v2", run)
    assert err.value.field == "job_id" and "own artifact folder" in err.value.message
    assert policies["v1"].is_dir() and policies["v2"].is_dir()


def test_a_link_in_a_dropped_runs_folder_leads_gc_nowhere(lineage, tmp_path):
    """The attack: the pruned run's folder holds `verl -> /outside` and
    `checkpoint-seed1 -> /outside/seed0/checkpoints`. Before, the glob walked through the
    link and gc deleted /outside/seed0/checkpoints. Now only v2's own weights go; links stay
    links, and whatever they point at stays."""
    ws, policies = lineage
    outside = tmp_path / "outside"
    (outside / "seed0" / "checkpoints").mkdir(parents=True)
    (outside / "seed0" / "checkpoints" / "precious.bin").write_bytes(b"keep me")
    run_dir = policies["v2"].parent
    (run_dir / "verl").symlink_to(outside)
    (run_dir / "checkpoint-seed1").symlink_to(outside / "seed0" / "checkpoints")
    (run_dir / "checkpoint-seed2").mkdir()  # a real second-seed checkpoint: it goes
    (run_dir / "checkpoint-seed2" / "model.safetensors").write_bytes(b"s2")

    drops, _ = plan_gc(ws, backends={"local": ShardedBackend()})
    assert [d.version for d in drops] == ["v2"]
    assert drops[0].folders == [policies["v2"], run_dir / "checkpoint-seed2"]
    apply_gc(ws, drops, "keep-promoted-and-open")
    assert (outside / "seed0" / "checkpoints" / "precious.bin").read_bytes() == b"keep me"
    assert (run_dir / "verl").is_symlink() and (run_dir / "checkpoint-seed1").is_symlink()
    assert not policies["v2"].exists() and not (run_dir / "checkpoint-seed2").exists()


def test_gc_drops_the_folders_of_weights_the_runs_backend_names(lineage):
    """Beside the recorded policy, a dropped run loses the folders of weights its backend
    names (`Backend.weight_folders`), and only those: a backend that names none leaves them."""
    ws, policies = lineage
    run_dir = policies["v2"].parent
    shards = run_dir / "verl" / "seed0" / "checkpoints"
    shards.mkdir(parents=True)
    (shards / "model_world_size_1_rank_0.pt").write_bytes(b"shard")
    assert plan_gc(ws)[0][0].folders == [policies["v2"]]  # the local backend names none
    drops, _ = plan_gc(ws, backends={"local": ShardedBackend()})
    assert drops[0].folders == [policies["v2"], shards]
    apply_gc(ws, drops, "keep-promoted-and-open")
    assert not shards.exists() and (run_dir / "verl" / "seed0").is_dir()


def test_a_folder_swapped_for_a_link_after_planning_is_not_deleted(lineage, tmp_path):
    ws, policies = lineage
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.bin").write_bytes(b"keep me")
    drops, _ = plan_gc(ws)
    shutil.rmtree(policies["v2"])
    policies["v2"].symlink_to(victim)  # between plan and delete
    with pytest.raises(EvoError) as err:
        apply_gc(ws, drops, "keep-promoted-and-open")
    assert "changed since gc planned" in err.value.message
    assert (victim / "precious.bin").read_bytes() == b"keep me"


def test_a_linked_version_folder_is_refused(lineage, tmp_path):
    """<artifact root>/v2 replaced by a link to v1's folder (v2's record, well-formed and
    sealed, unchanged): it now resolves into v1's weights, which are not v2's own folder."""
    ws, policies = lineage
    v1_job = ws.version("v1").records["run"]["job_id"]
    v2_job = ws.version("v2").records["run"]["job_id"]
    v2_dir = ws.artifact_root / "v2"
    shutil.rmtree(v2_dir)
    fake = tmp_path / "fake-v2"
    fake.mkdir()
    (fake / v2_job).symlink_to(ws.artifact_root / "v1" / v1_job)
    v2_dir.symlink_to(fake)
    with pytest.raises(EvoError) as err:
        plan_gc(ws)
    assert err.value.field == "job_id"
    assert (policies["v1"] / "model.safetensors").read_bytes() == b"w1" * 1000


# ---- gc keeps the promoted path, the baseline included -------------------


@pytest.fixture
def baseline_only(tmp_path) -> tuple[Workspace, dict[str, Path]]:
    """v0 trained and gated `baseline` (merged into main, as reconcile does); v1 pruned."""
    ws = Workspace(init_workspace(tmp_path / "ws", "arith"))
    new_version(ws, "v1", "v0", rationale="pruned")
    policies = {
        "v0": _record(ws, "v0", "baseline", b"w0" * 1000),
        "v1": _record(ws, "v1", "prune", b"w1" * 1000),
    }
    return ws, policies


@pytest.mark.parametrize("policy", ["keep-promoted-and-open", "keep-frontier-and-open"])
def test_gc_keeps_the_baseline_on_main_and_export_main_still_works(baseline_only, cli, policy):
    ws, policies = baseline_only
    project = ws.root / "spec" / "project.yaml"
    project.write_text(project.read_text() + f"retention: {{checkpoints: {policy}}}\n")
    result = cli("-C", str(ws.root), "gc", "--dry-run")
    assert result.code == 0, result.output
    assert "keep v0: main's frontier (baseline)" in result.out
    assert "drop v0" not in result.out and "drop v1: prune" in result.out
    result = cli("-C", str(ws.root), "gc")
    assert result.code == 0, result.output
    assert policies["v0"].is_dir() and not policies["v1"].exists()
    target = ws.root.parent / "main-out"
    result = cli("-C", str(ws.root), "export", "main", "--to", str(target))
    assert result.code == 0, result.output
    assert (target / "model.safetensors").read_bytes() == b"w0" * 1000


def test_once_a_promotion_supersedes_the_baseline_only_frontier_retention_drops_it(
    baseline_only,
):
    ws, policies = baseline_only
    new_version(ws, "v2", "v0", rationale="promoted")
    policies["v2"] = _record(ws, "v2", "promote", b"w2" * 1000)
    drops, kept = plan_gc(ws)
    assert kept["v0"] == "on main (baseline)" and kept["v2"] == "main's frontier (promote)"
    assert [d.version for d in drops] == ["v1"]
    project = ws.root / "spec" / "project.yaml"
    project.write_text(project.read_text() + "retention: {checkpoints: keep-frontier-and-open}\n")
    drops, kept = plan_gc(Workspace(ws.root))
    assert [(d.version, d.reason) for d in drops] == [("v0", "superseded by v2"), ("v1", "prune")]
    assert kept == {"v2": "main's frontier (promote)"}


def test_a_decided_promotion_not_yet_merged_keeps_its_weights(lineage):
    ws, policies = lineage
    new_version(ws, "v4", "v1", rationale="promoted, merge pending")
    policies["v4"] = _record(ws, "v4", None, b"w4" * 1000)
    decision = {"verdict": "promote", "reason": "test", "decided_at": "2026-01-09",
                "comparison": {"delta": 0.1, "ci_low": 0.02, "ci_high": 0.18}}
    controller_commit(ws, "v4", {run_path("v4", "decision.yaml"):
                                 yaml.safe_dump(decision).encode()}, "gate")
    drops, kept = plan_gc(ws)
    assert kept["v4"] == "promote, not yet merged into main"
    assert "v4" not in [d.version for d in drops]
