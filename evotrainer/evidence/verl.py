"""Ingest verl 0.9.1 rollout / validation dumps (`<step>.jsonl`) and file-logger metrics,
counting samples and groups exactly as verl does.

Each dump line is one trajectory: `input`, `output`, `gts`, `score`, `step`, plus the reward
function's extra keys (legacy train and all validation dumps) and, in V1 dumps, a `uid`.
Two flavours (see tests/golden/verl, written by verl's own code):

- **V1** (`trainer.use_v1`, the default): `uid` = "{prompt_uid}_{session}_{index}". The prompt
  uid is the GRPO group and the session the sample. One session may produce several outputs;
  verl trains and validates on the final one (highest index) only, copying its score onto the
  earlier ones in validation dumps. So one row per session: the final output, with the
  earlier outputs in `extra.earlier_outputs` and the raw key in `extra.uid`.
- **legacy** (`RayPPOTrainer`): no uid. verl's group is the dataset row (a uuid per row,
  `repeat(n, interleave=True)`), so identical prompts are still separate groups, and
  `trainer.balance_batch` (on by default) reorders a train batch by length before the dump.
  A row's group is, in order: the dataset row `index` the reward function returned (ours
  does: exact in any order), its `task_id`, a raw uid; else, in a validation dump with the
  group size n known, n consecutive rows (validation is never balanced; each block must hold
  one prompt); else the prompt text. With n known, every legacy group whose size is not n is
  reported in `ambiguous` with its count (k×n rows: duplicate prompts merged), never guessed.

Known extra keys map to canonical columns; `reward` (verl's copy of the score in validation
dumps) is dropped; other numeric keys become reward components, the rest `extra`. No verl dump
has a length or truncation field: `derive_lengths` fills them from the checkpoint's tokenizer.
A corrupt or cut-off line is skipped and reported with its file and line number.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import duckdb
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from evotrainer.errors import EvoError
from evotrainer.evidence.columns import FINISH_REASONS
from evotrainer.evidence.hermes import hermes_tool_calls
from evotrainer.evidence.schema import ROLLOUT_SCHEMA, TOOL_CALL
from evotrainer.evidence.steps import STEPS_SCHEMA

_STEP_FILE = re.compile(r"^(\d+)\.jsonl$")
_BATCH_ROWS = 500_000
# A V1 key: {prompt_uid}_{session_id}_{output_index} (trainer_base splits it with rsplit("_", 2)).
_V1_KEY = r"^(.+)_([0-9]+)_([0-9]+)$"
_V1_TAIL = r"_([0-9]+)_([0-9]+)$"  # a V1 key's {session_id}_{output_index}
# Keys consumed by a canonical column; everything else is a reward component or `extra`.
_KNOWN = {
    "input",
    "output",
    "score",
    "reward",  # verl's validation copy of `score`, not a component
    "step",
    "uid",
    "acc",
    "num_turns",
    "tool_calls",
    "truncated",
    "finish_reason",
    "response_length",
    "data_source",
    "task_id",
    "index",
    "mean_logprob",
}
# The Dual-Level filter's level-1 marks (backends/verl_reward): about the trajectory, kept in
# `extra`, never a reward component although one is numeric.
_MARKS = {"evo_excluded", "evo_exclusion"}
LEGACY, V1 = "legacy", "v1"


@cache
def _database() -> duckdb.DuckDBPyConnection:
    """The DuckDB database every mapping shares, opened on first use: importing this module
    (every CLI command does) opens nothing."""
    return duckdb.connect()


@dataclass
class Skipped:
    file: str
    line: int
    reason: str


@dataclass
class IngestResult:
    rollouts: pa.Table
    files: int = 0
    bytes: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    # The dump flavours seen (legacy / v1), what was derived and how, and what is missing.
    flavours: list[str] = field(default_factory=list)
    derived: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    # Groups whose size is not verl's n (merged duplicate prompts, uneven groups), counted.
    ambiguous: list[str] = field(default_factory=list)
    earlier_outputs: int = 0  # V1 non-final outputs folded into their session's row
    restarted: bool = False  # read_new: a file was rewritten, these rows replace earlier ones

    def skipped_summary(self, limit: int = 10) -> str:
        where = ", ".join(f"{s.file}:{s.line} ({s.reason})" for s in self.skipped[:limit])
        more = f" and {len(self.skipped) - limit} more" if len(self.skipped) > limit else ""
        return f"skipped {len(self.skipped)} unreadable line(s): {where}{more}"

    def note(self, derived: list[str], missing: list[str]) -> None:
        self.derived += [d for d in derived if d not in self.derived]
        self.missing += [m for m in missing if m not in self.missing]

    def lengths_derived(self, tokenizer_dir: str | Path, response_length: int) -> None:
        """Record that `derive_lengths` filled the lengths the dump lacked."""
        self.missing = [m for m in self.missing if m not in ("response_tokens", "truncated")]
        self.note(
            [
                f"response_tokens, truncated: re-tokenized with {tokenizer_dir}, "
                f"truncated = tokens >= {response_length}"
            ],
            [],
        )


def ingest_dump(
    directory: str | Path,
    *,
    version: str,
    split: str,
    seed: int = 0,
    group_size: int | None = None,
) -> IngestResult:
    """Read every `<step>.jsonl` in `directory` into one ROLLOUT_SCHEMA table.

    `group_size` is verl's n for this split (`rollout.n` for train, `val_kwargs.n` for
    validation): it groups legacy rows that carry no task id by position."""
    if split not in ("train", "val"):
        raise EvoError(f"split must be train or val, not {split!r}", field="split")
    if group_size is not None and group_size < 1:
        raise EvoError(f"group size must be at least 1, not {group_size}", field="group_size")
    directory = Path(directory)
    files = sorted(
        (int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_FILE.match(p.name))
    )
    if not files:
        raise EvoError(
            "no <step>.jsonl files here",
            where=str(directory),
            hint="point at verl's trainer.rollout_data_dir or validation_data_dir",
        )
    result = IngestResult(rollouts=ROLLOUT_SCHEMA.empty_table())
    parsed = []
    for step, path in files:
        raw, skipped = read_jsonl(path)
        result.files += 1
        result.bytes += path.stat().st_size
        result.skipped.extend(skipped)
        parsed.append((step, path, raw))
    _map_files(parsed, version=version, split=split, seed=seed, group_size=group_size,
               result=result)
    return result


Offsets = dict[str, list[int]]  # dump file name: [bytes consumed, lines consumed]


def read_new(
    directory: str | Path,
    offsets: Offsets | None,
    *,
    version: str,
    split: str,
    seed: int = 0,
    group_size: int | None = None,
) -> tuple[IngestResult, Offsets]:
    """The rows of the lines written to `directory`'s `<step>.jsonl` files since `offsets`
    (None or {}: from the start), and the offsets to pass next time: a live run's dumps read
    where the last read stopped, new files whole and grown files from their byte offset.

    Only complete lines are read: a last line still being written (no newline yet) is left
    for the next read. Each file's new lines map as one file does in `ingest_dump`, which is
    exact for verl's writes (a dump file is written at once, whole groups, each V1 session's
    outputs together); rows of one legacy group split across two reads are numbered from 0
    in each. A file that shrank was rewritten: everything is read again from the start and
    `result.restarted` says the rows replace, rather than extend, what was read before."""
    if split not in ("train", "val"):
        raise EvoError(f"split must be train or val, not {split!r}", field="split")
    directory = Path(directory)
    offsets = {name: list(at) for name, at in (offsets or {}).items()}
    files = (
        sorted(
            (int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_FILE.match(p.name))
        )
        if directory.is_dir()
        else []
    )
    result = IngestResult(rollouts=ROLLOUT_SCHEMA.empty_table())
    sizes = {path.name: path.stat().st_size for _, path in files}
    if any(sizes.get(name, 0) < at[0] for name, at in offsets.items()):
        offsets, result.restarted = {}, True
    parsed = []
    for step, path in files:
        start, lines_before = offsets.get(path.name, [0, 0])
        if sizes[path.name] <= start:
            continue
        with path.open("rb") as handle:
            handle.seek(start)
            data = handle.read(sizes[path.name] - start)
        end = data.rfind(b"\n") + 1  # complete lines only
        if end == 0:
            continue
        raw, skipped = parse_jsonl(data[:end], str(path), first_line=lines_before + 1)
        lines = data.count(b"\n", 0, end)
        offsets[path.name] = [start + end, lines_before + lines]
        result.files += 1
        result.bytes += end
        result.skipped.extend(skipped)
        parsed.append((step, path, raw))
    _map_files(parsed, version=version, split=split, seed=seed, group_size=group_size,
               result=result)
    return result, offsets


def _map_files(
    parsed: list[tuple[int, Path, pa.Table]],
    *,
    version: str,
    split: str,
    seed: int,
    group_size: int | None,
    result: IngestResult,
) -> None:
    """Map parsed dump files (`(step, path, raw)`, in order) to ROLLOUT_SCHEMA rows in
    `result.rollouts`, files with one raw schema together."""
    tables = []
    batch: list[tuple[int, Path, pa.Table]] = []
    # A cursor: a connection of its own (registrations stay its own) to one shared database,
    # which takes longer to open than a small dump takes to map.
    con = _database().cursor()

    def flush() -> None:
        if batch:
            tables.append(
                _canonical(
                    con,
                    batch,
                    version=version,
                    split=split,
                    seed=seed,
                    group_size=group_size,
                    result=result,
                )
            )
            batch.clear()

    for step, path, raw in parsed:
        if not raw.num_rows:
            continue
        # Files with one raw schema map in one query: a query per small file costs more in
        # setup than in rows. A batch is bounded so the mapping's copies stay small.
        if batch and (
            raw.schema != batch[0][2].schema
            or sum(t.num_rows for _, _, t in batch) + raw.num_rows > _BATCH_ROWS
        ):
            flush()
        batch.append((step, path, raw))
    flush()
    con.close()
    if tables:
        result.rollouts = pa.concat_tables(tables)


def read_jsonl(path: Path) -> tuple[pa.Table, list[Skipped]]:
    """Parse a JSONL file: `parse_jsonl` over its bytes."""
    return parse_jsonl(path.read_bytes(), str(path))


def parse_jsonl(data: bytes, source: str, *, first_line: int = 1) -> tuple[pa.Table, list[Skipped]]:
    """JSONL bytes to one column per key, in order of first appearance. Each line is parsed
    with orjson; a line it refuses is read as json.loads reads it (NaN and Infinity, which
    verl's json.dumps writes for a nan score; a lone surrogate escape, kept as U+FFFD as bytes
    that are not UTF-8 are), and one neither reads, or that is not an object, is skipped and
    reported by line (`first_line` numbers the first one)."""
    records: list[dict] = []
    skipped: list[Skipped] = []
    for number, line in enumerate(split_lines(data), start=first_line):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            text = str(line, "utf-8", errors="replace")
            if not text.strip():
                continue
            try:
                record = _without_lone_surrogates(json.loads(text))
            except json.JSONDecodeError as err:
                skipped.append(Skipped(source, number, err.msg))
                continue
            except RecursionError:  # deeper than orjson's 1024 levels and Python's stack
                skipped.append(Skipped(source, number, "nested too deeply"))
                continue
        if not isinstance(record, dict):
            skipped.append(Skipped(source, number, "not a JSON object"))
            continue
        records.append(record)
    return _table_from_records(records), skipped


def split_lines(data: bytes) -> Iterator[memoryview]:
    """`data`'s lines, cut at "\\n" only (a JSON string may hold a raw U+2028, which
    splitlines() would cut), as views: slicing the bytes would copy every line."""
    view = memoryview(data)
    start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        if end < 0:
            end = len(data)
        yield view[start:end]
        start = end + 1


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_lone_surrogates(value: Any) -> Any:
    """json.loads keeps an escaped lone surrogate ("\\ud800"), which Arrow cannot store as
    UTF-8: U+FFFD in its place, in keys and values at any depth."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_lone_surrogates(v) for v in value]
    return value


