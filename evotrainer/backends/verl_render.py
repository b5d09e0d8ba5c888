"""Render a resolved recipe as a verl 0.9.1 GRPO run: `python3 -m verl.trainer.main_ppo` plus
Hydra overrides, the environment it needs, and the checks verl itself does not make.

Facts behind every key are in shared/reference/verl.md. The traps this module exists to avoid:
there is no `trainer.seed`; the legacy top-level reward keys compose but are silently ignored,
so only `reward.custom_reward_function.*` is emitted; `resume_mode` defaults to `auto` (a rerun
in the same dir resumes); and every output path must be absolute because the writers run in
Ray actors whose cwd is not ours.

The recipe's optional `verl:` section holds cluster-only settings; `VERL_DEFAULTS` lists them.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evotrainer.backends.verl_episode import domain_tools, max_tool_reply
from evotrainer.contract.model_start import model_start
from evotrainer.contract.recipe import environment_config, evaluation_sampling
from evotrainer.contract.typed import Recipe
from evotrainer.domains import get_domain
from evotrainer.errors import EvoError
from evotrainer.store.checkpoints import seed_checkpoint_name
from evotrainer.trackers import logger_names
from evotrainer.trackers.verl import verl_loggers

ENTRYPOINT_MODULE = "verl.trainer.main_ppo"
MERGER_MODULE = "verl.model_merger"

# The recipe's `verl:` section (read with these defaults; the lead adds them to BASE_RECIPE).
VERL_DEFAULTS: dict[str, Any] = {
    "python": "python3",  # the interpreter that has verl[vllm] installed
    "ray_address": None,  # None: a local subprocess; "http://HEAD:8265": Ray Jobs
    "nnodes": 1,
    "n_gpus_per_node": 1,
    "rollout_engine": "vllm",
    "tensor_parallel": 1,  # verl's default 2 cannot place on a single GPU
    "gpu_memory_utilization": 0.5,
    "ppo_mini_batch_size": None,  # None: grpo.prompts_per_step (one update per step)
    "micro_batch_size_per_gpu": 4,  # actor update, rollout and ref log-prob passes
    "max_prompt_length": 512,
    "project_name": "evotrainer",
    # The final policy is always saved (and merged into a plain HF directory); N > 0 also
    # keeps FSDP shards every N steps, for resumption. None: the last step only.
    "save_freq": None,
    "resume_mode": "disable",  # each attempt gets a fresh artifact dir, so never auto-resume
    "stall_after_s": 1800,  # watchdog: no metrics line or dump file for this long = Stalled
    "reward_module": None,  # worktree-relative .py with the reward function; None = built-in
    "reward_function": "compute_score",
    # Worktree-relative verl tool YAML; None: the domain's own tools (verl_episode), written
    # beside the job's data.
    "tool_config_path": None,
    "env": {},  # extra environment variables for every verl process
    "overrides": {},  # extra Hydra overrides, dotted key -> value ("+key" adds a new key)
}

ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "rloo_vectorized",
    "opo",
    "grpo_passk",
    "gpg",
    "grpo_vectorized",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
)
ROLLOUT_ENGINES = ("vllm", "sglang", "trtllm")
# Top-level reward keys of verl <= 0.8: they still compose in 0.9.1 but main_ppo ignores them.
LEGACY_REWARD_PREFIXES = ("custom_reward_function", "reward_model", "sandbox_fusion")
KL_LOSS_TYPES = {"k1": "kl", "k3": "low_var_kl"}
LOSS_AGG_MODES = {"token-mean": "token-mean", "seq-mean": "seq-mean-token-mean"}
REWARD_CONFIG_KWARG = "config_path"
SAMPLER_CLASS = "EvoGroupFilterReplayBuffer"
# dual_level's: level 1's marked sessions leave the batch (verl_dual_sampler.py).
DUAL_SAMPLER_CLASS = "EvoDualLevelReplayBuffer"
SAMPLER_NAME = "trainer.v1.sampler.custom_sampler.name"

_A, _R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


def verl_settings(recipe: dict) -> dict[str, Any]:
    """The recipe's `verl:` section over VERL_DEFAULTS (unknown keys are an error: a typo
    there would otherwise silently fall back to a default on a paid cluster)."""
    section = recipe.get("verl") or {}
    unknown = sorted(set(section) - set(VERL_DEFAULTS))
    if unknown:
        raise EvoError(
            f"unknown verl setting {unknown[0]!r}",
            field=f"verl.{unknown[0]}",
            hint=f"known settings: {', '.join(VERL_DEFAULTS)}",
        )
    return {**VERL_DEFAULTS, **section}


@dataclass(frozen=True)
class JobFiles:
    """Where one job's inputs and outputs live. Everything is absolute and under the artifact
    dir, which on a cluster must be storage the head node shares."""

    artifact_dir: Path

    @property
    def root(self) -> Path:
        return self.artifact_dir / "verl"

    @property
    def train_file(self) -> Path:
        return self.root / "data" / "train.parquet"

    @property
    def val_file(self) -> Path:
        return self.root / "data" / "val.parquet"

    @property
    def reward_module(self) -> Path:
        return self.root / "reward.py"

    @property
    def reward_config(self) -> Path:
        return self.root / "reward_config.json"

    @property
    def sampler_module(self) -> Path:
        return self.root / "sampler.py"

    @property
    def tool_config(self) -> Path:
        """The domain's verl tool config (verl_episode.tool_config), when the recipe names
        none of its own."""
        return self.root / "tools.yaml"

    @property
    def log_file(self) -> Path:
        return self.artifact_dir / "job.log"

    def seed_dir(self, seed: int) -> Path:
        return self.root / f"seed{seed}"

    def rollout_dir(self, seed: int) -> Path:
        return self.seed_dir(seed) / "rollouts"

    def validation_dir(self, seed: int) -> Path:
        return self.seed_dir(seed) / "validation"

    def checkpoint_dir(self, seed: int) -> Path:
        """verl's `trainer.default_local_dir`: FSDP shards under global_step_N/actor."""
        return self.seed_dir(seed) / "checkpoints"

    def policy_dir(self, index: int, seed: int) -> Path:
        """The merged Hugging Face directory of seed number `index`: the recorded policy."""
        return self.artifact_dir / seed_checkpoint_name(index, seed)

    def metrics_file(self, seed: int) -> Path:
        return self.seed_dir(seed) / "metrics.jsonl"


