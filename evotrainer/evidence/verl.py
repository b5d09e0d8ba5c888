"""Ingest verl 0.9.1 rollout / validation dumps (`<step>.jsonl`) and file-logger metrics.

Each dump line is one trajectory: `input`, `output`, `gts`, `score`, `step`, and in V1 a
`uid` = "{prompt_uid}_{session_id}_{index}" (prompt_uid is the GRPO group); older dumps have
no uid, so a group is the set of identical `input` strings within a step. Known extra keys
map to canonical columns; other numeric keys become reward components, the rest `extra`.
A corrupt or cut-off line is skipped and reported with its file and line number.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from evotrainer.errors import EvoError
from evotrainer.evidence.schema import FINISH_REASONS, ROLLOUT_SCHEMA, TOOL_CALL
from evotrainer.evidence.steps import STEPS_SCHEMA

_STEP_FILE = re.compile(r"^(\d+)\.jsonl$")
_BATCH_ROWS = 500_000
# Keys consumed by a canonical column; everything else is a reward component or `extra`.
_KNOWN = {
    "input",
    "output",
    "score",
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

    def skipped_summary(self, limit: int = 10) -> str:
        where = ", ".join(f"{s.file}:{s.line} ({s.reason})" for s in self.skipped[:limit])
        more = f" and {len(self.skipped) - limit} more" if len(self.skipped) > limit else ""
        return f"skipped {len(self.skipped)} unreadable line(s): {where}{more}"


def ingest_dump(directory: str | Path, *, version: str, split: str, seed: int = 0) -> IngestResult:
    """Read every `<step>.jsonl` in `directory` into one ROLLOUT_SCHEMA table."""
    if split not in ("train", "val"):
        raise EvoError(f"split must be train or val, not {split!r}", field="split")
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
    tables = []
    batch: list[tuple[int, pa.Table]] = []
    con = duckdb.connect()

    def flush() -> None:
        if batch:
            tables.append(_canonical(con, batch, version=version, split=split, seed=seed))
            batch.clear()

    for step, path in files:
        raw, skipped = read_jsonl(path)
        result.files += 1
        result.bytes += path.stat().st_size
        result.skipped.extend(skipped)
        if not raw.num_rows:
            continue
        # Files with one raw schema map in one query: a query per small file costs more in
        # setup than in rows. A batch is bounded so the mapping's copies stay small.
        if batch and (
            raw.schema != batch[0][1].schema
            or sum(t.num_rows for _, t in batch) + raw.num_rows > _BATCH_ROWS
        ):
            flush()
        batch.append((step, raw))
    flush()
    con.close()
    if tables:
        result.rollouts = pa.concat_tables(tables)
    return result


def read_jsonl(path: Path) -> tuple[pa.Table, list[Skipped]]:
    """Parse a JSONL file with Arrow; on any error fall back to line by line to find the bad
    lines (and to tolerate keys whose type changes between lines)."""
    if path.stat().st_size == 0:
        return pa.table({}), []
    try:
        return pajson.read_json(path), []
    except pa.ArrowInvalid:
        pass
    records: list[dict] = []
    skipped: list[Skipped] = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                skipped.append(Skipped(str(path), number, err.msg))
                continue
            if not isinstance(record, dict):
                skipped.append(Skipped(str(path), number, "not a JSON object"))
                continue
            records.append(record)
    return _table_from_records(records), skipped


def _table_from_records(records: list[dict]) -> pa.Table:
    keys: dict[str, None] = {}
    for record in records:
        keys.update(dict.fromkeys(record))
    columns = {}
    for key in keys:
        values = [record.get(key) for record in records]
        try:
            columns[key] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # Mixed types in one key: keep it as JSON text rather than drop it.
            columns[key] = pa.array(
                [None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values],
                pa.string(),
            )
    return pa.table(columns)


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _canonical(
    con: duckdb.DuckDBPyConnection,
    files: list[tuple[int, pa.Table]],
    *,
    version: str,
    split: str,
    seed: int,
) -> pa.Table:
    """Map the raw rows of one or more dump files (`(step, raw)` with one raw schema) to
    ROLLOUT_SCHEMA, file by file in the given order."""
    raw = pa.concat_tables([t for _, t in files]) if len(files) > 1 else files[0][1]
    cols = set(raw.column_names)
    for required in ("input", "output"):
        if required not in cols:
            raise EvoError(
                f"dump rows have no {required!r} key",
                field=required,
                hint="is this a verl rollout/validation dump?",
            )
    sizes = [t.num_rows for _, t in files]
    # __row orders rows file by file; __file keeps each file's groups and sample numbers to
    # itself; __step is the file's step for rows without a `step` key.
    raw = raw.append_column("__row", pa.array(np.arange(raw.num_rows, dtype=np.int64)))
    raw = raw.append_column("__file", pa.array(np.repeat(np.arange(len(files)), sizes)))
    raw = raw.append_column(
        "__step", pa.array(np.repeat(np.array([s for s, _ in files], dtype=np.int64), sizes))
    )
    internal = {"__row", "__file", "__step"}

    def col(name: str, cast: str, default: str = "NULL") -> str:
        return f"TRY_CAST({_q(name)} AS {cast})" if name in cols else default

    prompt_key = "left(md5(CAST(input AS VARCHAR)), 16)"
    if "uid" in cols:
        group = f"COALESCE(regexp_extract(uid, '^(.*)_[^_]*_[^_]*$', 1), {prompt_key})"
        sample = "TRY_CAST(regexp_extract(uid, '_([^_]*)_[^_]*$', 1) AS BIGINT)"
    else:
        group = prompt_key
        sample = "NULL::BIGINT"
    task = next((f"CAST({_q(k)} AS VARCHAR)" for k in ("task_id", "index") if k in cols), None)
    task = f"COALESCE({task}, 'p' || {prompt_key})" if task else f"'p' || {prompt_key}"
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
    # Reward components: the numeric keys nobody else claims.
    numeric = [
        f.name
        for f in raw.schema
        if f.name not in _KNOWN
        and f.name not in internal
        and (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))
    ]
    rest = [
        n for n in raw.column_names if n not in _KNOWN and n not in numeric and n not in internal
    ]
    if numeric:
        entries = ", ".join(
            f"{{'key': '{n.replace(chr(39), chr(39) * 2)}', 'value': CAST({_q(n)} AS DOUBLE)}}"
            for n in numeric
        )
        components = f"map_from_entries(list_filter([{entries}], lambda e: e.value IS NOT NULL))"
    else:
        components = "MAP {}::MAP(VARCHAR, DOUBLE)"
    extra = (
        "CAST(to_json(struct_pack(" + ", ".join(f"{_q(n)} := {_q(n)}" for n in rest) + "))"
        " AS VARCHAR)"
        if rest
        else "NULL"
    )
    # No ORDER BY: a plain projection keeps the scan's order (DuckDB preserves insertion
    # order), which is checked below instead of paying for a sort.
    sql = f"""
        SELECT $version AS version, $seed::BIGINT AS seed,
               COALESCE({col("step", "BIGINT")}, __step) AS step, $split AS split,
               {task} AS task_id, {col("data_source", "VARCHAR", "'unknown'")} AS data_source,
               {group} AS group_id, {sample} AS sample_idx,
               CAST(input AS VARCHAR) AS prompt, CAST(output AS VARCHAR) AS response,
               {col("score", "DOUBLE")} AS reward, {components} AS reward_components,
               {col("acc", "DOUBLE")} AS correct,
               {col("response_length", "BIGINT")} AS response_tokens,
               {truncated} AS truncated, {finish} AS finish_reason,
               {col("num_turns", "BIGINT")} AS turns,
               {col("mean_logprob", "DOUBLE")} AS mean_logprob, {extra} AS extra, __row
        FROM raw
    """
    con.register("raw", raw)
    try:
        params = {"version": version, "seed": seed, "split": split}
        out = con.sql(sql, params=params).to_arrow_table()
        rows = out.column("__row").to_numpy()
        if len(rows) > 1 and not (rows[1:] > rows[:-1]).all():
            out = out.sort_by("__row")
        if out.column("sample_idx").null_count:
            # Without a parsable uid, a row's sample number is its rank among the rows of
            # its file with the same input. Only computed when needed: the window sorts.
            rank = con.sql(
                "SELECT row_number() OVER (PARTITION BY __file, input ORDER BY __row) - 1 "
                "AS rank FROM raw ORDER BY __row"
            ).to_arrow_table()
            sample_idx = pc.coalesce(out.column("sample_idx"), rank.column("rank"))
            out = out.set_column(out.schema.get_field_index("sample_idx"), "sample_idx", sample_idx)
    finally:
        con.unregister("raw")
    calls = (
        pa.array(
            [_tool_calls(v) for v in raw.column("tool_calls").to_pylist()], pa.list_(TOOL_CALL)
        )
        if "tool_calls" in cols
        else pa.nulls(raw.num_rows, pa.list_(TOOL_CALL))
    )
    out = out.append_column("tool_calls", calls)
    return out.select(ROLLOUT_SCHEMA.names).cast(ROLLOUT_SCHEMA)


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
