"""CEL expressions (alerts, gate rules, skill triggers): compile once, evaluate over plain dicts.

Values go in as plain Python (None, bool, int, float, str, lists, dicts) and come out the
same way. CEL does not mix int and double in arithmetic (`2 * x` fails for a double `x`;
write `2.0 * x`), but comparisons across the two work. `evaluate_unless_null` is the
evaluation alerts, gate rules, triggers and criteria use: a null or absent value leaves the
expression undecided (None) instead of failing.

Expressions come from branches and pull requests (harness revisions, skills, criteria), and
some are evaluated before anyone reviews them (`pr harness-summary`), so each is bounded:
at most MAX_CHARS characters, macros (`all`, `exists`, `map`...) nested at most MAX_NESTING
deep, a syntax tree at most MAX_DEPTH levels deep, and at most MAX_STEPS evaluation steps
(syntax-tree nodes visited, a macro's body once per element) per evaluation. Nested macros
multiply: four nested `.all()` over 20-element lists are 160,000 iterations, about a minute
of work for one alert.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import importlib.metadata
import json
import os
import sys
from dataclasses import dataclass
from functools import cached_property, lru_cache, partial
from pathlib import Path
from typing import Any

import celpy
import lark
from celpy import celtypes
from celpy.evaluation import Evaluator, celstr
from lark import Token, Tree

from evotrainer.errors import EvoError

MAX_CHARS = 1000
MAX_NESTING = 2
# Syntax-tree levels: celpy evaluates by recursion and runs out of Python frames near 550.
MAX_DEPTH = 250
# About half a second of celpy's tree walking; the built-in expressions need under a hundred.
MAX_STEPS = 50_000

# Macros whose first argument binds a loop variable rather than naming an input (celpy's
# `reduce` binds two: `xs.reduce(r, x, init, expr)`).
_MACROS = {"all", "exists", "exists_one", "map", "filter", "reduce"}


class CostExceeded(EvoError):
    """An evaluation ran past MAX_STEPS: raised through celpy, never turned into a value."""


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_STEPS


class _BoundedEvaluator(Evaluator):
    """celpy's interpreter, counting every node it visits (a macro's body once per element)
    against one budget shared with the macros' own evaluators."""

    def __init__(self, ast: Tree, activation: Any, budget: _Budget) -> None:
        super().__init__(ast, activation)
        self.budget = budget

    def _visit_tree(self, tree: Tree) -> Any:
        self.budget.left -= 1
        if self.budget.left < 0:
            raise CostExceeded(
                f"evaluation took more than {MAX_STEPS:,} steps",
                hint="nest fewer macros (all, exists, map, filter) or iterate shorter lists",
            )
        return super()._visit_tree(tree)

    def sub_evaluator(self, ast: Tree) -> _BoundedEvaluator:
        return _BoundedEvaluator(ast, self.activation, self.budget)


class _BoundedRunner(celpy.InterpretedRunner):
    def evaluate(self, context: Any) -> Any:
        return _BoundedEvaluator(self.ast, self._base, _Budget()).evaluate(context)

    @cached_property
    def _base(self) -> Any:
        """The environment's activation, built once per program (a third of a short
        expression's evaluation): each evaluation works on a clone of it
        (Evaluator.set_activation), never on it."""
        return self.new_activation()


@lru_cache(maxsize=1)
def _env() -> celpy.Environment:
    """celpy's environment, built on first use: building its parser's tables costs a quarter
    of a second, which a command that evaluates no expression should not pay. The tables are
    kept in the user's cache folder (`parser_cache`) and read back by later processes in a
    few hundredths of a second."""
    cache = parser_cache()
    if cache is None or (cache.exists() and not _private(cache)):
        return celpy.Environment(runner_class=_BoundedRunner)
    try:
        lock = open(cache.with_name(cache.name + ".lock"), "a")  # noqa: SIM115 - held below
    except OSError:
        return celpy.Environment(runner_class=_BoundedRunner)
    with lock:
        # Lark reads and writes its cache file in place: one process at a time, so none reads
        # a file another is writing.
        fcntl.flock(lock, fcntl.LOCK_EX)
        environment = _with_lark_cache(cache)
        # Lark writes the file under the process's umask: kept this user's alone, so a group
        # -writable umask does not leave a file the next process refuses to read.
        with contextlib.suppress(OSError):
            cache.chmod(0o600)
        return environment