def _table_from_records(records: list[dict]) -> pa.Table:
    """One column per key, in order of first appearance; a missing key is null."""
    keys = dict.fromkeys(records[0]) if records else {}
    uniform = True
    for record in records:
        if record.keys() != keys.keys():  # rare: most dumps write the same keys on every line
            keys.update(dict.fromkeys(record))
            uniform = False
    columns = {}
    for key in keys:
        # Column by column with itemgetter where every line has every key: twice as fast as
        # Table.from_pylist, which gathers each value with a Python-level dict.get.
        values = (
            list(map(itemgetter(key), records))
            if uniform
            else [record.get(key) for record in records]
        )
        try:
            columns[key] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            columns[key] = _mixed_column(values)
    return pa.table(columns)


def _mixed_column(values: list) -> pa.Array:
    """A key Arrow cannot type from its values. Numbers are doubles: an integer beyond int64
    (JSON sets no limit) is read as orjson reads one beyond 64 bits. Other mixed types are
    JSON text rather than dropped."""
    if all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
        try:
            return pa.array([None if v is None else float(v) for v in values], pa.float64())
        except OverflowError:  # an integer beyond any double: its exact digits as text
            pass
    return pa.array(
        [None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values],
        pa.string(),
    )


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _col(cols: set[str], name: str, cast: str, default: str = "NULL") -> str:
    """The raw key `name` as `cast` (null where a value does not cast), or `default` where the
    batch has no such key."""
    return f"TRY_CAST({_q(name)} AS {cast})" if name in cols else default


