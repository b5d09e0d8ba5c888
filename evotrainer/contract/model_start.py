"""Which weights a job starts from: the one precedence every reader follows (the engine,
verl, the recipe checks, the typed recipe, export, init)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


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
