"""The verl render against verl 0.9.1's own Hydra config (real: the installed wheel's YAML and,
where its import chain is installed, its dataclasses and validate_config)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from evotrainer.backends.verl_render import (
    JobFiles,
    entrypoint,
    hydra_value,
    render_job,
    render_run,
)
from evotrainer.commands.render import register
from evotrainer.errors import EvoError
from evotrainer.store.recipe import BASE_RECIPE, deep_merge

hydra = pytest.importorskip("hydra", reason="needs hydra-core and omegaconf (the verl extra)")
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import ConfigCompositionException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

_VERL = importlib.util.find_spec("verl")
if _VERL is None:
    pytest.skip("needs `pip install --no-deps verl==0.9.1`", allow_module_level=True)
CONFIG_DIR = str(Path(_VERL.submodule_search_locations[0]) / "trainer" / "config")

RECIPES = {
    "base": {},
    "kl_k1_seq_mean": {"grpo": {"kl_coef": 0.01, "kl_estimator": "k1", "loss_agg": "seq-mean"}},
    "kl_k3": {"grpo": {"kl_coef": 0.001, "kl_estimator": "k3", "eval_every": 40}},
    "zero_std": {"group_filter": {"name": "zero_std"}},
    "eval_sampling": {"grpo": {"temperature": 0.2, "eval_temperature": 1.0, "eval_top_p": 0.95}},
    "std_group_filter": {
        "group_filter": {"name": "std_group_filter", "params": {"keep_ratio": 0.8}}
    },
    "cluster": {
        "seeds": [3, 4],
        "grpo": {"prompts_per_step": 64},
        "verl": {
            "ray_address": "http://head:8265",
            "nnodes": 2,
            "n_gpus_per_node": 8,
            "tensor_parallel": 2,
            "rollout_engine": "sglang",
            "ppo_mini_batch_size": 32,
            "micro_batch_size_per_gpu": 2,
            "reward_module": "rewards/mine.py",
            "save_freq": 10,
            "overrides": {
                "actor_rollout_ref.actor.entropy_coeff": 0.001,
                "actor_rollout_ref.model.use_remove_padding": True,
            },
        },
    },
    "environment": {
        "domain": {"name": "toolenv"},
        "environment": {"max_turns": 4},
        "verl": {"tool_config_path": "tools/verl_tools.yaml"},
    },
    # A multi-turn domain with no tool config of its own runs the domain's verl tools.
    "toolenv_tools": {"domain": {"name": "toolenv"}},
    "dual_level": {"group_filter": {"name": "dual_level", "params": {"echo_min_repeats": 4}}},
    "importance": {"rollout": {"importance_cap": 2.5}},
}


def recipe_for(overrides: dict) -> dict:
    return deep_merge(BASE_RECIPE, deep_merge({"model": {"path": "/models/tiny"}}, overrides))


def render(overrides: dict, tmp_path: Path, seed: int | None = None):
    recipe = recipe_for(overrides)
    runs = render_job(
        recipe, version="v1", files=JobFiles(tmp_path / "art"), workdir=tmp_path / "wt"
    )
    return recipe, runs if seed is None else [r for r in runs if r.seed == seed]


def compose_verl(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("render")
    out = {}
    for name, overrides in RECIPES.items():
        recipe, runs = render(overrides, tmp)
        out[name] = (recipe, runs, [compose_verl([o.hydra() for o in r.overrides]) for r in runs])
    return tmp, out


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_rendered_command_composes_with_verl_config(composed, name):
    tmp, results = composed
    recipe, runs, cfgs = results[name]
    grpo = recipe["grpo"]
    for run, cfg in zip(runs, cfgs, strict=True):
        assert cfg.algorithm.adv_estimator == "grpo"
        assert cfg.actor_rollout_ref.rollout.n == grpo["group_size"]
        assert cfg.data.train_batch_size == grpo["prompts_per_step"]
        assert cfg.actor_rollout_ref.actor.optim.lr == grpo["lr"]
        assert cfg.actor_rollout_ref.actor.clip_ratio_low == grpo["clip_low"]
        assert cfg.actor_rollout_ref.actor.clip_ratio_high == grpo["clip_high"]
        assert cfg.data.seed == run.seed == cfg.actor_rollout_ref.rollout.seed
        assert cfg.actor_rollout_ref.actor.data_loader_seed == run.seed
        assert "seed" not in cfg.trainer
        assert list(cfg.trainer.logger) == ["console", "file"]
        env_vars = cfg.ray_kwargs.ray_init.runtime_env.env_vars
        assert env_vars.VERL_FILE_LOGGER_PATH.endswith(f"seed{run.seed}/metrics.jsonl")
        assert cfg.trainer.rollout_data_dir != cfg.trainer.validation_data_dir
        for path in (
            cfg.trainer.rollout_data_dir,
            cfg.trainer.validation_data_dir,
            cfg.trainer.default_local_dir,
            cfg.data.train_files,
        ):
            assert Path(path).is_absolute()
        assert cfg.trainer.resume_mode == "disable"
        assert cfg.trainer.total_training_steps == grpo["steps"]
        assert cfg.actor_rollout_ref.rollout.val_kwargs.n == grpo["eval_k"]
        assert cfg.actor_rollout_ref.rollout.response_length == grpo["max_response_tokens"]
        # The reward is wired through reward.* only; the legacy keys stay at their nulls.
        assert cfg.reward.custom_reward_function.name == "compute_score"
        assert cfg.reward.custom_reward_function.reward_kwargs.config_path.endswith(
            "reward_config.json"
        )
        assert cfg.custom_reward_function.path is None
        assert cfg.reward_model.reward_manager is None


def test_mapped_settings(composed):
    _, results = composed
    cfg = results["kl_k1_seq_mean"][2][0]
    actor = cfg.actor_rollout_ref.actor
    assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == (True, 0.01, "kl")
    assert actor.loss_agg_mode == "seq-mean-token-mean"
    cfg = results["kl_k3"][2][0]
    assert cfg.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"
    assert cfg.trainer.test_freq == BASE_RECIPE["grpo"]["steps"]  # eval_every = steps
    base = results["base"][2][0]
    assert base.actor_rollout_ref.actor.use_kl_loss is False
    # Validation samples as training does unless the recipe fixes its own temperature and top-p.
    rollout = base.actor_rollout_ref.rollout
    assert rollout.val_kwargs.temperature == rollout.temperature == 1.0
    assert rollout.val_kwargs.top_p == rollout.top_p == 1.0
    rollout = results["eval_sampling"][2][0].actor_rollout_ref.rollout
    assert (rollout.temperature, rollout.top_p) == (0.2, 1.0)
    assert (rollout.val_kwargs.temperature, rollout.val_kwargs.top_p) == (1.0, 0.95)
    assert base.algorithm.filter_groups.enable is False
    assert base.ray_kwargs.ray_init.address == "local"
    assert base.reward.custom_reward_function.path.endswith("art/verl/reward.py")
    zero = results["zero_std"][2][0]
    assert zero.algorithm.filter_groups.enable is True
    assert zero.trainer.v1.sampler.custom_sampler.path is None
    std = results["std_group_filter"][2][0]
    assert std.trainer.v1.sampler.custom_sampler.name == "EvoGroupFilterReplayBuffer"
    spec = json.loads(std.trainer.v1.sampler.sampler_kwargs.spec)
    assert spec["filter"] == {"name": "std_group_filter", "params": {"keep_ratio": 0.8}}
    assert spec["train_batch_size"] == BASE_RECIPE["grpo"]["prompts_per_step"]
    cluster = results["cluster"][2]
    assert [c.data.seed for c in cluster] == [3, 4]
    assert cluster[0].reward.custom_reward_function.path == "rewards/mine.py"  # in working_dir
    assert "address" not in cluster[0].ray_kwargs.ray_init
    assert cluster[0].actor_rollout_ref.rollout.name == "sglang"
    assert cluster[0].actor_rollout_ref.actor.entropy_coeff == 0.001
    env = results["environment"][2][0].actor_rollout_ref.rollout
    assert env.multi_turn.enable is True and env.multi_turn.max_assistant_turns == 4
    assert env.multi_turn.tool_config_path.endswith("wt/tools/verl_tools.yaml")
    assert env.agent.default_agent_loop == "tool_agent"
    own = results["toolenv_tools"][2][0]
    rollout = own.actor_rollout_ref.rollout
    assert rollout.multi_turn.tool_config_path.endswith("art/verl/tools.yaml")
    assert own.data.tool_config_path == rollout.multi_turn.tool_config_path  # verl's own link
    assert (rollout.multi_turn.format, rollout.multi_turn.max_assistant_turns) == ("hermes", 8)
    # verl cuts tool replies at 256 characters unless told: room for the domain's longest.
    assert rollout.multi_turn.max_tool_response_length == 64
    assert results["base"][2][0].actor_rollout_ref.rollout.multi_turn.enable is False
    dual = results["dual_level"][2][0]
    assert dual.trainer.v1.sampler.custom_sampler.name == "EvoDualLevelReplayBuffer"
    assert json.loads(dual.trainer.v1.sampler.sampler_kwargs.spec)["filter"] == {
        "name": "dual_level", "params": {"echo_min_repeats": 4}}


def test_the_importance_cap_is_verls_token_level_rollout_correction(composed, tmp_path):
    _, results = composed
    correction = results["importance"][2][0].algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_is_threshold) == ("token", 2.5)
    assert results["importance"][2][0].actor_rollout_ref.rollout.calculate_log_probs is True
    assert results["base"][2][0].algorithm.rollout_correction.rollout_is is None
    with pytest.raises(EvoError) as refused:  # int8 is the embedded engine's CPU sampler
        render({"rollout": {"quantization": "int8", "importance_cap": 2.0}}, tmp_path)
    assert refused.value.field == "rollout.quantization" and "fp8" in str(refused.value)


def test_verl_rejects_a_misspelt_override(tmp_path):
    # The safety net above is real: verl's struct config refuses keys it does not know.
    _, runs = render(
        {"verl": {"overrides": {"actor_rollout_ref.actor.clip_ratio_hi": 0.3}}}, tmp_path
    )
    with pytest.raises(ConfigCompositionException):
        compose_verl([o.hydra() for o in runs[0].overrides])


def test_sections_convert_with_verls_dataclasses(composed):
    config = pytest.importorskip(
        "verl.utils.config",
        reason="verl's import chain (torch, ray, tensordict, codetiming, transformers) is not "
        "installed; see verl.md §1",
        exc_type=ImportError,
    )
    from verl.trainer.config import AlgoConfig
    from verl.workers.config import RolloutConfig

    _, results = composed
    for name, (_, _, cfgs) in results.items():
        cfg = cfgs[0]
        algo = config.omega_conf_to_dataclass(cfg.algorithm, AlgoConfig)
        assert algo.adv_estimator == "grpo", name
        config.omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, RolloutConfig)
        config.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # FSDPActorConfig checks
        config.validate_config(
            cfg, use_reference_policy=cfg.actor_rollout_ref.actor.use_kl_loss, use_critic=False
        )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"grpo": {"group_size": 1}}, "grpo.group_size"),
        ({"verl": {"rollout_engine": "hf"}}, "verl.rollout_engine"),
        (
            {"verl": {"overrides": {"algorithm.adv_estimator": "bogus"}}},
            "verl.overrides.algorithm.adv_estimator",
        ),
        (
            {"verl": {"overrides": {"custom_reward_function.path": "/r.py"}}},
            "verl.overrides.custom_reward_function.path",
        ),
        (
            {"verl": {"overrides": {"+reward_model.reward_manager": "dapo"}}},
            "verl.overrides.+reward_model.reward_manager",
        ),
        ({"verl": {"overrides": {"+trainer.seed": 1}}}, "verl.overrides.+trainer.seed"),
        ({"verl": {"n_gpus_per_node": 3}}, "grpo.prompts_per_step"),
        ({"verl": {"ppo_mini_batch_size": 5}}, "verl.ppo_mini_batch_size"),
        ({"verl": {"micro_batch_size_per_gpu": 3}}, "verl.micro_batch_size_per_gpu"),
        ({"verl": {"gpus": 8}}, "verl.gpus"),
        ({"model": {"path": None}}, "model.path"),
        ({"domain": {"train_size": 8}}, "grpo.prompts_per_step"),  # the recipe rule, first
        ({"grpo": {"eval_temperature": 0}}, "grpo.eval_temperature"),
        (
            {"verl": {"overrides": {"actor_rollout_ref.rollout.val_kwargs.temperature": 0}}},
            "verl.overrides.actor_rollout_ref.rollout.val_kwargs.temperature",
        ),
    ],
)
def test_checks_verl_misses_name_the_recipe_field(tmp_path, overrides, field):
    with pytest.raises(EvoError) as err:
        render(overrides, tmp_path)
    assert err.value.field == field
    assert err.value.hint


def test_hydra_values_are_quoted_only_when_needed():
    assert hydra_value("/abs/path-1/x.parquet") == "/abs/path-1/x.parquet"
    assert hydra_value("true") == "'true'"  # a string, not a bool
    assert hydra_value("1e3") == "'1e3'"
    assert hydra_value("it's {a}") == "'it\\'s {a}'"
    assert hydra_value(["console", "file"]) == "[console,file]"
    assert hydra_value(None) == "null" and hydra_value(False) == "false"
    assert hydra_value(1e-06) == "1e-06"


def render_app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `render` a subcommand
    return app


def test_render_cli_formats(tmp_path):
    app = render_app()
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump({"model": {"path": "/models/tiny"}, "seeds": [0, 1]}))
    runner = CliRunner()
    base = ["render", "--recipe", str(recipe_file), "--artifact-dir", str(tmp_path / "a")]

    result = runner.invoke(app, [*base, "--seed", "1"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "data.seed=1" in lines and all("=" in line for line in lines)
    assert compose_verl(lines).data.seed == 1

    result = runner.invoke(app, [*base, "--format", "yaml"])
    tree = yaml.safe_load(result.output)
    assert tree["actor_rollout_ref"]["rollout"]["n"] == 8 and tree["data"]["seed"] == 0

    result = runner.invoke(app, [*base, "--format", "shell"])
    assert result.output.count("python3 -m verl.trainer.main_ppo") == 2
    assert " && " in result.output

    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        yaml.safe_dump({"model": {"path": "/m"}, "verl": {"ray_address": "http://head:8265"}})
    )
    result = runner.invoke(app, ["render", "v7", "--recipe", str(cluster), "--format", "shell"])
    assert result.output.startswith(
        "ray job submit --address http://head:8265 --submission-id evo-v7-a1-"
    )

    result = runner.invoke(app, [*base, "--format", "toml"])
    assert isinstance(result.exception, EvoError) and result.exception.field == "--format"


def test_each_seed_is_its_own_run(tmp_path):
    recipe = recipe_for({"seeds": [0, 5]})
    run = render_run(recipe, version="v1", seed=5, files=JobFiles(tmp_path), workdir=tmp_path)
    values = {o.key: o.value for o in run.overrides}
    assert values["trainer.experiment_name"] == "v1-seed5"
    assert values["trainer.validation_data_dir"] == str(tmp_path / "verl/seed5/validation")


def test_render_a_workspace_version(workspace, monkeypatch):
    monkeypatch.chdir(workspace.root)
    result = CliRunner().invoke(render_app(), ["render", "v0"])
    # The example project trains on the local backend: render says it shows verl jobs.
    assert isinstance(result.exception, EvoError) and result.exception.field == "backend"
    (workspace.root / "models" / "qwen").mkdir(parents=True)
    project = workspace.root / "spec" / "project.yaml"
    spec = yaml.safe_load(project.read_text())
    spec["recipe"]["backend"] = "verl"
    spec["recipe"]["model"] = {"path": str(workspace.root / "models" / "qwen")}
    project.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(render_app(), ["render", "v0"], catch_exceptions=False)
    lines = result.output.splitlines()
    assert f"actor_rollout_ref.model.path={workspace.root / 'models' / 'qwen'}" in lines
    assert str(workspace.artifact_root / "v0" / "evo-v0-a1-") in result.output
    # v0 is the evaluation-only baseline: its job trains 0 steps (tests/test_verl_render_launch
    # compares every rendered job with the one reconcile submits).
    assert "trainer.total_training_steps=0" in lines


def test_the_final_policy_is_saved_merged_and_continued_from(tmp_path):
    files = JobFiles(tmp_path / "art")
    steps = BASE_RECIPE["grpo"]["steps"]
    _, runs = render({"seeds": [0, 7], "loggers": ["console", "tensorboard"]}, tmp_path)
    cfg = compose_verl([o.hydra() for o in runs[0].overrides])
    assert cfg.trainer.save_freq == steps  # verl saves at save_freq multiples: the last step
    assert cfg.trainer.default_local_dir == str(files.checkpoint_dir(0))
    assert list(cfg.trainer.logger) == ["console", "tensorboard", "file"]
    assert runs[0].merge.shards == files.checkpoint_dir(0) / f"global_step_{steps}" / "actor"
    assert [r.merge.target for r in runs] == [files.artifact_dir / "checkpoint",
                                              files.artifact_dir / "checkpoint-seed7"]
    command = entrypoint(runs, "python3")
    assert command.count(" -m verl.trainer.main_ppo ") == 2
    # Without save_freq the shards go once merged; with it they stay for resumption.
    assert f"rm -rf {files.checkpoint_dir(0)}" in command

    _, kept = render({"verl": {"save_freq": 5}}, tmp_path)
    assert compose_verl([o.hydra() for o in kept[0].overrides]).trainer.save_freq == 5
    assert "rm -rf" not in entrypoint(kept, "python3")
    with pytest.raises(EvoError) as err:
        render({"verl": {"save_freq": -1}}, tmp_path)
    assert err.value.field == "verl.save_freq"
    _, evaluate_only = render({"grpo": {"steps": 0}}, tmp_path)
    assert evaluate_only[0].merge is None and "model_merger" not in entrypoint(
        evaluate_only, "python3")

    start = {"path": "/art/v1/job/checkpoint", "digest": "sha256:" + "0" * 64}
    _, child = render({"model": {"init": "parent", "init_checkpoint": start}}, tmp_path)
    values = {o.key: o.value for o in child[0].overrides}
    assert values["actor_rollout_ref.model.path"] == start["path"]