# The columns `_numbered` adds to a batch for the queries' own use.
_INTERNAL = {"__row", "__file", "__step", "__pos"}


@dataclass(frozen=True)
class _Census:
    """What a batch holds, counted in one scan: it decides which windows and joins its
    mapping needs."""

    rows: int
    legacy: int  # rows without a V1 key
    later_outputs: int  # V1 outputs after a session's first
    untasked: int  # rows without a task_id or index
    unkeyed: int  # legacy rows without a dataset row, task id or uid

    @property
    def all_legacy(self) -> bool:
        return self.legacy == self.rows


@dataclass(frozen=True)
class _Grouping:
    """A batch's groups and samples, as SQL over its `keyed` rows."""

    base: str  # the `parsed` and `grouped` CTEs: every row with its group and final flag
    earlier: str  # the CTE of V1 sessions' earlier outputs, "" where no session has any
    sample: str  # a row's sample index within its group
    positional: bool  # legacy rows without a key are grouped by their block of n rows
    numbered: bool  # two groups of a file may share a prompt: `_repeats` numbers them


def _canonical(
    con: duckdb.DuckDBPyConnection,
    files: list[tuple[int, Path, pa.Table]],
    *,
    version: str,
    split: str,
    seed: int,
    group_size: int | None,
    result: IngestResult,
) -> pa.Table:
    """Map the raw rows of one or more dump files (`(step, path, raw)` with one raw schema)
    to ROLLOUT_SCHEMA, file by file in the given order; notes go to `result`."""
    raw = _numbered(files)
    in_arrow = _texts_in_arrow(raw)
    keyed = _keyed(set(raw.column_names))
    repeats = pa.table({})
    # DuckDB sees the responses only where a query reads them (a session's earlier outputs):
    # a window or join carries every column of its input, and the responses are nearly all
    # of a dump's bytes.
    slim = raw.drop_columns(["output"]) if in_arrow["output"] else raw
    con.register("raw", slim)
    try:
        census = _census(con, keyed, raw.num_rows)
        if census.later_outputs and slim is not raw:
            con.unregister("raw")
            con.register("raw", raw)
        grouping = _grouping(con, raw, keyed, census, split=split, group_size=group_size)
        if grouping.numbered:
            repeats = _repeats(con, grouping)
        if repeats.num_rows:
            con.register("repeats", repeats)
        sql = _mapping_sql(raw, in_arrow, grouping, repeated=bool(repeats.num_rows))
        params = {"version": version, "seed": seed, "split": split}
        out = con.sql(sql, params=params).to_arrow_table()
    finally:
        con.unregister("raw")
        if repeats.num_rows:
            con.unregister("repeats")
    out = _in_row_order(out)
    _note(out, files, set(raw.column_names), group_size=group_size, split=split,
          positional=grouping.positional, result=result)
    return _with_texts(out, raw, in_arrow)