def _with_lark_cache(path: Path) -> celpy.Environment:
    """celpy's environment, its Lark parser built with lark's `cache` option: celpy builds
    the parser with options of its own and offers no way to add one, so this one option is
    added for this one construction. Lark loads the file only when it holds the digest of
    celpy's grammar, these options (the path included) and the versions of lark and Python;
    else (no file, another digest, a file cut short) it builds the tables and writes them
    there."""
    from celpy import celparser

    lark_class = celparser.Lark
    celparser.Lark = partial(lark_class, cache=str(path))
    try:
        return celpy.Environment(runner_class=_BoundedRunner)
    finally:
        celparser.Lark = lark_class


def parser_cache() -> Path | None:
    """The file that keeps the CEL parser's tables: one per version of celpy, lark and
    Python under $XDG_CACHE_HOME/evotrainer (default ~/.cache/evotrainer). None where that
    folder cannot be made, or where another user could write to it: the parser is then built
    in memory."""
    try:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "evotrainer"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (OSError, RuntimeError, KeyError):  # no home folder, or one not writable
        return None
    if not _private(folder):
        return None
    python = "{}.{}".format(*sys.version_info[:2])
    return folder / f"cel-parser-celpy-{_celpy_version()}-lark-{lark.__version__}-py{python}"


def _private(path: Path) -> bool:
    """Whether only this user can change `path`: its owner, with no write bit for group or
    others. Lark unpickles the cache file, so one that another user could have written (or
    replaced, through its folder) would run their code here."""
    try:
        status = path.stat()
    except OSError:
        return False
    return status.st_uid == os.geteuid() and not status.st_mode & 0o022


def _celpy_version() -> str:
    try:
        return importlib.metadata.version("cel-python")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - celpy not installed
        return "unknown"


@lru_cache(maxsize=1024)
def _compile(expr: str) -> tuple[Any, frozenset[str]]:
    if not isinstance(expr, str) or not expr.strip():
        raise EvoError("empty CEL expression", hint="write a condition such as `x > 0.5`")
    if len(expr) > MAX_CHARS:
        raise EvoError(
            f"CEL expression of {len(expr):,} characters (at most {MAX_CHARS:,}): "
            f"{expr[:60]!r}…",
            hint="split the condition over several alerts or rules",
        )
    try:
        ast = _env().compile(expr)
    except celpy.CELParseError as err:
        raise EvoError(
            f"invalid CEL expression {expr!r}: {' '.join(str(err).split())}",
            hint="see https://github.com/google/cel-spec for the syntax",
        ) from None
    depth, nesting = _shape(ast)
    if depth > MAX_DEPTH:
        raise EvoError(f"CEL expression {expr[:60]!r}… is nested too deeply ({depth} levels, "
                       f"at most {MAX_DEPTH})", hint="write it with fewer nested parentheses")
    if nesting > MAX_NESTING:
        raise EvoError(
            f"CEL expression {expr!r} nests {nesting} macros (all, exists, map, filter...) "
            f"inside each other; at most {MAX_NESTING}",
            hint="each nested macro multiplies the work by a list's length: test fewer "
            "combinations, or compute the value as a metric",
        )
    return _env().program(ast), frozenset(_free_names(ast))


def _is_macro(node: Tree) -> bool:
    return (
        node.data == "member_dot_arg"
        and len(node.children) == 3
        and isinstance(node.children[1], Token)
        and str(node.children[1]) in _MACROS
    )


def _shape(ast: Tree) -> tuple[int, int]:
    """(depth of the syntax tree, how many macros its deepest path passes through), walked
    without recursion: the bound exists because celpy's own walk recurses."""
    depth = nesting = 0
    stack: list[tuple[Tree, int, int]] = [(ast, 1, 0)]
    while stack:
        node, level, macros = stack.pop()
        macros += _is_macro(node)
        depth, nesting = max(depth, level), max(nesting, macros)
        stack += [(child, level + 1, macros) for child in node.children
                  if isinstance(child, Tree)]
    return depth, nesting


