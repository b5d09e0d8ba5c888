"""The resolved recipe as frozen, typed objects: `Recipe.from_dict(resolved).grpo.clip_low`.

Built once from the resolved dict (store/recipe.resolve) after it passed the recipe's JSON
Schema (spec/schemas/recipe.schema.json: every type, bound and allowed value); the code here
adds only what a schema cannot say across fields. `as_dict()` gives back exactly the dict
it was built from, so a consumer can move to typed access one at a time while the digest
(store/recipe.digest, bound by approvals) stays that of the dict.

Defaults: BASE_RECIPE, merged first, holds every default. What a field means when a recipe
leaves it out (an override set it to null, which removes it, or a key BASE_RECIPE does not
hold, such as a reward component's weight) is the dataclass default below, stated once; a
field without a default must be present, and its absence is an error naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from functools import cache, lru_cache
from types import MappingProxyType, UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import jsonschema

from evotrainer.contract.model_start import base_model
from evotrainer.domains.params import schema_problem
from evotrainer.errors import EvoError
from evotrainer.store import specs
from evotrainer.store.recipe import canonical_json, copy_tree

EMPTY: Mapping[str, Any] = MappingProxyType({})


def _empty() -> Mapping[str, Any]:
    return EMPTY


@dataclass(frozen=True, slots=True)
class Tiny:
    """`model.tiny`: the randomly initialised model a lineage trains from when it names no
    checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    family: str = "qwen2"


@dataclass(frozen=True, slots=True)
class WarmStart:
    """`model.warm_start`; absent (or null), no warm start runs."""

    steps: int = 0
    lr: float = 1.0e-3
    batch_size: int = 32
    stop_at_accuracy: float = 0.35


@dataclass(frozen=True, slots=True)
class Lora:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"


@dataclass(frozen=True, slots=True)
class InitCheckpoint:
    """The parent's recorded policy a continuing job starts from (set by reconcile)."""

    path: str
    digest: str


@dataclass(frozen=True, slots=True)
class Model:
    """`model`. `tiny` is the tiny model's config when the lineage starts from it (see
    contract/recipe.base_model), None when it starts from a checkpoint or a package."""

    tiny: Tiny | None = None
    path: str | None = None
    package: str | None = None
    warm_start: WarmStart = WarmStart()
    chat_template: str = "auto"
    dtype: str = "float32"
    lora: Lora | None = None
    init: str = "base"
    init_checkpoint: InitCheckpoint | None = None


@dataclass(frozen=True, slots=True)
class DomainData:
    train: str | None = None
    val: str | None = None


@dataclass(frozen=True, slots=True)
class Domain:
    """`domain`: which task family, its `params` (checked against the domain's own
    params_schema when the domain is built) and the split sizes."""

    name: str
    train_size: int
    val_size: int
    params: Mapping[str, Any] = field(default_factory=_empty)
    data: DomainData = DomainData()


@dataclass(frozen=True, slots=True)
class Grpo:
    group_size: int
    prompts_per_step: int
    steps: int
    lr: float
    clip_low: float
    clip_high: float
    kl_coef: float
    kl_estimator: str
    loss_agg: str
    normalize_std: bool
    ppo_epochs: int
    grad_clip: float
    max_response_tokens: int
    temperature: float
    top_p: float
    eval_every: int
    eval_k: int
    # None: evaluate at the training value (contract/recipe.evaluation_sampling).
    eval_temperature: float | None = None
    eval_top_p: float | None = None


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    weight: float = 1.0
    params: Mapping[str, Any] = field(default_factory=_empty)


@dataclass(frozen=True, slots=True)
class Reward:
    components: tuple[Component, ...]
    judges: tuple[Mapping[str, Any], ...] | None = None  # judge.schema.json, one per judge


@dataclass(frozen=True, slots=True)
class GroupFilter:
    """`group_filter`; absent, every group enters the loss."""

    name: str = "none"
    params: Mapping[str, Any] = field(default_factory=_empty)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    enabled: bool = True
    params: Mapping[str, Any] = field(default_factory=_empty)


@dataclass(frozen=True, slots=True)
class Environment:
    """`environment`: overrides of a multi-turn domain's default environment (None for a
    single-turn domain); what is absent here comes from the domain."""

    max_turns: int | None = None
    tools: tuple[Tool, ...] = ()


@dataclass(frozen=True, slots=True)
class Recipe:
    model: Model
    domain: Domain
    grpo: Grpo
    seeds: tuple[int, ...]
    reward: Reward
    backend: str = "local"
    group_filter: GroupFilter = GroupFilter()
    environment: Environment | None = None
    threads: int | str = 1  # or "auto": follow the machine's cores and load
    rollout: Mapping[str, Any] | None = None
    verl: Mapping[str, Any] | None = None
    # None: the trackers' default loggers (trackers.logger_names).
    loggers: tuple[str, ...] | None = None
    _resolved: Mapping[str, Any] = field(default_factory=_empty, repr=False, compare=False)

    @classmethod
    def from_dict(cls, resolved: dict[str, Any]) -> Recipe:
        """The typed recipe of a resolved recipe dict: EvoError naming the field for the first
        value the schema refuses, a field that must be present and is not, or a cross-field
        rule broken (clip_high below clip_low, a tiny model whose heads do not divide, ...)."""
        if not isinstance(resolved, dict):
            raise EvoError(f"a recipe is a mapping, got {type(resolved).__name__}",
                           hint="e.g. {grpo: {steps: 40}}")
        _raise(schema_problem(resolved, _validator(None), ""))
        values: dict[str, Any] = {}
        for item in fields(cls):
            value = resolved.get(item.name)
            if item.name.startswith("_") or (value is None and _optional(item)):
                continue
            if value is None:
                raise _missing(item.name)
            text = canonical_json(value)
            # Each section once per process: versions share most of them.
            _raise(_section_problem(item.name, text))
            if item.name == "model":
                # model.tiny matters only when the lineage starts from it: a recipe naming a
                # checkpoint may leave it partial or remove it.
                if base_model(value).kind != "tiny":
                    text = canonical_json({k: v for k, v in value.items() if k != "tiny"})
                elif not value.get("tiny"):
                    raise EvoError(
                        "missing from the resolved recipe: the lineage starts from the tiny "
                        "model",
                        field="model.tiny",
                        hint="remove the null that removes model.tiny, or set model.path or "
                        "model.package",
                    )
            values[item.name] = _typed_section(item.name, text)
        recipe = cls(**values)
        object.__setattr__(recipe, "_resolved", copy_tree(resolved))
        check_cross_fields(recipe)
        return recipe

    def as_dict(self) -> dict[str, Any]:
        """Exactly the resolved dict this recipe was built from (a copy: the recipe stays
        frozen), whose digest approvals bind."""
        return copy_tree(self._resolved)


