"""CEL expressions (alerts, gate rules, skill triggers): compile once, evaluate over plain dicts.

Values go in as plain Python (None, bool, int, float, str, lists, dicts) and come out the
same way. CEL does not mix int and double in arithmetic (`2 * x` fails for a double `x`;
write `2.0 * x`), but comparisons across the two work.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import celpy
from celpy import celtypes
from lark import Token, Tree

from evotrainer.errors import EvoError

_ENV = celpy.Environment()
# Macros whose first argument binds a loop variable rather than naming an input.
_MACROS = {"all", "exists", "exists_one", "map", "filter"}


@lru_cache(maxsize=1024)
def _compile(expr: str) -> tuple[Any, frozenset[str]]:
    if not isinstance(expr, str) or not expr.strip():
        raise EvoError("empty CEL expression", hint="write a condition such as `x > 0.5`")
    try:
        ast = _ENV.compile(expr)
    except celpy.CELParseError as err:
        raise EvoError(
            f"invalid CEL expression {expr!r}: {' '.join(str(err).split())}",
            hint="see https://github.com/google/cel-spec for the syntax",
        ) from None
    return _ENV.program(ast), frozenset(_free_names(ast))


def _free_names(node: Tree | Token | None, bound: frozenset[str] = frozenset()) -> set[str]:
    """Names `node` reads from its inputs. A macro's loop variable (`x` in `xs.all(x, ...)`)
    is bound only inside that macro's body, so nested macros and a later top-level `x` are
    both read correctly."""
    if not isinstance(node, Tree):
        return set()
    if node.data == "ident":
        name = str(node.children[0])
        return set() if name in bound else {name}
    if node.data == "member_dot_arg" and len(node.children) == 3:
        target, method, args = node.children
        if isinstance(method, Token) and str(method) in _MACROS and args is not None:
            variable, *body = args.children
            idents = list(variable.find_data("ident"))
            inner = bound | {str(idents[0].children[0])} if len(idents) == 1 else bound
            found = _free_names(target, bound)
            for part in body:
                found |= _free_names(part, inner)
            return found
    found: set[str] = set()
    for child in node.children:
        found |= _free_names(child, bound)
    return found


def check(expr: str) -> None:
    """Raise EvoError when `expr` is not a valid CEL expression."""
    _compile(expr)


def names(expr: str) -> frozenset[str]:
    """The top-level variable names `expr` reads (macro loop variables excluded)."""
    return _compile(expr)[1]


def evaluate(expr: str, variables: dict[str, Any]) -> Any:
    """Evaluate `expr` with `variables`; raise EvoError when evaluation fails."""
    program, read = _compile(expr)
    # Only what the expression reads: a diagnosis passes every metric to every alert.
    activation = {key: _to_cel(value) for key, value in variables.items() if key in read}
    try:
        return _from_cel(program.evaluate(activation))
    except celpy.CELEvalError as err:
        raise EvoError(f"CEL expression {expr!r} failed: {err.args[0]}") from None


def _to_cel(value: Any) -> Any:
    if value is None:
        return celtypes.NullType()
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    if isinstance(value, dict):
        return celtypes.MapType({celtypes.StringType(k): _to_cel(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return celtypes.ListType([_to_cel(v) for v in value])
    raise EvoError(f"cannot pass a {type(value).__name__} to a CEL expression")


def _from_cel(value: Any) -> Any:
    if isinstance(value, celtypes.NullType):
        return None
    if isinstance(value, celtypes.BoolType):
        return bool(value)
    if isinstance(value, (celtypes.IntType, celtypes.UintType)):
        return int(value)
    if isinstance(value, celtypes.DoubleType):
        return float(value)
    if isinstance(value, celtypes.StringType):
        return str(value)
    if isinstance(value, celtypes.MapType):
        return {_from_cel(k): _from_cel(v) for k, v in value.items()}
    if isinstance(value, celtypes.ListType):
        return [_from_cel(v) for v in value]
    return value