def _free_names(node: Tree | Token | None, bound: frozenset[str] = frozenset()) -> set[str]:
    """Names `node` reads from its inputs. A macro's loop variable (`x` in `xs.all(x, ...)`)
    is bound only inside that macro's body, so nested macros and a later top-level `x` are
    both read correctly."""
    if not isinstance(node, Tree):
        return set()
    if node.data == "ident":
        name = str(node.children[0])
        return set() if name in bound else {name}
    if _is_macro(node) and node.children[2] is not None:
        target, method, args = node.children
        variables = args.children[:2] if str(method) == "reduce" else args.children[:1]
        inner = set(bound)
        for variable in variables:
            idents = list(variable.find_data("ident"))
            if len(idents) == 1:
                inner.add(str(idents[0].children[0]))
        found = _free_names(target, bound)
        for part in args.children[len(variables):]:
            found |= _free_names(part, frozenset(inner))
        return found
    found: set[str] = set()
    for child in node.children:
        found |= _free_names(child, bound)
    return found


def members_tested(expr: str, name: str) -> frozenset[str] | None:
    """The strings `expr` tests for membership in the list `name` (`'leak' in critical`),
    where that is all it reads of `name`; None where it reads `name` otherwise (its size,
    an element, a macro over it, the list itself)."""
    tested: set[str] = set()
    covered: set[int] = set()
    ast = _compile(expr)[0].ast
    for node in ast.iter_subtrees():
        if node.data == "relation" and len(node.children) == 2 and \
                isinstance(node.children[0], Tree) and node.children[0].data == "relation_in":
            member, collection = _wrapped(node.children[0].children[0]), \
                _wrapped(node.children[1])
            if _is_ident(collection, name) and isinstance(member, Tree) and \
                    member.data == "literal" and member.children[0].type in _STRING_LITERALS:
                tested.add(str(celstr(member.children[0])))
                covered.add(id(collection))
    read = [node for node in ast.iter_subtrees() if _is_ident(node, name)]
    return frozenset(tested) if all(id(node) in covered for node in read) else None


_STRING_LITERALS = {"STRING_LIT", "MLSTRING_LIT"}


def _wrapped(node: Tree | Token) -> Tree | Token:
    """The node a chain of one-child nodes wraps (`addition → … → primary → ident`)."""
    while isinstance(node, Tree) and node.data not in ("ident", "literal") and \
            len(node.children) == 1:
        node = node.children[0]
    return node


def _is_ident(node: Tree | Token, name: str) -> bool:
    return isinstance(node, Tree) and node.data == "ident" and str(node.children[0]) == name


def fields_read(expr: str, name: str) -> frozenset[str] | None:
    """The fields `expr` reads of the map `name` (`latest.mean_logprob`), where that is all
    it reads of `name`; None where it reads `name` otherwise (the map itself, its size, an
    index, a macro over it)."""
    return _fields_read(expr).get(name)


@lru_cache(maxsize=1024)
def _fields_read(expr: str) -> dict[str, frozenset[str] | None]:
    """fields_read of every name `expr` reads."""
    ast = _compile(expr)[0].ast
    fields: dict[str, set[str]] = {}
    covered: set[int] = set()
    for node in ast.iter_subtrees():
        if node.data == "member_dot" and isinstance(node.children[1], Token):
            target = _wrapped(node.children[0])
            if isinstance(target, Tree) and target.data == "ident":
                fields.setdefault(str(target.children[0]), set()).add(str(node.children[1]))
                covered.add(id(target))
    read: dict[str, frozenset[str] | None] = {}
    for node in ast.iter_subtrees():
        if node.data == "ident":
            name = str(node.children[0])
            if id(node) not in covered or read.get(name, frozenset()) is None:
                read[name] = None
            else:
                read[name] = frozenset(fields[name])
    return read


def check(expr: str) -> None:
    """Raise EvoError when `expr` is not a valid CEL expression."""
    _compile(expr)


def names(expr: str) -> frozenset[str]:
    """The top-level variable names `expr` reads (macro loop variables excluded)."""
    return _compile(expr)[1]


