"""Loading and validating EvoTrainer YAML documents.

YAML is loaded with the safe loader only. Every problem becomes an `EvoError` that names the
file, line and column, the field path, what was expected, and a hint — unknown keys are
rejected with a "did you mean ..." when a known key is close.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import yaml

from evotrainer import API_VERSION
from evotrainer.errors import EvoError
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.halves import map_in_halves

if TYPE_CHECKING:  # imported where a document is checked: a listing reads specs without them
    import jsonschema
    import referencing

KINDS = ("Project", "PolicyVersion", "HarnessRevision", "Skill", "Run", "Diagnosis", "Decision")
# CEL expressions a document holds, by kind: each is parsed and held to CEL's bounds wherever
# the document is read (`version new`, `validate`, `plan` alike), so a syntax error is never
# mistaken later for a metric that is null. A harness revision's expressions are checked by
# its own loader (diagnosis/harness.py), with the metric names it defines.
EXPRESSIONS = {
    "PolicyVersion": (("intervention", "hypothesis", "criterion"),),
    "Skill": (("trigger",), ("criterion",)),
}
SCHEMA_FILES = {
    "Project": "project",
    "PolicyVersion": "policy-version",
    "HarnessRevision": "harness-revision",
    "Skill": "skill",
    "Run": "run",
    "Diagnosis": "diagnosis",
    "Decision": "decision",
}

Path_ = tuple[Any, ...]
# libyaml's safe loader when present: parsing hundreds of version specs stays fast.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# Bounds on every YAML document read (specs, harness revisions, skills, run records): real
# ones are a few KiB, tens of levels deep, with at most a few hundred values.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 64


@dataclass
class Document:
    """A parsed YAML document and where each of its fields came from."""

    data: Any
    source: str  # shown in errors: a path, or `ref:path` for a file read from git
    # field path → (line, column), 1-based; None: found from `raw` when first asked. Only a
    # problem's position reads them, so a valid document never pays for them.
    _marks: dict[Path_, tuple[int, int]] | None = None
    raw: bytes | str | None = field(default=None, repr=False)

    @property
    def marks(self) -> dict[Path_, tuple[int, int]]:
        if self._marks is None:
            self._marks = positions(self.raw, self.source) if self.raw is not None else {}
        return self._marks

    def where(self, path: Path_ = ()) -> str:
        # The closest enclosing field that has a position.
        for cut in range(len(path), -1, -1):
            if path[:cut] in self.marks:
                line, col = self.marks[path[:cut]]
                return f"{self.source}:{line}:{col}"
        return self.source


@cache
def schema_modeline(doc_path: str, kind: str) -> str:
    """The first line of every document EvoTrainer writes: `# yaml-language-server:
    $schema=...`, relative to `doc_path` (workspace-relative), so an editor checks the file
    against `kind`'s schema as the reader will."""
    up = "../" * doc_path.count("/")
    return f"# yaml-language-server: $schema={up}spec/schemas/{SCHEMA_FILES[kind]}.schema.json\n"


def schema(kind: str) -> dict:
    return schema_file(f"{SCHEMA_FILES[kind]}.schema.json")


def schema_file(name: str) -> dict:
    return json.loads((builtin_dir("spec/schemas") / name).read_text())


@cache
def registry() -> referencing.Registry:
    """Every schema under spec/schemas by its `$id`, so `"$ref": "recipe.schema.json"` (the
    one recipe contract) and `common.schema.json#/$defs/name` resolve offline."""
    import referencing

    resources = [
        referencing.Resource.from_contents(schema_file(path.name))
        for path in sorted(builtin_dir("spec/schemas").glob("*.schema.json"))
    ]
    return referencing.Registry().with_resources((r.id(), r) for r in resources)


@cache
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    """`kind`'s validator, built once a process: every document of a kind is checked by it."""
    import jsonschema

    return jsonschema.Draft202012Validator(schema(kind), registry=registry())