def _numbered(files: list[tuple[int, Path, pa.Table]]) -> pa.Table:
    """The batch's raw rows as one table, with the internal columns every query reads."""
    raw = pa.concat_tables([t for _, _, t in files]) if len(files) > 1 else files[0][2]
    for required in ("input", "output"):
        if required not in raw.column_names:
            raise EvoError(
                f"dump rows have no {required!r} key",
                field=required,
                hint="is this a verl rollout/validation dump?",
            )
    sizes = [t.num_rows for _, _, t in files]
    # __row orders rows file by file; __file keeps each file's groups and sample numbers to
    # itself; __step is the file's step for rows without a `step` key.
    raw = raw.append_column("__row", pa.array(np.arange(raw.num_rows, dtype=np.int64)))
    raw = raw.append_column("__file", pa.array(np.repeat(np.arange(len(files)), sizes)))
    raw = raw.append_column(
        "__step", pa.array(np.repeat(np.array([s for s, _, _ in files], dtype=np.int64), sizes))
    )
    # __pos: a row's place in its file, which is what a window numbering a file's rows in
    # order gives where every row of the batch is legacy, without the window's sort.
    starts = np.repeat(np.cumsum([0, *sizes[:-1]], dtype=np.int64), sizes)
    return raw.append_column(
        "__pos", pa.array(np.arange(raw.num_rows, dtype=np.int64) - starts)
    )


def _texts_in_arrow(raw: pa.Table) -> dict[str, bool]:
    """Which of prompt and response are text, taken by row in Arrow after the query (as
    they are when every row is kept in order), so the large strings never pass through
    DuckDB; DuckDB casts a column of another JSON type to text."""
    return {name: _is_text(raw.schema.field(name).type) for name in ("input", "output")}


def _is_text(type_: pa.DataType) -> bool:
    return pa.types.is_string(type_) or pa.types.is_large_string(type_)


def _keyed(cols: set[str]) -> str:
    """The query of every raw row with the keys its group is derived from: its uid (a V1 key
    or a legacy one), task id, dataset row, prompt hash, and whether it is V1."""
    uid = _col(cols, "uid", "VARCHAR")
    task = next((_col(cols, k, "VARCHAR") for k in ("task_id", "index") if k in cols), "NULL")
    # The dataset row a legacy row was sampled for (our reward function returns its `index`):
    # verl draws each row once per step and repeats it n times, so within a step file this is
    # verl's own group, wherever balance_batch moved the samples.
    dataset_row = f"'row:' || {_col(cols, 'index', 'VARCHAR')}" if "index" in cols else "NULL"
    # A V1 key's session and index are the two numbers at its end, its prompt uid the text
    # before them: read with a pattern without the leading `(.+)`, whose captures cost RE2
    # ten times as much. The prompt's key, which task and group ids are built from, is a
    # hash of its text.
    return f"""
        SELECT *, COALESCE(regexp_matches(__uid, '{_V1_KEY}'), false) AS __v1
        FROM (SELECT *, {uid} AS __uid, regexp_extract({uid}, '{_V1_TAIL}', ['s', 'i'])
                        AS __tail, {task} AS __task, {dataset_row} AS __dataset_row
                        , left(md5(CAST(input AS VARCHAR)), 16) AS __prompt
              FROM raw)
    """


def _census(con: duckdb.DuckDBPyConnection, keyed: str, rows: int) -> _Census:
    legacy, later_outputs, untasked, unkeyed = con.sql(
        f"""SELECT count(*) FILTER (WHERE NOT __v1),
                   count(*) FILTER (WHERE __v1 AND TRY_CAST(__tail.i AS BIGINT) > 0),
                   count(*) FILTER (WHERE __task IS NULL),
                   count(*) FILTER (WHERE NOT __v1 AND __dataset_row IS NULL
                                    AND __task IS NULL AND __uid IS NULL)
            FROM ({keyed})"""
    ).fetchall()[0]
    return _Census(rows, legacy, later_outputs, untasked, unkeyed)


