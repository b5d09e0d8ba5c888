"""Readers for evidence on disk: rollout tables, per-step metrics and per-task score tables.

`read_rollouts` accepts a Parquet file, a directory of Parquet files, a run artifact
directory (holding `rollouts/*.parquet`) or a verl dump directory (`<step>.jsonl` files).
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Collection
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from evotrainer.errors import EvoError
from evotrainer.evidence.schema import ROLLOUT_SCHEMA, SCORE_SCHEMA
from evotrainer.evidence.steps import STEPS_SCHEMA

_STEP_FILE = re.compile(r"^\d+\.jsonl$")
# ROLLOUT_SCHEMA's tool_calls with each call's name and args dictionary-encoded.
_CODED = pa.dictionary(pa.int32(), pa.string())
ENCODED_TOOL_CALLS = pa.list_(pa.struct([("name", _CODED), ("args", _CODED)]))
SCORE_COLUMNS = [f.name for f in SCORE_SCHEMA if f.name != "version"]


def is_verl_dump(path: Path) -> bool:
    return path.is_dir() and any(_STEP_FILE.match(p.name) for p in path.iterdir())


def rollout_files(path: str | Path) -> list[Path]:
    """The Parquet files behind a rollout path (file, folder, or run artifact folder)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise EvoError("no such file or directory", where=str(path))
    folder = path / "rollouts" if (path / "rollouts").is_dir() else path
    files = sorted(folder.glob("*.parquet"))
    if not files:
        raise EvoError(
            "no rollout Parquet files here",
            where=str(path),
            hint="pass a .parquet file, a folder of them, a run artifact folder with rollouts/, "
            "or a verl dump folder of <step>.jsonl files",
        )
    return files


def read_rollouts(
    path: str | Path,
    *,
    split: str = "train",
    version: str | None = None,
    columns: Collection[str] | None = None,
    encoded_calls: bool = False,
) -> pa.Table:
    """Read rollouts into ROLLOUT_SCHEMA. For a verl dump, `split` and `version` (default: the
    folder name) label the rows; skipped corrupt lines are reported as a warning. `columns`
    (default: all) reads only those columns of Parquet files, which must still hold every
    column of the schema: decoding a column nobody reads (the prompt and response texts)
    costs as much as a scan of the rest. `encoded_calls` reads a Parquet file's tool-call
    names and args dictionary-encoded (ENCODED_TOOL_CALLS, not ROLLOUT_SCHEMA's type), as
    Parquet stores them: three times faster than decoding every call's strings, and the
    codes are what the tool-call analyzers compute first. A verl dump is always read whole
    and plain."""
    path = Path(path)
    if is_verl_dump(path):
        from evotrainer.evidence.verl import ingest_dump

        result = ingest_dump(path, version=version or path.name, split=split)
        if result.skipped:
            warnings.warn(result.skipped_summary(), stacklevel=2)
        return result.rollouts
    if columns is None and not encoded_calls:
        tables = [_conform(pq.read_table(f), ROLLOUT_SCHEMA, f) for f in rollout_files(path)]
    else:
        schema = pa.schema(
            [
                pa.field(f.name, ENCODED_TOOL_CALLS) if encoded_calls and f.name == "tool_calls"
                else f
                for f in ROLLOUT_SCHEMA
                if columns is None or f.name in columns
            ]
        )
        # Parquet's path of each string of a call (the list's item is named `element` there).
        encoded = [f"tool_calls.list.element.{name}" for name in ("name", "args")]
        tables = []
        for f in rollout_files(path):
            _check_columns(pq.read_schema(f).names, ROLLOUT_SCHEMA, f)
            read = pq.read_table(
                f, columns=schema.names, read_dictionary=encoded if encoded_calls else None
            )
            tables.append(_conform(read, schema, f))
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def encode_tool_calls(table: pa.Table) -> pa.Table:
    """`table` with its tool calls' names and args dictionary-encoded (ENCODED_TOOL_CALLS), as
    `read_rollouts(encoded_calls=True)` reads them from Parquet; a table without plain tool
    calls as it is. One hash pass over the names and one over the args, which the tool-call
    analyzers need anyway, and DuckDB then reads the calls as codes, not one string copy per
    call per query."""
    if "tool_calls" not in table.column_names:
        return table
    column = table.column("tool_calls")
    if column.type != ROLLOUT_SCHEMA.field("tool_calls").type:
        return table
    chunks = []
    for chunk in column.chunks:
        # A sliced chunk's `values` are its whole backing array: code only the slice's calls.
        offsets = chunk.offsets
        first = offsets[0].as_py()
        calls = chunk.values.slice(first, offsets[-1].as_py() - first)
        if first:
            offsets = pc.subtract(offsets, first)
        fields = [pc.dictionary_encode(pc.struct_field(calls, name)) for name in ("name", "args")]
        coded = pa.StructArray.from_arrays(
            fields, ["name", "args"], mask=calls.is_null() if calls.null_count else None
        )
        chunks.append(
            pa.ListArray.from_arrays(
                offsets, coded, mask=chunk.is_null() if chunk.null_count else None
            )
        )
    encoded = pa.chunked_array(chunks, ENCODED_TOOL_CALLS)
    return table.set_column(table.schema.get_field_index("tool_calls"), "tool_calls", encoded)