def _resolved(kind: str, subschema: dict) -> dict:
    """`subschema` with a `$ref` followed (relative to `kind`'s schema), its own keys kept."""
    if "$ref" not in subschema:
        return subschema
    target = registry().resolver(base_uri=schema(kind)["$id"]).lookup(subschema["$ref"])
    return {**target.contents, **{k: v for k, v in subschema.items() if k != "$ref"}}


def rule_files() -> list[Path]:
    """The files a document's validity depends on besides its bytes: every schema and the
    code that checks it (this module, and CEL's for the expressions it holds)."""
    here = Path(__file__).resolve()
    return [here, here.parent / "cel.py",
            *sorted(builtin_dir("spec/schemas").glob("*.schema.json"))]


@cache
def rules_digest() -> str:
    """The digest of `rule_files`, byte for byte. A file that is not there is hashed as
    absent rather than raising: a read error here would switch the checked-spec cache off
    without a word (its readers treat OSError as a miss)."""
    digest = hashlib.sha256(API_VERSION.encode())
    for path in rule_files():
        data = path.read_bytes() if path.is_file() else b"\0absent\0"
        digest.update(path.name.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()[:16]


def cached_valid(raw: bytes, source: str, kind: str, folder: Path) -> Document | None:
    """The document `raw` is, when these very bytes were checked valid as `kind` before,
    under these schemas and this code (`remember_valid_many`); None otherwise (parse and
    check it). The key is the content's digest, never a name: other bytes are other
    entries."""
    packed = _packs(str(folder), kind, rules_digest())
    data = packed.get(hashlib.sha256(raw).hexdigest()) if packed else None
    return None if data is None else Document(data, source, None, raw)


def json_text(data: Any) -> bytes:
    """`data` as JSON with sorted keys (TypeError where it is not JSON)."""
    return orjson.dumps(data, option=orjson.OPT_SORT_KEYS)


_PACK = "pack"
_MAX_PACKS = 8


@cache
def _packs(folder: str, kind: str, rules: str) -> dict[str, Any]:
    """Every entry of `folder`'s packs of `kind` under `rules`, by content digest: read once
    a process, as one file each, where a file per document cost a write (and a read) each.
    A pack that does not read is a miss, never an error."""
    entries: dict[str, Any] = {}
    for path in sorted(Path(folder).glob(f"{kind}-{rules}-{_PACK}-*.json")):
        try:
            data = orjson.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            entries.update(data)
    return entries


def remember_valid_many(docs: list[tuple[Document, bytes]], kind: str, folder: Path) -> None:
    """Record that each `raw` of `docs` checked valid as `kind`, with its data, for
    `cached_valid`: all in one file (a pack), as a file each cost the first check of
    thousands of version specs thousands of writes. Only data JSON keeps exactly is kept (a
    YAML date, say, would come back a string). Past _MAX_PACKS packs, this one takes in the
    others' entries and they go."""
    entries = {}
    for doc, raw in docs:
        try:
            kept = orjson.loads(orjson.dumps(doc.data)) == doc.data
        except TypeError:  # not JSON at all (a mapping keyed by a number, say)
            kept = False
        if kept:
            entries[hashlib.sha256(raw).hexdigest()] = doc.data
    if not entries:
        return
    rules = rules_digest()
    older = sorted(folder.glob(f"{kind}-{rules}-{_PACK}-*.json"))
    if len(older) >= _MAX_PACKS:
        entries = {**_packs(str(folder), kind, rules), **entries}
    else:
        older = []
    text = orjson.dumps(entries, option=orjson.OPT_SORT_KEYS)
    name = f"{kind}-{rules}-{_PACK}-{hashlib.sha256(text).hexdigest()}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=folder, delete=False, suffix=".tmp") as out:
            out.write(text)
        os.replace(out.name, folder / name)
        for path in older:
            if path.name != name:
                path.unlink(missing_ok=True)
    except OSError:
        pass  # a cache that cannot be written is only slower
    _packs.cache_clear()


def parse(text: bytes | str, source: str) -> Document:
    """Parse one YAML document safely; reject duplicate keys. Its positions are found from
    `text` when a problem first asks for one (`Document.marks`)."""
    return Document(_load_bounded(text, source, unique_keys=True)[1], source, None, text)


def parse_many(items: Sequence[tuple[bytes, str]]) -> list[Document | None]:
    """`parse` of each (text, source); None for a text that does not parse (`validate`
    parses it again to say why). Thousands of specs are parsed in two halves at once."""
    parsed = map_in_halves(_parsed_data, items)
    return [Document(data, source, None, raw) if ok else None
            for (ok, data), (raw, source) in zip(parsed, items, strict=True)]


def _parsed_data(items: Sequence[tuple[bytes, str]]) -> list[tuple[bool, Any]]:
    out: list[tuple[bool, Any]] = []
    for raw, source in items:
        try:
            out.append((True, parse(raw, source).data))
        except EvoError:
            out.append((False, None))
    return out


def positions(text: bytes | str, source: str) -> dict[Path_, tuple[int, int]]:
    """(line, column) of every field of the document `text`, by field path; a key's own
    position under (*path, key, "<key>")."""
    node = _load_bounded(text, source, unique_keys=True)[0]
    marks: dict[Path_, tuple[int, int]] = {}
    if node is not None:
        _collect_marks(node, (), marks, source)
    return marks


def load_yaml(text: bytes | str, source: str) -> Any:
    """The data of one YAML document, read safely and within the size and alias bounds.

    For readers that need no positions (run records, listing specs); raises `EvoError`."""
    return _load_bounded(text, source)[1]


def _load_bounded(
    text: bytes | str, source: str, unique_keys: bool = False
) -> tuple[yaml.Node | None, Any]:
    """Compose once, check the bounds on the node graph (and, with `unique_keys`, that no
    mapping repeats a key), then construct the data from it.

    Aliases share nodes, so a 600-byte "billion laughs" document composes instantly but
    expands to billions of values in everything that walks the data afterwards: the
    expanded size is counted on the graph before anything is constructed."""
    size = len(text.encode("utf-8") if isinstance(text, str) else text)
    if size > MAX_YAML_BYTES:
        raise EvoError(
            f"document is {size} bytes, more than the {MAX_YAML_BYTES} allowed", where=source,
            hint="specs and records are small; move data into files the spec names",
        )
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EvoError(
                f"not valid UTF-8 (byte {exc.start})", where=source,
                hint="save the file as UTF-8",
            ) from None
    loader = SAFE_LOADER(text)  # the safe loader: no arbitrary objects
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        repeats = _check_expansion(node, source)
        data = loader.construct_document(node)
        if unique_keys and repeats:
            _collect_marks(node, (), {}, source)  # raises the first repeated key, with its field
        return node, data
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise EvoError(
            f"malformed YAML: {exc.problem or exc.context}", where=where,
            hint="check indentation, colons and quoting at that position",
        ) from None
    except yaml.YAMLError as exc:
        raise EvoError(f"malformed YAML: {exc}", where=source) from None
    except RecursionError:  # the pure-Python composer on very deep nesting
        raise EvoError(f"YAML nested deeper than {MAX_YAML_DEPTH} levels", where=source) from None
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node, source: str) -> bool:
    """Reject recursive aliases, nesting deeper than MAX_YAML_DEPTH, and documents whose
    aliases expand to more than MAX_YAML_NODES nodes. Shared nodes are counted once per
    reference (as every consumer of the data will see them) but measured only once.
    Whether some mapping repeats a key: the same walk finds it, `_collect_marks` says where."""
    expanded: dict[int, int] = {}  # id(node) → size of its expanded subtree
    on_path: set[int] = set()
    repeats = False

    def where(node: yaml.Node) -> str:
        return f"{source}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


    def measure(node: yaml.Node, depth: int) -> int:
        if id(node) in expanded:
            return expanded[id(node)]
        if id(node) in on_path:
            raise EvoError("recursive YAML alias (an anchor used inside itself)",
                           where=where(node), hint="write the value out instead")
        if depth > MAX_YAML_DEPTH:
            raise EvoError(f"YAML nested deeper than {MAX_YAML_DEPTH} levels", where=where(node))
        nonlocal repeats
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
            keys = [key.value for key in children[::2] if type(key) is yaml.ScalarNode]
            repeats = repeats or len(set(keys)) < len(keys)
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        on_path.add(id(node))
        total = 1
        # A scalar within the depth bound counts one and holds nothing to walk: most nodes
        # are scalars, so they are counted here rather than each in a call of its own.
        leaf_depth = depth < MAX_YAML_DEPTH
        for child in children:
            total += 1 if leaf_depth and type(child) is yaml.ScalarNode else measure(
                child, depth + 1)
            if total > MAX_YAML_NODES:
                raise EvoError(
                    f"YAML expands to more than {MAX_YAML_NODES} values through its aliases",
                    where=where(node),
                    hint="anchors and aliases (&x, *x) may not multiply the document; "
                    "write the values out",
                )
        on_path.discard(id(node))
        expanded[id(node)] = total
        return total

    measure(root, 0)
    return repeats