def _grouping(
    con: duckdb.DuckDBPyConnection,
    raw: pa.Table,
    keyed: str,
    census: _Census,
    *,
    split: str,
    group_size: int | None,
) -> _Grouping:
    """Each row's group, by verl's rule for its flavour: a V1 row's prompt uid; a legacy
    row's dataset row, task id or uid; else its block of n rows (`_blocks`) or its prompt."""
    # A legacy row's place among its file's legacy rows: __pos where the batch has no V1
    # row, else numbered by a window.
    legacy_pos = (
        "__pos" if census.all_legacy
        else "(row_number() OVER (PARTITION BY __file, __v1 ORDER BY __row) - 1)"
    )
    blocks = _blocks(con, raw, keyed, census, split=split, group_size=group_size)
    unkeyed_group = (
        f"__prompt || '-' || ({legacy_pos} // {blocks.size})" if blocks is not None else "__prompt"
    )
    final, earlier = _v1_sessions(census)
    base = f"""
        parsed AS (
            SELECT *,
                   CASE WHEN __v1 THEN left(__uid, length(__uid) - length(__tail.s)
                                            - length(__tail.i) - 2) END AS __v1_group,
                   CASE WHEN __v1 THEN CAST(__tail.s AS BIGINT) END AS __session,
                   CASE WHEN __v1 THEN CAST(__tail.i AS BIGINT) END AS __index
            FROM ({keyed})
        ), grouped AS (
            SELECT *,
                   CASE WHEN __v1 THEN __v1_group
                        WHEN __dataset_row IS NOT NULL THEN __dataset_row
                        WHEN __task IS NOT NULL THEN __task
                        WHEN __uid IS NOT NULL THEN __uid
                        ELSE {unkeyed_group} END AS __group,
                   {final} AS __final
            FROM parsed
        )"""
    if blocks is not None and census.all_legacy and census.unkeyed == census.rows:
        # Every group is a block of n rows in place: a sample is its place in the block, and
        # a prompt is a repeat to number only where a file holds it in two blocks, which the
        # blocks' prompts tell without the numbering query.
        sample, numbered = f"__pos % {blocks.size}", blocks.repeated()
    else:
        sample, numbered = _sample(census), bool(census.untasked)
    return _Grouping(base, earlier, sample, positional=blocks is not None, numbered=numbered)


class _Blocks(NamedTuple):
    """The blocks of `size` (n) consecutive legacy rows of each file, in order: each one's
    prompt (a `_prompt_codes` code, -1 where none of its rows has a prompt) and file."""

    size: int
    prompts: np.ndarray
    files: np.ndarray

    def repeated(self) -> bool:
        """Does a file hold one prompt in two blocks?"""
        held = self.prompts >= 0
        # A block's file and prompt as one number, which np.unique compares in one pass.
        pairs = self.files[held] * (int(self.prompts.max()) + 1) + self.prompts[held]
        return np.unique(pairs).size < pairs.size


def _blocks(
    con: duckdb.DuckDBPyConnection,
    raw: pa.Table,
    keyed: str,
    census: _Census,
    *,
    split: str,
    group_size: int | None,
) -> _Blocks | None:
    """The blocks of n rows that legacy rows without a key are grouped by, or None where such
    rows are grouped by prompt text. Validation rows go by position: verl repeats each prompt
    n times in place and never balances a validation batch; each block is checked to hold
    one prompt. Train rows go by prompt: balance_batch reorders them by length before the
    dump, so n consecutive rows are not a group."""
    if not group_size or split != "val":
        return None
    size = int(group_size)
    if not census.unkeyed:  # every row has a key: no row is grouped by its block
        return _Blocks(size, np.empty(0, np.int64), np.empty(0, np.int64))
    legacy = (
        slice(None)
        if census.all_legacy
        else con.sql(f"SELECT __row FROM ({keyed}) WHERE NOT __v1 ORDER BY __row")
        .to_arrow_table()
        .column(0)
        .to_numpy()
    )
    prompts = _prompt_codes(con, raw)[legacy]
    files = raw.column("__file").to_numpy()[legacy]
    # A file's last block short of n rows, or a block holding two prompts: this dump is not
    # in verl's validation order (a balanced or re-sorted file), so position says nothing
    # here either.
    if (np.bincount(files) % size).any():
        return None
    # Every file's rows fill whole blocks, so the blocks are the rows n by n.
    by_block = prompts.reshape(-1, size)
    prompt = by_block.max(axis=1)
    # A row without a prompt (-1) mixes no block: its group key is null, not the block's.
    lowest = np.where(by_block < 0, prompt[:, None], by_block).min(axis=1)
    if (lowest != prompt).any():
        return None
    return _Blocks(size, prompt, files[::size])


def _prompt_codes(con: duckdb.DuckDBPyConnection, raw: pa.Table) -> np.ndarray:
    """Each row's prompt as a number, equal for equal prompt text (the text `__prompt`
    hashes) and -1 for none. Text is encoded in Arrow; DuckDB casts a column of another JSON
    type to text first, as it does for `__prompt`."""
    prompts = raw.column("input")
    if not _is_text(prompts.type):
        prompts = (
            con.sql("SELECT CAST(input AS VARCHAR) FROM raw ORDER BY __row")
            .to_arrow_table()
            .column(0)
        )
    # One dictionary for all the chunks, so a code means one text throughout the batch.
    encoded = pc.dictionary_encode(prompts)
    return np.concatenate([pc.fill_null(chunk.indices, -1).to_numpy() for chunk in encoded.chunks])