def read_steps(path: str | Path) -> pa.Table:
    path = Path(path)
    if not path.is_file():
        raise EvoError("no such steps file", where=str(path))
    return _conform(pq.read_table(path), STEPS_SCHEMA, path)


def find_steps(rollout_path: str | Path) -> Path | None:
    """`steps.parquet` beside a run artifact folder's rollouts, if any."""
    path = Path(rollout_path)
    for folder in (path, path.parent, path.parent.parent):
        if folder.is_dir() and (folder / "steps.parquet").is_file():
            return folder / "steps.parquet"
    return None


def read_scores(path: str | Path) -> pa.Table:
    """A per-task score table (csv or parquet; a run artifact folder means its scores.csv).

    Columns: seed, task_id, data_source, sample_idx, correct (and optionally version)."""
    path = Path(path)
    if path.is_dir():
        path = path / "scores.csv"
    if not path.is_file():
        raise EvoError(
            "no such score table",
            where=str(path),
            hint="pass a scores.csv / .parquet file or a run folder holding scores.csv",
        )
    if path.suffix == ".parquet":
        table = pq.read_table(path)
    else:
        types = {f.name: f.type for f in SCORE_SCHEMA}
        try:
            # Only an empty field is null (unscored): Arrow's default null tokens include
            # "nan", which would let a NaN correctness pass as "not scored".
            options = pacsv.ConvertOptions(column_types=types, null_values=[""])
            table = pacsv.read_csv(path, convert_options=options)
        except pa.ArrowInvalid as err:
            raise EvoError(f"unreadable score table: {err}", where=str(path)) from None
    keep_version = "version" in table.column_names
    schema = pa.schema([f for f in SCORE_SCHEMA if f.name != "version" or keep_version])
    table = _conform(table, schema, path)
    bad = first_bad_correct(table)
    if bad is not None:
        row, value = bad
        # A CSV row's line: the header is line 1 and our writers put one record per line.
        where = f"{path}:{row + 2}" if path.suffix != ".parquet" else f"{path} (row {row + 1})"
        raise EvoError(
            f"correct = {value} is not a score in [0, 1]",
            where=where,
            field="correct",
            hint="write each sample's correctness as a number from 0 to 1 (1 = correct), "
            "or leave it empty when the sample was not scored",
        )
    return table


def first_bad_correct(table: pa.Table) -> tuple[int, float] | None:
    """(row, value) of the first `correct` that is not null and not a finite number in
    [0, 1] (inf, nan, 1.5, -0.1), else None."""
    values = table.column("correct").to_numpy(zero_copy_only=False)
    valid = ~pc.is_null(table.column("correct")).to_numpy(zero_copy_only=False)
    with np.errstate(invalid="ignore"):
        bad = valid & ~((values >= 0) & (values <= 1))  # NaN compares false: bad
    if not bad.any():
        return None
    row = int(np.flatnonzero(bad)[0])
    return row, float(values[row])


def _check_columns(names: list[str], schema: pa.Schema, where: Path) -> None:
    missing = [name for name in schema.names if name not in names]
    if missing:
        raise EvoError(
            f"missing column(s) {', '.join(missing)}",
            where=str(where),
            hint=f"expected columns: {', '.join(schema.names)}",
        )


def _conform(table: pa.Table, schema: pa.Schema, where: Path) -> pa.Table:
    _check_columns(table.column_names, schema, where)
    table = table.select(schema.names)
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise EvoError(
            f"columns do not match the expected types: {err}",
            where=str(where),
            hint=f"expected schema: {schema}",
        ) from None


def file_digest(paths: list[Path]) -> str:
    """sha256 over the named files' bytes, in the given order."""
    outer = hashlib.sha256()
    for path in paths:
        inner = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                inner.update(block)
        outer.update(f"{path.name}:{inner.hexdigest()}\n".encode())
    return "sha256:" + outer.hexdigest()


def table_digest(*tables: pa.Table | None) -> str:
    """sha256 over the Arrow IPC stream of each table (chunks combined, so equal content
    with the same schema gives the same digest)."""
    outer = hashlib.sha256()
    for table in tables:
        if table is None:
            outer.update(b"none\n")
            continue
        # The stream goes straight into the hash: collecting it in one growing buffer first
        # (hundreds of MB for a large table) cost several times the hashing itself.
        sink = _HashSink()
        with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), table.schema) as writer:
            writer.write_table(table.combine_chunks())
        outer.update(sink.hash.digest())
    return "sha256:" + outer.hexdigest()


class _HashSink:
    """A write-only file object that hashes what is written to it."""

    closed = False

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def val_scores(rollouts: pa.Table) -> pa.Table:
    """The per-task score table of a version's latest validation step (per seed)."""
    import duckdb

    con = duckdb.connect()
    con.register("r", rollouts)
    scores = con.sql(
        """SELECT r.seed, task_id, data_source, sample_idx, correct FROM r
           JOIN (SELECT seed, max(step) AS step FROM r WHERE split = 'val' GROUP BY seed)
           USING (seed, step)
           WHERE split = 'val' AND correct IS NOT NULL
           ORDER BY r.seed, task_id, sample_idx"""
    ).to_arrow_table()
    con.close()
    return scores.cast(pa.schema([f for f in SCORE_SCHEMA if f.name != "version"]))
