"""A value checked against a JSON Schema fragment, its first problem explained in one line:
the field, what is allowed, what was given.

One explanation for every part of a recipe whose bounds a schema states: the recipe itself
(spec/schemas/recipe.schema.json), a domain's `params` (`Domain.params_schema`), a reward
component's and a group filter's `params`. It lives at the domains' layer, the lowest that
checks such a value, so a domain built outside a recipe check is held to its schema too.
"""

from __future__ import annotations

from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from evotrainer.errors import EvoError

_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "array": "a list",
    "object": "a mapping",
}


def allowed(schema: dict[str, Any]) -> str:
    """What `schema` allows, in words: `an integer from 1 to 4`, `one of: k1, k3`,
    `a number in (0, 1]`, `a list of (one of: +, -, *), at least 1`. A null, which in a
    recipe override removes a key, is left out: the value being checked is what remains."""
    if "enum" in schema:
        return "one of: " + ", ".join(str(v) for v in schema["enum"] if v is not None)
    if "const" in schema:
        return repr(schema["const"])
    for combinator in ("oneOf", "anyOf"):
        if combinator in schema:
            return " or ".join(allowed(sub) for sub in schema[combinator])
    types = schema.get("type", [])
    types = [t for t in ([types] if isinstance(types, str) else types) if t != "null"]
    words = " or ".join(_TYPE_WORDS.get(t, t) for t in types) or "a value"
    low, high = schema.get("minimum"), schema.get("maximum")
    low_open, high_open = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if low is not None and high is not None and types == ["integer"]:
        words += f" from {low} to {high}"
    elif (low is not None or low_open is not None) and (high is not None or high_open is not None):
        words += (f" in {'[' if low is not None else '('}{low if low is not None else low_open}, "
                  f"{high if high is not None else high_open}{']' if high is not None else ')'}")
    elif low is not None:
        words += f" >= {low}"
    elif low_open is not None:
        words += f" > {low_open}"
    elif high is not None:
        words += f" <= {high}"
    elif high_open is not None:
        words += f" < {high_open}"
    if "items" in schema and isinstance(schema["items"], dict):
        words += f" of ({allowed(schema['items'])})"
    if schema.get("minItems"):
        words += f", at least {schema['minItems']}"
    if schema.get("uniqueItems"):
        words += ", each once"
    return words


def field_path(prefix: str, path: Any) -> str:
    """`grpo.group_size`, `reward.components[1].name` below `prefix`."""
    out = prefix
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def schema_problem(
    value: Any, validator: jsonschema.protocols.Validator, prefix: str
) -> EvoError | None:
    """The first problem `validator` finds in `value` as an EvoError naming the field below
    `prefix`, what is allowed and (as the hint) the schema's own description when it has one;
    None when `value` is valid."""
    error = best_match(validator.iter_errors(value))
    if error is None:
        return None
    schema, path = error.schema, list(error.absolute_path)
    if error.validator == "additionalProperties":
        known = sorted(schema.get("properties", {}))
        key = next(k for k in error.instance if k not in schema.get("properties", {}))
        return EvoError(
            f"unknown key {key!r}",
            field=field_path(prefix, [*path, key]),
            hint=f"known keys: {', '.join(known)}" if known else "it takes none: remove it",
        )
    if error.validator == "required":
        missing = next(k for k in schema["required"] if k not in error.instance)
        return EvoError(
            f"missing {missing!r}",
            field=field_path(prefix, [*path, missing]),
            hint=f"set it to {allowed(schema.get('properties', {}).get(missing, {}))}",
        )
    if error.validator == "pattern":  # the regular expression helps nobody; its description
        return EvoError(f"{error.instance!r} lacks what it must contain",
                        field=field_path(prefix, path), hint=schema.get("description"))
    words = allowed(schema)
    return EvoError(
        f"must be {words}, got {error.instance!r}",
        field=field_path(prefix, path),
        hint=schema.get("description") or f"set it to {words}",
    )


# Validators by schema identity (the schema kept beside its validator, so its id is never
# reused): params schemas are class attributes, checked for every domain a process builds.
_VALIDATORS: dict[int, tuple[dict[str, Any], jsonschema.Draft202012Validator]] = {}


def check_params(params: dict[str, Any], schema: dict[str, Any], prefix: str) -> None:
    """Raise the first problem of `params` (a domain's, a reward component's) against its
    declared schema fragment, naming `<prefix>.<key>`."""
    if id(schema) not in _VALIDATORS:
        _VALIDATORS[id(schema)] = (schema, jsonschema.Draft202012Validator(schema))
    problem = schema_problem(params, _VALIDATORS[id(schema)][1], prefix)
    if problem is not None:
        raise problem