def _v1_sessions(census: _Census) -> tuple[str, str]:
    """Which rows are final (a V1 session's last output; a legacy row is its own final row,
    its __index NULL, which no max equals), and the CTE gathering each session's earlier
    outputs: both trivial where no session has a later output."""
    if not census.later_outputs:
        return "true", ""
    final = "NOT __v1 OR __index = max(__index) OVER (PARTITION BY __file, __v1_group, __session)"
    earlier = """, earlier AS (
            SELECT __file, __v1_group, __session,
                   list(CAST(output AS VARCHAR) ORDER BY __index) AS __earlier
            FROM grouped WHERE NOT __final GROUP BY ALL
        )"""
    return final, earlier


def _sample(census: _Census) -> str:
    """A row's sample index where its group is not a block in place: a V1 row's session,
    else its place in its group."""
    if not census.legacy:
        return "__session"
    return (
        "COALESCE(__session, row_number() OVER "
        "(PARTITION BY __file, __v1, __group ORDER BY __row) - 1)"
    )


def _repeats(con: duckdb.DuckDBPyConnection, grouping: _Grouping) -> pa.Table:
    """Groups with the same prompt text and no task id are numbered in file order, so
    duplicate prompts stay separate tasks: each repeat's file, group and number (from 1).
    Only the (few) repeats are joined back."""
    return con.sql(
        f"""WITH {grouping.base}, firsts AS (
                SELECT __file, __group, any_value(__prompt) AS __input,
                       min(__row) AS __first
                FROM grouped WHERE __task IS NULL GROUP BY ALL
            ), numbered AS (
                SELECT __file, __group, dense_rank() OVER
                       (PARTITION BY __file, __input ORDER BY __first) - 1
                       AS __occurrence
                FROM firsts
            )
            SELECT __file, __group, __occurrence FROM numbered WHERE __occurrence > 0"""
    ).to_arrow_table()


def _mapping_sql(
    raw: pa.Table, in_arrow: dict[str, bool], grouping: _Grouping, *, repeated: bool
) -> str:
    """The query of the canonical columns of every final row (`repeated`: the `repeats`
    table numbers duplicate prompts)."""
    occurrence = "COALESCE('.' || __occurrence, '')" if repeated else "''"
    joins = " LEFT JOIN earlier USING (__file, __v1_group, __session)" if grouping.earlier else ""
    joins += " LEFT JOIN repeats USING (__file, __group)" if repeated else ""
    components, extra = _components_and_extra(raw)
    if grouping.earlier:
        # A session's earlier outputs join its final row's `extra`.
        extra = (
            f"CASE WHEN __earlier IS NULL THEN {extra} ELSE CAST(json_merge_patch("
            f"COALESCE({extra}, '{{}}'), to_json(struct_pack(earlier_outputs := __earlier)))"
            " AS VARCHAR) END"
        )
    return f"""
        WITH {grouping.base}{grouping.earlier}
        SELECT $version AS version, $seed::BIGINT AS seed, $split AS split,
               COALESCE(__task, 'p' || __prompt || {occurrence}) AS task_id,
               __group AS group_id, {grouping.sample} AS sample_idx,
               {_value_columns(raw, in_arrow)}, {components} AS reward_components,
               {extra} AS extra, __row,
               __v1, __task IS NOT NULL AS __has_task,
               __dataset_row IS NOT NULL AS __has_row, __file,
               {"len(__earlier)" if grouping.earlier else "0"} AS __n_earlier
        FROM grouped{joins}
        WHERE __final
    """


def _value_columns(raw: pa.Table, in_arrow: dict[str, bool]) -> str:
    """The SELECT list of the columns read from a row's own keys."""
    cols = set(raw.column_names)
    texts = "".join(
        f"CAST({source} AS VARCHAR) AS {target}, "
        for source, target in (("input", "prompt"), ("output", "response"))
        if not in_arrow[source]
    )
    finish = (
        f"CASE WHEN CAST(finish_reason AS VARCHAR) IN {tuple(FINISH_REASONS)} "
        "THEN CAST(finish_reason AS VARCHAR) END"
        if "finish_reason" in cols
        else "NULL"
    )
    if "truncated" in cols:
        truncated = "TRY_CAST(truncated AS BOOLEAN)"
    elif "finish_reason" in cols:
        truncated = "CAST(finish_reason AS VARCHAR) = 'length'"
    else:
        truncated = "NULL"
    return f"""COALESCE({_col(cols, "step", "BIGINT")}, __step) AS step,
               {_col(cols, "data_source", "VARCHAR", "'unknown'")} AS data_source, {texts}
               {_col(cols, "score", "DOUBLE")} AS reward,
               {_col(cols, "acc", "DOUBLE")} AS correct,
               {_col(cols, "response_length", "BIGINT")} AS response_tokens,
               {truncated} AS truncated, {finish} AS finish_reason,
               {_col(cols, "num_turns", "BIGINT")} AS turns,
               {_col(cols, "mean_logprob", "DOUBLE")} AS mean_logprob"""