def evaluate(expr: str, variables: dict[str, Any]) -> Any:
    """Evaluate `expr` with `variables`; raise EvoError when evaluation fails.

    An evaluation depends on the expression and the values it reads alone (of a map read
    only as `map.field`, those fields), so the same expression over the same values is
    evaluated once (the last few thousand kept, failures too): a replay of early stops
    evaluates each alert and rule at every recorded step of a run, for two revisions whose
    alerts mostly agree. A chain of `&&` or `||` is decided by its operands where they
    decide it, each kept alike (`_decided_by_an_operand`): a rule `rows >= 100 &&
    latest.dead >= 1.0` reads its second operand's kept false at most steps."""
    used = _used(expr, variables)
    return _evaluated(expr, variables, used, _key(expr, used))


def _evaluated(expr: str, variables: dict[str, Any], used: dict[str, Any],
               key: tuple[str, str] | None) -> Any:
    """`evaluate`, with what `expr` reads of `variables` and its key already made."""
    if key is None:
        return _evaluate(expr, used)
    result = _EVALUATED.get(key, _NOT_KEPT)
    if result is _NOT_KEPT:
        try:
            result = _decided_by_an_operand(expr, variables)
            if result is None:
                result = _evaluate(expr, used)
        except EvoError as err:  # a failure, as a value, depends on nothing else either
            result = _Failed(err)
        if len(_EVALUATED) >= _KEPT:
            _EVALUATED.clear()
        _EVALUATED[key] = result
    if isinstance(result, _Failed):
        raise copy.copy(result.error)
    return copy.deepcopy(result) if isinstance(result, (list, dict)) else result


@dataclass(frozen=True)
class _Failed:
    """A kept evaluation that failed: each read raises a copy of its error."""

    error: EvoError


def _fields_of(value: Any, fields: frozenset[str] | None) -> Any:
    """A map cut to `fields` (keys as CEL names them: strings), where only those are read."""
    if fields is None or type(value) is not dict:
        return value
    return {key: item for key, item in value.items() if str(key) in fields}


def _decided_by_an_operand(expr: str, variables: dict[str, Any]) -> bool | None:
    """`expr`'s value where it is a chain of `&&` or of `||` (`_operands`) and its operands
    decide it: one false (`&&`) or true (`||`) decides it whatever the others are, errors
    included, as CEL's commutative `&&` and `||` do; all true (`&&`) or all false (`||`)
    decide it too. None where an operand fails or is no bool: the whole is evaluated.
    Operands whose results are kept go first, so a step's `rows >= 100 && latest.dead >= 1.0`
    is decided by the second operand's kept false without evaluating the first."""
    chain = _operands(expr)
    if chain is None:
        return None
    operands, decisive = chain
    reads = [(operand, used, _key(operand, used))
             for operand in operands for used in [_used(operand, variables)]]
    reads.sort(key=lambda read: read[2] not in _EVALUATED)  # kept ones first, else in order
    decided = True
    for operand, used, key in reads:
        try:
            value = _evaluated(operand, variables, used, key)
        except EvoError:
            decided = False
            continue
        if value is decisive:
            return decisive
        decided = decided and value is (not decisive)
    return (not decisive) if decided else None


def _key(expr: str, used: dict[str, Any]) -> tuple[str, str] | None:
    """What an evaluation is kept under: the expression and the values it reads as JSON;
    None where JSON does not tell those values apart (`_json_exact`)."""
    return (expr, json.dumps(used)) if _json_exact(used) else None


def _used(expr: str, variables: dict[str, Any]) -> dict[str, Any]:
    """What `expr` reads of `variables`, by name in sorted order (the order of the names
    does not change a value, so it does not change the key): a diagnosis passes every
    metric to every alert, and a rule that reads two of `latest`'s metrics reads those two."""
    return {key: _fields_of(variables[key], fields_read(expr, key))
            for key in _names_in_order(expr) if key in variables}


@lru_cache(maxsize=1024)
def _names_in_order(expr: str) -> tuple[str, ...]:
    """`names(expr)`, sorted."""
    return tuple(sorted(names(expr)))


