"""Recipes: the full training configuration of a version.

A version's resolved recipe is BASE_RECIPE, then the project's `recipe`, then every
ancestor's `recipe` overrides from the root down to the version itself, deep-merged in that
order. Merge rules (documented in the README):

- mappings merge key by key, recursively;
- a `null` value in an override removes the key (falls back to nothing, not to the base);
- a list of mappings that all carry `name` (reward components, tools) merges by name: an
  override entry updates the entry with the same name, new names are appended;
- any other list (seeds, ops) is replaced wholesale.

The digest is the sha256 of the canonical JSON (sorted keys, no whitespace) of the resolved
recipe; it identifies "the same training" across branches and passes.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

BASE_RECIPE: dict[str, Any] = {
    "backend": "local",
    "model": {
        # `path` (a local HF checkpoint directory) wins over `tiny` when set.
        "path": None,
        "tiny": {
            "family": "qwen2",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 4,
            "max_position_embeddings": 96,
        },
        # Supervised warm start on the domain's demonstrations, stopped at partial sampled
        # accuracy so GRPO still has signal; cached by digest and shared across versions.
        "warm_start": {"steps": 300, "lr": 1.0e-3, "batch_size": 32, "stop_at_accuracy": 0.35},
    },
    "domain": {"name": "arith", "params": {}, "train_size": 256, "val_size": 32, "data": {}},
    "grpo": {
        "group_size": 8,
        "prompts_per_step": 16,
        "steps": 40,
        "lr": 1.0e-4,
        "clip_low": 0.20,
        "clip_high": 0.27,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "loss_agg": "token-mean",
        "normalize_std": True,
        "ppo_epochs": 1,
        "grad_clip": 1.0,
        "max_response_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "eval_every": 20,
        "eval_k": 8,
    },
    "seeds": [0],
    "reward": {"components": [{"name": "correctness", "weight": 1.0}]},
    "group_filter": {"name": "none", "params": {}},
    "environment": None,
    "threads": 1,
}


def copy_tree(value: Any) -> Any:
    """A copy of a recipe-shaped value (mappings, lists, scalars): copy.deepcopy's result
    for YAML data at a fraction of its cost, which resolving thousands of recipes pays."""
    if isinstance(value, dict):
        return {key: copy_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [copy_tree(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return copy.deepcopy(value)


def deep_merge(
    base: Any, override: Any, *, keep_nulls: bool = False, share_base: bool = False
) -> Any:
    """Return `base` with `override` merged in (neither argument is modified).

    `keep_nulls` composes two sets of overrides: a null stays, to remove the key when the
    result is later merged onto a recipe. `share_base`: the result shares the parts of
    `base` the override leaves as they are, for a base nobody changes (the resolved recipes
    a Workspace remembers); otherwise the result shares nothing with either argument.
    """
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base) if share_base else copy_tree(base)
        for key, value in override.items():
            if value is None and not keep_nulls:
                merged.pop(key, None)
            elif key in merged and value is not None:
                # `merged[key]` is ours already (copied above) or shared by request.
                merged[key] = deep_merge(merged[key], value, keep_nulls=keep_nulls,
                                         share_base=True)
            else:
                merged[key] = copy_tree(value)
        return merged
    if _is_named_list(base) and _is_named_list(override):
        merged_list = list(base) if share_base else copy_tree(base)
        index = {item["name"]: i for i, item in enumerate(merged_list)}
        for item in override:
            if item["name"] in index:
                i = index[item["name"]]
                merged_list[i] = deep_merge(merged_list[i], item, keep_nulls=keep_nulls,
                                            share_base=True)
            else:
                merged_list.append(copy_tree(item))
        return merged_list
    return copy_tree(override)


def _is_named_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(item, dict) and "name" in item for item in value)
    )


def resolve(project_recipe: dict, chain: list[dict]) -> dict:
    """Resolve a recipe from the project defaults and the overrides root → leaf."""
    recipe = deep_merge(BASE_RECIPE, project_recipe or {})
    for overrides in chain:
        recipe = deep_merge(recipe, overrides or {})
    return recipe


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(value: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(value).encode()).hexdigest()


def set_dotted(target: dict, dotted: str, value: Any) -> None:
    """`set_dotted(r, "grpo.lr", 3e-4)`: create intermediate mappings as needed."""
    *parents, leaf = dotted.split(".")
    node = target
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"{dotted}: {key!r} is not a mapping")
    node[leaf] = value