def _components_and_extra(raw: pa.Table) -> tuple[str, str]:
    """Reward components: the numeric keys nobody else claims. `extra`: the other unclaimed
    keys, and the raw V1 key (the uid) where there is one."""
    claimed = _KNOWN | _INTERNAL
    numeric = [
        f.name
        for f in raw.schema
        if f.name not in claimed | _MARKS
        and (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))
    ]
    rest = [n for n in raw.column_names if n not in claimed and n not in numeric]
    components = "MAP {}::MAP(VARCHAR, DOUBLE)"
    if numeric:
        entries = ", ".join(
            f"{{'key': '{n.replace(chr(39), chr(39) * 2)}', 'value': CAST({_q(n)} AS DOUBLE)}}"
            for n in numeric
        )
        components = f"map_from_entries(list_filter([{entries}], lambda e: e.value IS NOT NULL))"
    fields = [f"{_q(n)} := {_q(n)}" for n in rest]
    fields += ["uid := __uid"] if "uid" in raw.column_names else []
    extra = f"CAST(to_json(struct_pack({', '.join(fields)})) AS VARCHAR)" if fields else "NULL"
    return components, extra


def _in_row_order(out: pa.Table) -> pa.Table:
    """No ORDER BY: where no window or join reordered the rows, the scan's order stands,
    which is checked here instead of paying for a sort."""
    order = out.column("__row").to_numpy()
    if len(order) > 1 and not (order[1:] > order[:-1]).all():
        return out.sort_by("__row")
    return out


def _with_texts(out: pa.Table, raw: pa.Table, in_arrow: dict[str, bool]) -> pa.Table:
    """The mapped rows with the prompt and response texts taken from `raw` by row, and the
    tool calls, as ROLLOUT_SCHEMA."""
    rows = out.column("__row")
    every_row = out.num_rows == raw.num_rows  # unique rows in order: all of them, as they are
    for source, target in (("input", "prompt"), ("output", "response")):
        if in_arrow[source]:
            column = raw.column(source)
            out = out.append_column(target, column if every_row else column.take(rows))
    if "tool_calls" in raw.column_names:
        calls = pa.array(
            [_tool_calls(v) for v in raw.column("tool_calls").take(rows).to_pylist()],
            pa.list_(TOOL_CALL),
        )
    else:
        # A V1 train dump keeps no reward extra: the calls are read from the decoded text,
        # where verl leaves the hermes markup of a multi-turn episode (null when it has none).
        calls = _hermes_calls(out.column("response"))
    out = out.append_column("tool_calls", calls)
    return out.select(ROLLOUT_SCHEMA.names).cast(ROLLOUT_SCHEMA)


def _hermes_calls(responses: pa.ChunkedArray) -> pa.Array:
    """Each response's hermes tool calls (null where it has none). Only responses holding
    the opening tag are read in Python: RE2 finds them in one compiled pass, where turning
    every response into a Python string first cost more than the rest of the mapping."""
    marked = pc.fill_null(pc.match_substring_regex(responses, "<tool_call>"), False)
    calls: list[list[dict[str, str]] | None] = [None] * len(responses)
    if pc.any(marked).as_py():
        rows = np.flatnonzero(marked.to_numpy(zero_copy_only=False))
        for row, text in zip(rows, responses.take(pa.array(rows)).to_pylist(), strict=True):
            calls[row] = hermes_tool_calls(text) or None
    return pa.array(calls, pa.list_(TOOL_CALL))


def _note(
    out: pa.Table,
    files: list[tuple[int, Path, pa.Table]],
    cols: set[str],
    *,
    group_size: int | None,
    split: str,
    positional: bool,
    result: IngestResult,
) -> None:
    """Record the flavour, what was derived and what is missing, and with the group size
    known, every legacy group whose size is not n: never a silent guess."""
    v1 = out.column("__v1").to_numpy(zero_copy_only=False)
    has_task = out.column("__has_task").to_numpy(zero_copy_only=False)
    has_row = out.column("__has_row").to_numpy(zero_copy_only=False)
    derived, missing = [], []
    if v1.any():
        result.flavours += [V1] if V1 not in result.flavours else []
        derived.append("v1: group = prompt uid, sample = session from uid {uid}_{session}_{index}")
        folded = int(pc.sum(out.column("__n_earlier")).as_py() or 0)
        if folded:
            result.earlier_outputs += folded
            derived.append(
                "v1 multi-output sessions: final output kept (as verl counts), earlier ones "
                "in extra.earlier_outputs"
            )
    legacy = ~v1
    if legacy.any():
        result.flavours += [LEGACY] if LEGACY not in result.flavours else []
        if has_row[legacy].all():
            derived.append(
                "legacy: group = the dataset row (`index` returned by the reward function), "
                "exact in any order verl dumps the rows"
            )
        elif has_task[legacy].all():
            derived.append("legacy: group = task_id returned by the reward function")
        elif "uid" in cols:
            derived.append("legacy: group = uid")
        elif positional:
            derived.append(
                f"legacy validation: group = {group_size} consecutive rows (verl's n; "
                "validation batches are not balanced, and each block holds one prompt)"
            )
        else:
            if split == "train":
                why = "verl's balance_batch reorders train rows before the dump: n consecutive "
                why += "rows are not a group"
            elif group_size:
                why = f"blocks of {group_size} consecutive rows mix prompts: not verl's "
                why += "validation order for this n"
            else:
                why = "no group size to read validation rows by position"
            derived.append(f"legacy: group = identical prompt text in a step ({why})")
            if not group_size:
                missing.append(
                    "legacy group size: pass it (rollout.n / val_kwargs.n) to have every "
                    "group checked and duplicate prompts merged into one group reported"
                )
        if group_size:
            result.ambiguous += [
                a for a in _group_size_problems(out, legacy, group_size)
                if a not in result.ambiguous
            ]
    if "task_id" not in cols and "index" not in cols:
        missing.append("task_id (task = prompt text, numbered when repeated)")
    if "data_source" not in cols:
        missing.append("data_source")
    if "acc" not in cols:
        missing.append("correct (no acc key)")
    if "response_length" not in cols:
        missing.append("response_tokens")
    if "truncated" not in cols and "finish_reason" not in cols:
        missing.append("truncated")
    result.note(derived, missing)


