"""The paper's configurations: paper-math, paper-code and paper-swe validate as
`init` checks an example, render, compose with verl 0.9.1's own Hydra config (and, where verl's
import chain is installed, pass its dataclasses and validate_config), carry the paper's
protocol into the keys verl reads, and take the converters' data with its strata.

Real: the example files, the recipe resolution init uses, the render, verl's config YAML,
`prepare` (the parquet verl reads), the converters."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from evotrainer.backends.base import JobSpec, job_id
from evotrainer.backends.verl import prepare
from evotrainer.backends.verl_render import JobFiles, render_job
from evotrainer.control.scaffold import EXAMPLES_DIR, missing_requirements
from evotrainer.domains.data.convert import convert_file, write_rows
from evotrainer.store.recipe import deep_merge, digest, resolve
from evotrainer.store.specs import load_yaml

pytest.importorskip("hydra", reason="needs hydra-core and omegaconf (the verl extra)")
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

_VERL = importlib.util.find_spec("verl")
if _VERL is None:
    pytest.skip("needs `pip install --no-deps verl==0.9.1`", allow_module_level=True)
CONFIG_DIR = str(Path(_VERL.submodule_search_locations[0]) / "trainer" / "config")
PAPER = ("paper-math", "paper-code", "paper-swe")
SAMPLES = Path(__file__).parent / "data" / "paper_formats"


def example_recipe(name: str) -> dict:
    source = EXAMPLES_DIR / f"{name}.yaml"
    return resolve(load_yaml(source.read_bytes(), str(source))["recipe"], [])


def composed(recipe: dict, tmp_path: Path):
    (run,) = render_job(recipe, version="v1", files=JobFiles(tmp_path / "art"),
                        workdir=tmp_path / "wt")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose("ppo_trainer", overrides=[o.hydra() for o in run.overrides])
    OmegaConf.resolve(cfg)
    return cfg


@pytest.mark.parametrize("name", PAPER)
def test_paper_example_carries_the_protocol_into_verls_config(name, tmp_path):
    assert missing_requirements(name) == []  # what init and validate check
    cfg = composed(example_recipe(name), tmp_path)
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    # Seed 42 everywhere verl takes a seed.
    assert cfg.data.seed == rollout.seed == actor.data_loader_seed == 42
    # Avg@8: 8 samples per validation task at temperature 1.0, top_p 0.99, top_k 100.
    val = rollout.val_kwargs
    assert (val.n, val.do_sample, val.temperature, val.top_p, val.top_k) == (
        8, True, 1.0, 0.99, 100)
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.27)
    assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == (
        True, 0.001, "low_var_kl")
    assert cfg.algorithm.use_kl_in_reward is False
    assert actor.loss_agg_mode == "seq-mean-token-mean"
    assert cfg.data.max_response_length == rollout.response_length == 20480
    assert cfg.trainer.test_freq == 25 and cfg.trainer.total_training_steps == 1000
    assert actor.optim.lr == 1e-6
    assert rollout.n == (8 if name == "paper-swe" else 4)
    assert cfg.data.max_prompt_length == {"paper-math": 1024, "paper-code": 4096,
                                          "paper-swe": 2048}[name]
    assert cfg.data.filter_overlong_prompts is True  # too long is dropped, never cut
    multi = rollout.multi_turn
    if name == "paper-swe":
        assert (multi.enable, multi.max_assistant_turns, multi.format) == (True, 100, "hermes")
        assert multi.tool_config_path.endswith("art/verl/tools.yaml")
        # The domain's 2,000-character observations reach the model whole (verl's default
        # would cut them at 256).
        assert multi.max_tool_response_length == 2000 + 64
    else:
        assert multi.enable is False


@pytest.mark.parametrize("name", PAPER)
def test_paper_example_passes_verls_own_checks(name, tmp_path):
    config = pytest.importorskip(
        "verl.utils.config",
        reason="verl's import chain (torch, ray, tensordict, codetiming, transformers) is not "
        "installed; see verl.md §1",
        exc_type=ImportError,
    )
    from verl.trainer.config import AlgoConfig
    from verl.workers.config import RolloutConfig

    cfg = composed(example_recipe(name), tmp_path)
    assert config.omega_conf_to_dataclass(cfg.algorithm, AlgoConfig).adv_estimator == "grpo"
    config.omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, RolloutConfig)
    config.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    config.validate_config(cfg, use_reference_policy=True, use_critic=False)


def test_paper_math_on_converted_benchmarks_keeps_each_one_a_stratum(tmp_path, monkeypatch):
    """The docs' path: convert AIME24 and CNMO24, point paper-math at them, and verl's
    validation parquet holds each benchmark as its own data_source."""
    workdir = tmp_path / "worktree"
    monkeypatch.chdir(workdir.parent)
    data = Path("data")
    write_rows(convert_file("aime", SAMPLES / "aime24.jsonl").rows, data / "train.jsonl")
    val_rows = (convert_file("aime", SAMPLES / "aime24.jsonl").rows
                + convert_file("aime", SAMPLES / "cnmo24.jsonl").rows)
    write_rows(val_rows, data / "val.jsonl")
    recipe = deep_merge(example_recipe("paper-math"), {
        "domain": {"data": {"train": "data/train.jsonl", "val": "data/val.jsonl"},
                   "train_size": 3, "val_size": 5},
        "grpo": {"prompts_per_step": 2},
        "verl": {"n_gpus_per_node": 8, "nnodes": 1},
    })
    job = JobSpec(job_id("v1", 1, digest(recipe)), "v1", recipe, workdir,
                  tmp_path / "art", {})
    prepare(job)
    val = pq.read_table(JobFiles(job.artifact_dir).val_file).to_pylist()
    assert sorted(r["data_source"] for r in val) == ["aime24"] * 3 + ["cnmo24"] * 2
    assert {r["extra_info"]["task_id"] for r in val} >= {"math:cnmo24-1", "math:2024-I-1"}
    config = json.loads(JobFiles(job.artifact_dir).reward_config.read_text())
    assert config["group_filter"] == {"name": "none", "params": {}}


def test_paper_swe_on_converted_swe_rebench_instances(tmp_path, monkeypatch):
    """The docs' path for SWE: convert SWE-rebench rows with local mirrors (the shipped
    sample), switch paper-swe to the swe_rebench domain, and verl gets the instances, the
    same four tools and the domain config its reward and tool workers build from."""
    from evotrainer.domains.data import sample_path

    workdir = tmp_path / "worktree"
    monkeypatch.chdir(workdir.parent)
    rows = convert_file("swe_rebench", sample_path("swe_rebench_sample.jsonl"),
                        repos=sample_path("swe_rebench_repos")).rows
    write_rows(rows[:1], Path("data/train.jsonl"))
    write_rows(rows[1:], Path("data/val.jsonl"))
    recipe = deep_merge(example_recipe("paper-swe"), {
        "domain": {"name": "swe_rebench", "train_size": 1, "val_size": 1,
                   "data": {"train": "data/train.jsonl", "val": "data/val.jsonl"}},
        "grpo": {"prompts_per_step": 1},
        "verl": {"n_gpus_per_node": 8, "nnodes": 1},
    })
    job = JobSpec(job_id("v1", 1, digest(recipe)), "v1", recipe, workdir,
                  tmp_path / "art", {})
    prepare(job)
    val = pq.read_table(JobFiles(job.artifact_dir).val_file).to_pylist()
    assert [r["extra_info"]["task_id"] for r in val] == ["swe_rebench:tinystats__tinystats-2"]
    cfg = composed(recipe, tmp_path / "render")
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable is True
    tool_file = JobFiles(job.artifact_dir).tool_config
    tools = load_yaml(tool_file.read_bytes(), str(tool_file))["tools"]
    assert [t["tool_schema"]["function"]["name"] for t in tools] == [
        "shell", "write", "patch", "submit"]
    assert tools[0]["config"]["domain"]["name"] == "swe_rebench"