@lru_cache(maxsize=1024)
def _operands(expr: str) -> tuple[tuple[str, ...], bool] | None:
    """The operands' texts of `expr` where it is a chain of two or more operands joined by
    `&&` (with False, the value any one operand decides it with) or by `||` (True), with no
    macro anywhere (a macro over a null raises rather than fails as a value, and the whole
    must then raise); None for any other expression."""
    ast = _compile(expr)[0].ast
    if len(ast.children) != 1 or _shape(ast)[1]:  # a conditional `a ? b : c`, or a macro
        return None
    node = ast.children[0]  # conditionalor
    kind, decisive = "conditionalor", True
    if len(node.children) == 1:
        node, kind, decisive = node.children[0], "conditionaland", False
    if node.data != kind or len(node.children) != 2:
        return None
    operands = []
    while node.data == kind and len(node.children) == 2:
        operands.append(node.children[1])
        node = node.children[0]
    operands.append(node)
    spans = [(getattr(o.meta, "start_pos", None), getattr(o.meta, "end_pos", None))
             for o in reversed(operands)]
    # The operands' texts must be the whole expression cut at its operators (the parser
    # leaves some literals, `false` among them, without a position).
    if any(not isinstance(at, int) for span in spans for at in span):
        return None
    cuts = [0, *(at for span in spans for at in span), len(expr)]
    between = [expr[start:end].strip() for start, end in zip(cuts[::2], cuts[1::2], strict=True)]
    operator = "||" if decisive else "&&"
    if between[0] or between[-1] or any(gap != operator for gap in between[1:-1]):
        return None
    return tuple(expr[start:end] for start, end in spans), decisive


# (expression, its values as JSON): the result. Emptied when full: what a replay repeats is
# the last few steps' values. Each read and write is one dict operation, safe across threads.
_EVALUATED: dict[tuple[str, str], Any] = {}
_KEPT = 8192
_NOT_KEPT = object()


def _json_exact(value: Any) -> bool:
    """Whether `value`'s JSON text tells it apart from every value CEL would receive
    otherwise (_to_cel): None, booleans, ints, floats and strings of exactly those types,
    lists and tuples (a CEL list either way) of them, maps with string keys."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    if type(value) in (list, tuple):
        return all(_json_exact(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _json_exact(v) for k, v in value.items())
    return False


def _evaluate(expr: str, variables: dict[str, Any]) -> Any:
    program, _ = _compile(expr)
    activation = {key: _to_cel(value) for key, value in variables.items()}
    try:
        return _from_cel(program.evaluate(activation))
    except celpy.CELEvalError as err:
        raise EvoError(f"CEL expression {expr!r} failed: {err.args[0]}") from None
    except TypeError as err:  # celpy's macros over a value of another type (null.filter)
        raise EvoError(f"CEL expression {expr!r} failed: {err}") from None
    except CostExceeded as err:
        raise CostExceeded(f"CEL expression {expr!r}: {err.message}", hint=err.hint) from None


def evaluate_unless_null(expr: str, variables: dict[str, Any]) -> Any:
    """`expr` over `variables`, or None when it cannot be decided because a name it reads is
    null or absent, or is a map of metrics (`parent`, `trend`) that may lack the entry read:
    a null metric never fires an alert or a trigger, decides a gate rule or holds a
    criterion. `||` with one true side still holds. Any other failure (a typo in `params`
    included: the harness defines every param) raises."""
    referenced = names(expr)
    bound = {**dict.fromkeys(referenced), **variables}
    try:
        return evaluate(expr, bound)
    except CostExceeded:
        raise  # past the evaluation budget: an error, never "undecided"
    except EvoError:
        if any(
            bound[name] is None or (isinstance(bound[name], dict) and name != "params")
            for name in referenced
        ):
            return None
        raise


def holds(expr: str, variables: dict[str, Any], *, where: str, field: str) -> bool:
    """Whether `expr` holds over `variables` (`evaluate_unless_null` is True: a null never
    holds); an evaluation error names `where` and `field` (a harness revision's alert level
    or gate rule)."""
    try:
        return evaluate_unless_null(expr, variables) is True
    except EvoError as err:
        raise EvoError(err.message, where=where, field=field) from None


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
