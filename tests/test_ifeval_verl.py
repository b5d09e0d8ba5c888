"""The ifeval domain on verl: the ifeval-smollm2 example's recipe with a larger model renders,
composes with verl 0.9.1's own Hydra config, and verl's reward function (our reward module,
as verl calls it on the prepared parquet's rows) scores with the same IFEval checkers as the
embedded engine.

Real: the example file, the render, verl's config YAML, `prepare` (the parquet verl reads),
the reward module."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytest.importorskip("if_verifiable", reason="needs if-verifiable (the dev extra)")

from evotrainer.backends.base import JobSpec, job_id  # noqa: E402
from evotrainer.backends.verl import prepare  # noqa: E402
from evotrainer.backends.verl_render import JobFiles, render_job  # noqa: E402
from evotrainer.backends.verl_reward import compute_score  # noqa: E402
from evotrainer.control.scaffold import EXAMPLES_DIR  # noqa: E402
from evotrainer.domains import make_domain  # noqa: E402
from evotrainer.domains.base import Task  # noqa: E402
from evotrainer.store.recipe import deep_merge, digest, resolve  # noqa: E402
from evotrainer.store.specs import load_yaml  # noqa: E402


def verl_recipe() -> dict:
    """The example as a GPU user runs it: verl, a larger instruct model, more prompts."""
    source = EXAMPLES_DIR / "ifeval-smollm2.yaml"
    recipe = load_yaml(source.read_bytes(), str(source))["recipe"]
    recipe = deep_merge(recipe, {
        "backend": "verl",
        "model": {"package": None, "path": "/models/Qwen2.5-1.5B-Instruct", "lora": None,
                  "dtype": None},
        "grpo": {"prompts_per_step": 8, "max_response_tokens": 512},
        "rollout": None,
        "verl": {"n_gpus_per_node": 1, "nnodes": 1},
    })
    return resolve(recipe, [])


def test_verls_reward_scores_ifeval_rows_with_the_same_checkers(tmp_path, monkeypatch):
    workdir = tmp_path / "worktree"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    recipe = deep_merge(verl_recipe(), {"domain": {"train_size": 16, "val_size": 4}})
    job = JobSpec(job_id("v1", 1, digest(recipe)), "v1", recipe, workdir, tmp_path / "art", {})
    prepare(job)
    files = JobFiles(job.artifact_dir)
    train = pq.read_table(files.train_file).to_pylist()
    val = pq.read_table(files.val_file).to_pylist()
    assert len(train) == 16 and len(val) == 4
    assert all(r["data_source"].startswith("ifeval/") for r in train + val)
    held = {json.loads(r["extra_info"]["meta"])["split"] for r in val}
    assert held == {"heldout"}  # verl validates on base tasks training never sees
    domain = make_domain(recipe["domain"])
    for row in train[:6] + val:
        answer = json.loads(row["reward_model"]["ground_truth"])
        # A response that meets one lowercase, comma-free constraint set and fails others.
        response = "a short calm answer with no capitals at all"
        scored = compute_score(row["data_source"], response, row["reward_model"]["ground_truth"],
                               extra_info=row["extra_info"], config_path=str(files.reward_config))
        task = Task(row["extra_info"]["task_id"], row["prompt"][0]["content"],
                    row["reward_model"]["ground_truth"], row["data_source"])
        engine = domain.score(task, response, [])
        assert scored["correctness"] == engine.components["correctness"]
        assert scored["partial"] == engine.components["partial"]
        assert scored["score"] == pytest.approx(
            engine.components["correctness"] + 0.5 * engine.components["partial"])
        assert scored["task_id"] == row["extra_info"]["task_id"]
        assert len(answer["instructions"]) >= 1


def test_the_example_renders_and_composes_with_verls_config(tmp_path):
    pytest.importorskip("hydra", reason="needs hydra-core and omegaconf (the verl extra)")
    verl = importlib.util.find_spec("verl")
    if verl is None:
        pytest.skip("needs `pip install --no-deps verl==0.9.1`")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    recipe = verl_recipe()
    (run,) = render_job(recipe, version="v1", files=JobFiles(tmp_path / "art"),
                        workdir=tmp_path / "wt")
    config_dir = str(Path(verl.submodule_search_locations[0]) / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=[o.hydra() for o in run.overrides])
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    assert cfg.algorithm.adv_estimator == "grpo"
    assert rollout.n == 4 and rollout.response_length == 512
    assert rollout.val_kwargs.temperature == 0.5  # the example's fixed eval temperature
    assert cfg.actor_rollout_ref.actor.optim.lr == 3.0e-4
    assert cfg.reward.custom_reward_function.name == "compute_score"
    assert cfg.reward.custom_reward_function.reward_kwargs.config_path.endswith(
        "reward_config.json")