@dataclass(frozen=True)
class Override:
    key: str  # dotted; a leading "+" adds a key verl's schema lacks
    value: Any

    def hydra(self) -> str:
        return f"{self.key}={hydra_value(self.value)}"


@dataclass(frozen=True)
class PolicyMerge:
    """After a seed's run: verl's own merger turns the FSDP shards of the last step into a
    plain Hugging Face directory (weights, config, tokenizer, chat template), then the shards
    go unless `verl.save_freq` asked to keep them for resumption."""

    shards: Path  # <default_local_dir>/global_step_<steps>/actor
    target: Path
    keep_shards: bool

    def argv(self, python: str) -> list[str]:
        return [
            python, "-m", MERGER_MODULE, "merge", "--backend", "fsdp",
            "--local_dir", str(self.shards), "--target_dir", str(self.target),
        ]

    def shell(self, python: str) -> str:
        merge = " ".join(shlex.quote(a) for a in self.argv(python))
        if self.keep_shards:
            return merge
        return f"{merge} && rm -rf {shlex.quote(str(self.shards.parent.parent))}"


@dataclass(frozen=True)
class RenderedRun:
    """One verl run (one seed), and the merge of its final policy (None: no training step,
    so no policy beyond the starting one)."""

    seed: int
    overrides: list[Override]
    merge: PolicyMerge | None = None

    def argv(self, python: str) -> list[str]:
        return [python, "-m", ENTRYPOINT_MODULE, *(o.hydra() for o in self.overrides)]

    def shell(self, python: str) -> str:
        return " ".join(shlex.quote(a) for a in self.argv(python))

    def with_overrides(self, extra: list[Override]) -> RenderedRun:
        return RenderedRun(self.seed, [*self.overrides, *extra], self.merge)

    def as_yaml_tree(self) -> dict:
        """The overrides as one nested mapping (the "+" markers dropped)."""
        tree: dict = {}
        for o in self.overrides:
            *parents, leaf = o.key.lstrip("+").split(".")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = o.value
        return tree