def _collect_marks(node: yaml.Node, path: Path_, marks: dict, source: str) -> None:
    marks[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                line, col = key_node.start_mark.line + 1, key_node.start_mark.column + 1
                raise EvoError(
                    f"duplicate key {key!r}", where=f"{source}:{line}:{col}",
                    field=dotted_field(path + (key,)), hint="keep only one of the two entries",
                )
            seen.add(key)
            marks[path + (key, "<key>")] = (
                key_node.start_mark.line + 1, key_node.start_mark.column + 1,
            )
            _collect_marks(value_node, path + (key,), marks, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _collect_marks(item, path + (i,), marks, source)


def dotted_field(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


def check(doc: Document, kind: str | None = None) -> list[EvoError]:
    """All schema problems of a document, in document order."""
    data = doc.data
    if not isinstance(data, dict):
        return [EvoError("expected a mapping at the top level", where=doc.where(),
                         hint=f"start the file with `apiVersion: {API_VERSION}` and `kind:`")]
    found = data.get("kind")
    if kind is None:
        if found not in KINDS:
            return [EvoError(f"unknown kind {found!r}", where=doc.where(("kind",)), field="kind",
                             hint=f"one of {', '.join(KINDS)}")]
        kind = found
    elif found != kind:
        return [EvoError(f"expected kind {kind!r}, found {found!r}", where=doc.where(("kind",)),
                         field="kind", hint=f"set `kind: {kind}`")]
    errors = sorted(_validator(kind).iter_errors(data), key=lambda e: _order(doc, e))
    problems = [_explain(doc, kind, e) for e in _most_specific(errors)] if errors else []
    return problems or _expression_problems(doc, kind)


def check_many(docs: Sequence[Document], kind: str) -> list[list[EvoError]]:
    """`check` of each document as `kind`, thousands in two halves at once. A half checked
    elsewhere answers only which documents have a problem; those are checked again here
    for their problems (a valid document, the usual case, is checked once)."""
    flagged = map_in_halves(partial(_has_problems, kind=kind), docs)
    return [check(doc, kind) if bad else [] for doc, bad in zip(docs, flagged, strict=True)]


def _has_problems(docs: Sequence[Document], kind: str) -> list[bool]:
    return [bool(check(doc, kind)) for doc in docs]


def _expression_problems(doc: Document, kind: str) -> list[EvoError]:
    problems = []
    for path in EXPRESSIONS.get(kind, ()):
        expr: Any = doc.data
        for part in path:
            expr = expr.get(part) if isinstance(expr, dict) else None
        if expr is None:
            continue
        from evotrainer.store import cel  # only a spec with an expression pays for CEL

        try:
            cel.check(expr)
        except EvoError as err:
            problems.append(EvoError(err.message, where=doc.where(path),
                                     field=dotted_field(path), hint=err.hint))
    return problems


def recipe_problems(doc: Document) -> list[EvoError]:
    """Schema problems of a bare recipe document (`evotrainer train FILE`), explained as in a
    project or version spec: the one recipe schema, through the same registry and wording
    (a Project's `recipe:` is a `$ref` to it, so refs resolve alike)."""
    import jsonschema

    recipe_schema = _resolved("Project", {"$ref": "recipe.schema.json"})
    validator = jsonschema.Draft202012Validator(recipe_schema, registry=registry())
    errors = sorted(validator.iter_errors(doc.data), key=lambda e: _order(doc, e))
    return [_explain(doc, "Project", e) for e in _most_specific(errors)]


def load(path: Path, kind: str | None = None, *, source: str | None = None) -> Document:
    """Read, parse and validate one file; raise the first problem."""
    source = source or str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise EvoError("file not found", where=source) from None
    return load_text(raw, source, kind)


def load_text(raw: bytes | str, source: str, kind: str | None = None) -> Document:
    doc = parse(raw, source)
    problems = check(doc, kind)
    if problems:
        raise problems[0]
    return doc


def _order(doc: Document, error: jsonschema.ValidationError) -> tuple:
    line_col = doc.marks.get(tuple(error.absolute_path), (0, 0))
    return (*line_col, str(error.message))


def _most_specific(errors: list[jsonschema.ValidationError]) -> list[jsonschema.ValidationError]:
    """For oneOf/anyOf failures report the best-matching branch's error, once per field."""
    from jsonschema.exceptions import best_match

    out, seen = [], set()
    for error in errors:
        if error.context:
            error = best_match(error.context)
        key = (tuple(error.absolute_path), error.validator)
        if key not in seen:
            seen.add(key)
            out.append(error)
    return out


def _explain(doc: Document, kind: str, error: jsonschema.ValidationError) -> EvoError:
    path = tuple(error.absolute_path)
    field = dotted_field(path)
    value = error.instance
    schema_ = error.schema
    if error.validator == "additionalProperties":
        allowed = sorted(schema_.get("properties", {}))
        extra = [k for k in value if k not in schema_.get("properties", {})]
        key = extra[0]
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
        return EvoError(f"unknown key {key!r}", where=doc.where(path + (key, "<key>")),
                        field=dotted_field(path + (key,)), hint=hint)
    if error.validator == "required":
        missing = error.message.split("'")[1]
        return EvoError(f"missing required field {missing!r}", where=doc.where(path),
                        field=dotted_field(path + (missing,)), hint=_describe(
                            _resolved(kind, schema_.get("properties", {}).get(missing, {}))))
    if error.validator in ("enum", "const"):
        options = schema_.get("enum", [schema_.get("const")])
        close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1)
        hint = f"did you mean {close[0]!r}?" if close else None
        return EvoError(
            f"expected one of {', '.join(map(repr, options))}, got {value!r}",
            where=doc.where(path), field=field, hint=hint)
    if error.validator == "type":
        return EvoError(f"expected {_describe(schema_)}, got {_json_type(value)} {value!r}",
                        where=doc.where(path), field=field)
    if error.validator == "pattern" and schema_.get("description"):
        # The regular expression itself helps nobody; its description says what is allowed.
        return EvoError(f"invalid value {value!r}", where=doc.where(path), field=field,
                        hint=schema_["description"])
    return EvoError(error.message, where=doc.where(path), field=field,
                    hint=schema_.get("description"))


def _describe(schema_: dict) -> str:
    kind = schema_.get("type")
    if isinstance(kind, list):
        kind = " or ".join(kind)
    text = kind or "a value"
    return f"{text} ({schema_['description']})" if schema_.get("description") else text


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "mapping", type(None): "null"}.get(type(value), type(value).__name__)


def dump(data: Any) -> str:
    """Stable, human-diffable YAML for records committed to git."""
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False,
                          width=100)