def check_cross_fields(recipe: Recipe) -> None:
    """The rules that relate two fields of one recipe, which the schema cannot state."""
    g, model = recipe.grpo, recipe.model
    if g.clip_high < g.clip_low:
        raise EvoError(
            f"must be >= grpo.clip_low ({g.clip_low}), got {g.clip_high}",
            field="grpo.clip_high",
            hint="Clip-Higher widens the upper bound only: clip_high: 0.27 with clip_low: 0.20",
        )
    if g.prompts_per_step > recipe.domain.train_size:
        raise EvoError(
            f"exceeds domain.train_size ({recipe.domain.train_size})",
            field="grpo.prompts_per_step",
            hint="lower grpo.prompts_per_step or raise domain.train_size",
        )
    if model.path and model.package:
        raise EvoError(
            "model.path and model.package both name a checkpoint",
            field="model.package",
            hint="keep one of them (set the other to null)",
        )
    tiny = model.tiny
    if tiny is None:
        return
    if tiny.hidden_size % tiny.num_heads:
        raise EvoError("must be divisible by num_heads", field="model.tiny.hidden_size",
                       hint="e.g. hidden_size 128 with num_heads 4")
    if tiny.num_heads % tiny.num_kv_heads:
        raise EvoError("num_heads must be divisible by num_kv_heads",
                       field="model.tiny.num_kv_heads", hint="e.g. num_kv_heads = num_heads")


@cache
def _recipe_schema() -> dict[str, Any]:
    return specs.schema_file("recipe.schema.json")


@cache
def _validator(section: str | None) -> jsonschema.Draft202012Validator:
    """recipe.schema.json's validator for one top-level `section`, or (None) for the top
    level alone (which keys, of what shape); `$ref`s (rollout, judges) resolve offline
    through the specs' registry of every schema file."""
    schema = _recipe_schema()
    if section is None:
        schema = {**schema, "properties": dict.fromkeys(schema["properties"], True)}
    else:
        schema = {"$ref": f"{schema['$id']}#/properties/{section}"}
    return jsonschema.Draft202012Validator(schema, registry=specs.registry())


@lru_cache(maxsize=4096)
def _section_problem(section: str, text: str) -> EvoError | None:
    """The schema's first problem with top-level `section` (its canonical JSON `text`)."""
    return schema_problem(json.loads(text), _validator(section), section)


@lru_cache(maxsize=4096)
def _typed_section(section: str, text: str) -> Any:
    """The typed value of a schema-valid top-level `section`: frozen, so recipes share it."""
    return _convert(_hints(Recipe)[section], json.loads(text), section)


def _raise(problem: EvoError | None) -> None:
    """Raise a (possibly remembered) problem as a fresh error."""
    if problem is not None:
        raise EvoError(problem.message, field=problem.field, hint=problem.hint)


def _optional(item: Any) -> bool:
    return item.default is not MISSING or item.default_factory is not MISSING


def _missing(where: str) -> EvoError:
    return EvoError(
        "missing from the resolved recipe",
        field=where,
        hint="an override sets it to null, which removes it: remove that null to inherit "
        "the default",
    )


def _build(cls: type, data: dict[str, Any], path: str) -> Any:
    """An instance of dataclass `cls` from a schema-valid mapping: nested dataclasses,
    tuples for lists, read-only mappings for free-form parts. None counts as absent (an
    override's null removes a key)."""
    hints = _hints(cls)
    values = {}
    for item in fields(cls):
        if item.name.startswith("_"):
            continue
        where = f"{path}.{item.name}" if path else item.name
        value = data.get(item.name)
        if value is None:
            if not _optional(item):
                raise _missing(where)
            continue
        values[item.name] = _convert(hints[item.name], value, where)
    return cls(**values)


@cache
def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s field types, evaluated once (the annotations are strings)."""
    return get_type_hints(cls)


def _convert(kind: Any, value: Any, path: str) -> Any:
    origin = get_origin(kind)
    if origin in (Union, UnionType):
        options = [arg for arg in get_args(kind) if arg is not type(None)]
        # `str | tuple[str, ...]`: a list takes the tuple's side, anything else the other.
        fitting = [arg for arg in options if (get_origin(arg) is tuple) == isinstance(value, list)]
        return _convert((fitting or options)[0], value, path)
    if is_dataclass(kind):
        return _build(kind, value, path)
    if origin is tuple:
        item = get_args(kind)[0]
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is Mapping:
        return _frozen(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    return value