def entrypoint(runs: list[RenderedRun], python: str) -> str:
    """The job's shell command: each seed's run then the merge of its policy, the seeds one
    after another, stopping at the first failure."""
    steps = []
    for run in runs:
        steps.append(run.shell(python))
        if run.merge is not None:
            steps.append(run.merge.shell(python))
    return " && ".join(steps)


def job_env(recipe: dict) -> dict[str, str]:
    """Environment variables every verl process of the job needs (`verl.env`)."""
    return {str(k): str(v) for k, v in (verl_settings(recipe)["env"] or {}).items()}


# Unquoted strings that Hydra cannot read as a number (no leading digit or sign) or keyword.
_BARE = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./\-]*$")
_KEYWORDS = {"true", "false", "null", "inf", "nan"}


def hydra_value(value: Any) -> str:
    """A Python value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _BARE.match(text) and text.lower() not in _KEYWORDS:
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render_run(
    recipe: dict, *, version: str, seed: int, files: JobFiles, workdir: Path, index: int = 0
) -> RenderedRun:
    """The verl overrides for seed number `index` (value `seed`) of a version (checked:
    EvoError if a setting would fail or be silently ignored by verl)."""
    settings = verl_settings(recipe)
    typed = Recipe.from_dict(recipe)
    grpo, domain = typed.grpo, recipe["domain"]
    model = recipe.get("model") or {}
    # A continuing version starts from its parent's merged policy (model.init: parent); verl
    # loads an HF checkpoint, so a package or the tiny model is no start it can use.
    start = model_start(model)
    model_path = start.source["path"] if start.kind == "parent" else (
        start.source if start.kind == "path" else None)
    if not model_path:
        raise EvoError(
            "the verl backend trains a Hugging Face checkpoint, and model.path is not set",
            field="model.path",
            hint="set model.path to a local HF model dir (on a cluster: a path every node "
            "can read, or a hub id the nodes may download)",
        )
    batch, group = grpo.prompts_per_step, grpo.group_size
    steps = grpo.steps
    micro = settings["micro_batch_size_per_gpu"]
    eval_every, eval_k, kl_coef = grpo.eval_every, grpo.eval_k, grpo.kl_coef
    eval_temperature, eval_top_p = evaluation_sampling(recipe["grpo"])
    # verl stops at total_training_steps, but only inside total_epochs passes over the data.
    batches_per_epoch = max(1, domain["train_size"] // batch)
    filtering = typed.group_filter.name != "none"
    # Dynamic sampling draws replacement prompts for every evicted group: leave room for it.
    epochs = math.ceil(steps / batches_per_epoch) * (4 if filtering else 1)

    values: dict[str, Any] = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": grpo.normalize_std,
        "algorithm.use_kl_in_reward": False,
        "data.train_files": str(files.train_file),
        "data.val_files": str(files.val_file),
        "data.train_batch_size": batch,
        "data.max_prompt_length": settings["max_prompt_length"],
        "data.max_response_length": grpo.max_response_tokens,
        "data.filter_overlong_prompts": True,
        "data.seed": seed,
        "actor_rollout_ref.model.path": str(model_path),
        f"{_A}.optim.lr": grpo.lr,
        f"{_A}.grad_clip": grpo.grad_clip,
        f"{_A}.ppo_epochs": grpo.ppo_epochs,
        f"{_A}.ppo_mini_batch_size": settings["ppo_mini_batch_size"] or batch,
        f"{_A}.ppo_micro_batch_size_per_gpu": micro,
        f"{_A}.clip_ratio_low": grpo.clip_low,
        f"{_A}.clip_ratio_high": grpo.clip_high,
        f"{_A}.use_kl_loss": kl_coef > 0,
        f"{_A}.kl_loss_coef": kl_coef,
        f"{_A}.kl_loss_type": KL_LOSS_TYPES[grpo.kl_estimator],
        f"{_A}.loss_agg_mode": LOSS_AGG_MODES[grpo.loss_agg],
        f"{_A}.entropy_coeff": 0,
        f"{_A}.data_loader_seed": seed,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": micro,
        f"{_R}.name": settings["rollout_engine"],
        f"{_R}.n": group,
        f"{_R}.seed": seed,
        f"{_R}.temperature": grpo.temperature,
        f"{_R}.top_p": grpo.top_p,
        f"{_R}.tensor_model_parallel_size": settings["tensor_parallel"],
        f"{_R}.gpu_memory_utilization": settings["gpu_memory_utilization"],
        f"{_R}.log_prob_micro_batch_size_per_gpu": micro,
        # Avg@k samples k answers per task at grpo.eval_temperature / eval_top_p (by default
        # the training ones), as the embedded engine does.
        f"{_R}.val_kwargs.n": eval_k,
        f"{_R}.val_kwargs.do_sample": True,
        f"{_R}.val_kwargs.temperature": eval_temperature,
        f"{_R}.val_kwargs.top_p": eval_top_p,
        "reward.custom_reward_function.path": _reward_path(settings, files, workdir),
        "reward.custom_reward_function.name": settings["reward_function"],
        f"+reward.custom_reward_function.reward_kwargs.{REWARD_CONFIG_KWARG}": str(
            files.reward_config
        ),
        "trainer.project_name": settings["project_name"],
        "trainer.experiment_name": f"{version}-seed{seed}",
        "trainer.logger": verl_loggers(logger_names(recipe)),
        # The file logger runs in the TaskRunner actor: the path reaches it through the
        # runtime_env main_ppo passes to ray.init, in a local run and in a Ray job alike.
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH": str(
            files.metrics_file(seed)
        ),
        "trainer.total_training_steps": steps,
        "trainer.total_epochs": epochs,
        # Validation at the last step is what the score table is built from: verl validates
        # there too, whatever the period (eval_every >= 1 by the schema).
        "trainer.test_freq": eval_every,
        "trainer.val_before_train": True,
        "trainer.save_freq": _save_freq(settings, steps),
        "trainer.default_local_dir": str(files.checkpoint_dir(seed)),
        "trainer.resume_mode": settings["resume_mode"],
        "trainer.rollout_data_dir": str(files.rollout_dir(seed)),
        "trainer.validation_data_dir": str(files.validation_dir(seed)),
        "trainer.nnodes": settings["nnodes"],
        "trainer.n_gpus_per_node": settings["n_gpus_per_node"],
    }
    if settings["ray_address"] is None:
        # main_ppo's ray.init() would join any `ray start` cluster on this host (another
        # user's, perhaps): a local job gets a private one.
        values["+ray_kwargs.ray_init.address"] = "local"
    values.update(_group_filter_values(recipe, files))
    values.update(_rollout_correction_values(recipe))
    values.update(_environment_values(recipe, settings, files, workdir))
    for key, value in (settings["overrides"] or {}).items():
        values[str(key)] = value

    check_values(values, recipe)
    merge = None
    if steps > 0:
        # verl names the folder after its global step, which ends at total_training_steps.
        merge = PolicyMerge(
            shards=files.checkpoint_dir(seed) / f"global_step_{steps}" / "actor",
            target=files.policy_dir(index, seed),
            keep_shards=settings["save_freq"] is not None,
        )
    return RenderedRun(seed, [Override(k, v) for k, v in values.items()], merge)


def render_job(recipe: dict, *, version: str, files: JobFiles, workdir: Path) -> list[RenderedRun]:
    """One run per seed of the recipe, in seed order."""
    return [
        render_run(recipe, version=version, seed=seed, files=files, workdir=workdir, index=i)
        for i, seed in enumerate(recipe.get("seeds") or [0])
    ]


def _save_freq(settings: dict, steps: int) -> int:
    """verl saves when save_freq > 0, at every multiple of it and at the last step: the last
    step alone unless `verl.save_freq` asks for more."""
    every = settings["save_freq"]
    if every is None:
        return max(steps, 1)
    if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
        raise EvoError(
            f"verl.save_freq must be a positive number of steps or null, got {every!r}",
            field="verl.save_freq",
            hint="the final policy is always saved; set save_freq: N to also keep FSDP shards "
            "every N steps, or null",
        )
    return every


def _reward_path(settings: dict, files: JobFiles, workdir: Path) -> str:
    module = settings["reward_module"]
    if module is None:
        return str(files.reward_module)
    if settings["ray_address"] is not None:
        # Ray Jobs unpack the worktree as every worker's cwd, so the path stays relative.
        return str(module)
    return str((workdir / module).resolve())


def _group_filter_values(recipe: dict, files: JobFiles) -> dict[str, Any]:
    spec = recipe.get("group_filter") or {"name": "none"}
    name = spec.get("name", "none")
    if name == "none":
        return {}
    # Either way the dataloader must switch to gen_batch_size=1 refills.
    values: dict[str, Any] = {
        "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "reward",
    }
    if name == "zero_std":
        return values  # verl's own test (identical rewards across the group) is the same rule
    kwargs = {
        "metric": "reward",
        "train_batch_size": recipe["grpo"]["prompts_per_step"],
        "max_inflight_gen_batches": 1,
        "filter": {"name": name, "params": dict(spec.get("params") or {})},
    }
    values["trainer.v1.sampler.custom_sampler.path"] = str(files.sampler_module)
    values[SAMPLER_NAME] = DUAL_SAMPLER_CLASS if name == "dual_level" else SAMPLER_CLASS
    values["+trainer.v1.sampler.sampler_kwargs.spec"] = json.dumps(kwargs, sort_keys=True)
    return values


def recipe_environment(recipe: dict) -> dict[str, Any] | None:
    """The environment a multi-turn domain runs with (its defaults under the recipe's
    `environment`), as the engine gets it; None for a single-turn domain."""
    return environment_config(recipe, get_domain(recipe["domain"]["name"]))


def _rollout_correction_values(recipe: dict) -> dict[str, Any]:
    """`rollout.importance_cap` as verl's own rollout correction: token-level truncated
    importance weights pi_old / pi_rollout capped at it, from the rollout log-probs vLLM
    returns (`rollout.calculate_log_probs`, on by default in verl 0.9.1)."""
    section = recipe.get("rollout") or {}
    if section.get("quantization") is not None:
        raise EvoError(
            f"rollout.quantization {section['quantization']} is the embedded engine's CPU "
            "sampler; verl quantizes its vLLM rollouts itself",
            field="rollout.quantization",
            hint="remove it; for fp8 rollouts on GPUs set verl.overrides: "
            "{actor_rollout_ref.rollout.quantization: fp8} with rollout.importance_cap",
        )
    if section.get("importance_cap") is None:
        return {}
    return {
        "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_is_threshold": float(section["importance_cap"]),
    }


def _environment_values(
    recipe: dict, settings: dict, files: JobFiles, workdir: Path
) -> dict[str, Any]:
    environment = recipe_environment(recipe)
    if environment is None:
        return {}
    tool_config = settings["tool_config_path"]
    values: dict[str, Any] = {}
    if tool_config is None:
        domain_tools(recipe["domain"]["name"])  # EvoError for a domain without verl tools
        tool_config = str(files.tool_config)
        values[f"{_R}.multi_turn.max_tool_response_length"] = max_tool_reply(recipe["domain"])
    elif settings["ray_address"] is None:
        tool_config = str((workdir / tool_config).resolve())
    values |= {
        f"{_R}.multi_turn.enable": True,
        f"{_R}.multi_turn.tool_config_path": str(tool_config),
        f"{_R}.multi_turn.format": "hermes",
        f"{_R}.agent.default_agent_loop": "tool_agent",
    }
    if environment.get("max_turns"):
        values[f"{_R}.multi_turn.max_assistant_turns"] = environment["max_turns"]
    return values


def _override_field(key: str, recipe: dict) -> str:
    """The recipe field a rendered key came from (raw overrides name themselves)."""
    overrides = ((recipe.get("verl") or {}).get("overrides")) or {}
    return f"verl.overrides.{key}" if key in overrides else _SOURCES.get(key, f"verl.{key}")


_SOURCES = {
    f"{_R}.n": "grpo.group_size",
    "data.train_batch_size": "grpo.prompts_per_step",
    f"{_A}.ppo_mini_batch_size": "verl.ppo_mini_batch_size",
    f"{_A}.ppo_micro_batch_size_per_gpu": "verl.micro_batch_size_per_gpu",
    f"{_R}.name": "verl.rollout_engine",
    "trainer.n_gpus_per_node": "verl.n_gpus_per_node",
}


def check_values(values: dict[str, Any], recipe: dict) -> None:
    """What verl 0.9.1 accepts silently or only reports deep inside a Ray actor."""

    def fail(key: str, message: str, hint: str) -> None:
        raise EvoError(message, field=_override_field(key, recipe), hint=hint)

    for key in values:
        bare = key.lstrip("+~")
        if bare.split(".")[0] in LEGACY_REWARD_PREFIXES:
            fail(
                key,
                f"{bare} is a legacy reward key that verl 0.9.1 composes but ignores",
                f"use reward.{bare} instead",
            )
        if bare == "trainer.seed":
            fail(key, "verl has no trainer.seed", "seeds come from the recipe's `seeds`")

    estimator = values["algorithm.adv_estimator"]
    if estimator not in ADV_ESTIMATORS:
        fail(
            "algorithm.adv_estimator",
            f"unknown advantage estimator {estimator!r}",
            f"choose one of: {', '.join(ADV_ESTIMATORS)}",
        )
    engine = values[f"{_R}.name"]
    if engine not in ROLLOUT_ENGINES:
        fail(
            f"{_R}.name",
            f"verl 0.9.1 has no rollout engine {engine!r}",
            f"choose one of: {', '.join(ROLLOUT_ENGINES)}",
        )
    n = values[f"{_R}.n"]
    if not isinstance(n, int) or (estimator.startswith("grpo") and n < 2):
        fail(
            f"{_R}.n",
            f"GRPO needs at least 2 samples per prompt, got {n!r}",
            "set grpo.group_size to 2 or more (8 is usual)",
        )

    n_gpus = values["trainer.n_gpus_per_node"] * values["trainer.nnodes"]
    batch = values["data.train_batch_size"]
    mini = values[f"{_A}.ppo_mini_batch_size"]
    micro = values[f"{_A}.ppo_micro_batch_size_per_gpu"]
    if (batch * n) % n_gpus:
        fail(
            "data.train_batch_size",
            f"prompts_per_step × group_size = {batch * n} samples do not split evenly over "
            f"{n_gpus} GPU(s)",
            f"make grpo.prompts_per_step × grpo.group_size a multiple of {n_gpus}",
        )
    if mini > batch or batch % mini:
        fail(
            f"{_A}.ppo_mini_batch_size",
            f"ppo_mini_batch_size {mini} must divide prompts_per_step {batch}",
            "set verl.ppo_mini_batch_size to a divisor of grpo.prompts_per_step",
        )
    per_gpu, rest = divmod(mini * n, n_gpus)
    if rest or per_gpu == 0 or per_gpu % micro:
        fail(
            f"{_A}.ppo_micro_batch_size_per_gpu",
            f"a mini-batch of {mini} prompts × {n} samples over {n_gpus} GPU(s) does not split "
            f"into micro-batches of {micro}",
            "choose verl.micro_batch_size_per_gpu dividing ppo_mini_batch_size × group_size / GPUs",
        )
    train_size = recipe["domain"]["train_size"]
    if train_size < batch:
        raise EvoError(
            f"train_size {train_size} is smaller than one batch of {batch} prompts",
            field="domain.train_size",
            hint="raise domain.train_size",
        )
    val_temperature = f"{_R}.val_kwargs.temperature"
    if values.get(f"{_R}.val_kwargs.do_sample") and values.get(val_temperature, 1) <= 0:
        # It comes from a raw override, else grpo.eval_temperature when set, else grpo.temperature.
        field = _override_field(val_temperature, recipe)
        if not field.startswith("verl.overrides."):
            eval_set = recipe["grpo"].get("eval_temperature") is not None
            field = "grpo.eval_temperature" if eval_set else "grpo.temperature"
        raise EvoError(
            "sampled validation needs a temperature above 0",
            field=field,
            hint="a positive temperature, e.g. 1.0",
        )