def _group_size_problems(out: pa.Table, legacy: np.ndarray, group_size: int) -> list[str]:
    """Legacy groups (per file) of k×n rows, k ≥ 2 (duplicate prompts, or one dataset row
    drawn twice, in one step: verl had k groups, the dump cannot say which sample was
    whose), and of a size n does not divide (skipped lines, or n is not this dump's)."""
    groups = out.filter(pa.array(legacy)).group_by(["__file", "group_id"]).aggregate(
        [("group_id", "count")]
    )
    sizes = groups.column("group_id_count").to_numpy()
    merged = sizes[(sizes > group_size) & (sizes % group_size == 0)]
    uneven = sizes[sizes % group_size != 0]
    problems = []
    if merged.size:
        problems.append(
            f"{merged.size} group(s) of a multiple of n = {group_size} rows ("
            + _size_counts(merged)
            + "): duplicate prompts in one step that the dump cannot tell apart, each kept "
            "as one group"
        )
    if uneven.size:
        problems.append(
            f"{uneven.size} group(s) whose size n = {group_size} does not divide ("
            + _size_counts(uneven)
            + "): skipped lines, or n is not this dump's rollout.n / val_kwargs.n"
        )
    return problems


def _size_counts(sizes: np.ndarray) -> str:
    values, counts = np.unique(sizes, return_counts=True)
    return ", ".join(f"{c} of {v} rows" for v, c in zip(values, counts, strict=True))


def derive_lengths(table: pa.Table, tokenizer_dir: str | Path, response_length: int) -> pa.Table:
    """Fill null `response_tokens` by re-tokenizing each response with the checkpoint's
    tokenizer, and null `truncated` as `response_tokens >= response_length`.

    verl decodes responses with skip_special_tokens, so a response that ended with EOS inside
    the budget re-encodes to fewer tokens than the limit, and one cut at the limit to exactly
    the limit (up to the tokenizer's round trip of the decoded text)."""
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise EvoError(
            "no tokenizer here: derived lengths need the checkpoint's local directory",
            where=str(path),
            field="model.path",
        )
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (ImportError, OSError, ValueError) as err:
        raise EvoError(
            f"cannot load the tokenizer: {err}", where=str(path), field="model.path"
        ) from None
    responses = table.column("response").to_pylist()
    counts = [
        len(ids)
        for ids in tokenizer([r or "" for r in responses], add_special_tokens=False)["input_ids"]
    ]
    tokens = pc.coalesce(table.column("response_tokens"), pa.array(counts, pa.int64()))
    cut = pc.greater_equal(tokens, pa.scalar(int(response_length), pa.int64()))
    truncated = pc.coalesce(table.column("truncated"), cut)
    table = table.set_column(
        table.schema.get_field_index("response_tokens"), "response_tokens", tokens
    )
    return table.set_column(table.schema.get_field_index("truncated"), "truncated", truncated)


def _tool_calls(value: Any) -> list[dict] | None:
    """`[{name, args}]` or `["name args"]` (or a JSON string of either) to `[{name, args}]`."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, list):
        return None
    calls = []
    for call in value:
        if isinstance(call, dict):
            args = call.get("args", call.get("arguments"))
            if args is not None and not isinstance(args, str):
                args = json.dumps(args, sort_keys=True)
            calls.append({"name": str(call.get("name", "")), "args": args or ""})
        elif isinstance(call, str):
            name, _, args = call.strip().partition(" ")
            calls.append({"name": name, "args": args})
    return calls


def read_metrics_log(
    path: str | Path, *, version: str, seed: int = 0
) -> tuple[pa.Table, list[Skipped]]:
    """verl's file logger (`{"step": N, "data": {...}}` per line) to the long steps table.
    Non-numeric values are left out; unreadable lines are skipped and returned."""
    path = Path(path)
    rows: dict[str, list] = {name: [] for name in STEPS_SCHEMA.names}
    skipped: list[Skipped] = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
                data = record["data"]
                if not isinstance(data, dict):
                    raise TypeError
            except json.JSONDecodeError as err:
                skipped.append(Skipped(str(path), number, err.msg))
                continue
            except (KeyError, TypeError, ValueError):
                skipped.append(Skipped(str(path), number, 'not a {"step": N, "data": {...}} line'))
                continue
            for metric, value in data.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    rows["version"].append(version)
                    rows["seed"].append(seed)
                    rows["step"].append(step)
                    rows["metric"].append(metric)
                    rows["value"].append(float(value))
    return pa.table(rows, schema=STEPS_SCHEMA), skipped
