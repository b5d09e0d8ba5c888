"""Named Python analyzers for what SQL cannot say comfortably.

An analyzer maps each rollout of its split to a number (NaN leaves the row out); the metric
is the mean over rows and its series the mean per step. Register one with `@analyzer(name,
columns)`; `columns` are the rollout columns it reads. Its name goes in analyzer_names.py too:
checking a harness revision reads the names there, without this module's numpy and pyarrow.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class Analyzer:
    name: str
    columns: tuple[str, ...]
    fn: Callable[[pa.Table, dict[str, Any]], np.ndarray]


ANALYZERS: dict[str, Analyzer] = {}


def analyzer(name: str, columns: tuple[str, ...]) -> Callable:
    def wrap(fn: Callable[[pa.Table, dict[str, Any]], np.ndarray]) -> Callable:
        ANALYZERS[name] = Analyzer(name, columns, fn)
        return fn

    return wrap


class _Calls:
    """A table's tool calls flattened once and shared by every tool-call analyzer (and the
    `calls` SQL view) that sees the same table: the engine hands each analyzer of a split the
    same table object. Names and args are dictionary-encoded, so the per-call work runs on
    integer codes and a regex only ever sees each distinct `name args` pair once."""

    def __init__(self, table: pa.Table) -> None:
        # Chunk by chunk: combining the chunks first would copy every call's strings.
        column = table.column("tool_calls")
        self.num_rows = table.num_rows
        self.flat = pc.list_flatten(column)
        # Call count per row; -1 when the row has no tool-call data.
        self.counts = pc.fill_null(pc.list_value_length(column), -1).to_numpy()
        # list_flatten skips null lists, so they count as empty here.
        present = np.maximum(self.counts, 0)
        # The first call of each row in `flat` (a row without calls: where the next one's is).
        self.starts = np.cumsum(present) - present
        self.with_calls = self.counts > 0

    @cached_property
    def parents(self) -> np.ndarray:
        """The row of each call (int32: half the memory of a per-call pass in int64)."""
        index_type = np.int32 if self.num_rows < 2**31 else np.int64
        return np.repeat(np.arange(self.num_rows, dtype=index_type), np.maximum(self.counts, 0))

    def any_per_row(self, per_call: np.ndarray) -> np.ndarray:
        """Whether any call of each row is True in `per_call` (False for a row without)."""
        out = np.zeros(self.num_rows, dtype=bool)
        if len(per_call):
            out[self.with_calls] = np.logical_or.reduceat(per_call, self.starts[self.with_calls])
        return out

    @cached_property
    def names(self) -> pa.ChunkedArray:
        """Each call's name, null kept (the SQL view's `name`)."""
        return pc.struct_field(self.flat, "name")

    @cached_property
    def name_codes(self) -> tuple[np.ndarray, pa.Array]:
        """(a code per call, the distinct names by code); a null name is coded as ""."""
        return _text_codes(self.names)

    @cached_property
    def args(self) -> pa.ChunkedArray:
        """Each call's args, null kept."""
        return pc.struct_field(self.flat, "args")

    @cached_property
    def args_codes(self) -> tuple[np.ndarray, pa.Array]:
        """(a code per call, the distinct args by code); null args are coded as ""."""
        return _text_codes(self.args)

    @cached_property
    def pair_codes(self) -> tuple[np.ndarray, pa.Array, pa.Array]:
        """(a code per call, name and args of each distinct pair by code); null is ""."""
        codes, names = self.name_codes
        arg_codes, args = self.args_codes
        # One integer per (name, args) pair; its distinct values are the distinct pairs,
        # found without ever building a `name args` string per call.
        size = len(names) * len(args)
        pair = codes.astype(np.int32 if size < 2**31 else np.int64) * len(args) + arg_codes
        if size <= 8 * len(pair) + 1024:
            # Few enough possible pairs to mark them in a table: no hashing per call.
            seen = np.zeros(size, bool)
            seen[pair] = True
            distinct = np.flatnonzero(seen)
            code_of = np.zeros(size, np.int32)
            code_of[distinct] = np.arange(len(distinct), dtype=np.int32)
            pairs = code_of[pair]
        else:
            pairs, encoded = _encode(pa.array(pair))
            distinct = encoded.to_numpy()
        return (
            pairs,
            names.take(pa.array(distinct // len(args))),
            args.take(pa.array(distinct % len(args))),
        )

    @cached_property
    def first_calls(self) -> np.ndarray:
        """Whether each call is its row's first."""
        first = np.zeros(len(self.flat), dtype=bool)
        first[self.starts[self.with_calls]] = True
        return first

    @cached_property
    def repeats_name(self) -> np.ndarray:
        """Whether each call has the name of the call before it in its row."""
        return self._repeats(self.name_codes[0])

    @cached_property
    def repeats_args(self) -> np.ndarray:
        """Whether each call has the args of the call before it in its row (null = "").
        Neighbours are compared as they stand: no hash pass over every call's args, unless
        they are read dictionary-encoded and so already coded."""
        args = self.args
        if pa.types.is_dictionary(args.type):
            return self._repeats(self.args_codes[0])
        if args.null_count:
            args = pc.fill_null(args, "")
        n = len(args)
        out = np.zeros(n, dtype=bool)
        if n > 1:
            same = pc.equal(args.slice(1), args.slice(0, n - 1))
            out[1:] = np.concatenate([c.to_numpy(zero_copy_only=False) for c in same.chunks])
            out &= ~self.first_calls
        return out

    def _repeats(self, codes: np.ndarray) -> np.ndarray:
        out = np.empty(len(codes), dtype=bool)
        if len(codes):
            out[0] = False
            np.equal(codes[1:], codes[:-1], out=out[1:])
            out &= ~self.first_calls
        return out


def _text_codes(values: pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """(an int32 code per string, the distinct strings by code), a null coded as "". Strings
    read dictionary-encoded (evidence.io.read_rollouts(encoded_calls=True)) keep their codes:
    no hash pass over the strings."""
    if not pa.types.is_dictionary(values.type):
        return _encode(pc.fill_null(values, ""))
    # One dictionary for every chunk (unify_dictionaries merges distinct values only), so one
    # code is one string.
    chunks = values.unify_dictionaries().chunks
    if not chunks:
        return np.zeros(0, np.int32), pa.array([], pa.string())
    dictionary = chunks[0].dictionary.cast(pa.string())
    if pc.count_distinct(dictionary).as_py() < len(dictionary):  # a value twice: decode
        return _encode(pc.fill_null(values.cast(pa.string()), ""))
    empty = pc.index(dictionary, "").as_py()
    if empty < 0 and values.null_count:
        empty = len(dictionary)
        dictionary = pa.concat_arrays([dictionary, pa.array([""], pa.string())])
    indices = [
        (pc.fill_null(c.indices, max(empty, 0)) if c.null_count else c.indices).to_numpy()
        for c in chunks
    ]
    codes = indices[0] if len(indices) == 1 else np.concatenate(indices)
    return codes.astype(np.int32, copy=False), dictionary


def _encode(values: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(an int32 code per value, the distinct values by code) in one hash pass; no nulls in."""
    encoded = pc.dictionary_encode(values)
    if isinstance(encoded, pa.ChunkedArray):
        # Chunks may each carry their own dictionary: unify them so one code is one value.
        encoded = encoded.unify_dictionaries()
        if encoded.num_chunks == 0:
            return np.zeros(0, np.int32), pa.array([], values.type)
        dictionary = encoded.chunk(0).dictionary
        codes = np.concatenate([c.indices.to_numpy() for c in encoded.chunks])
        return codes, dictionary
    return encoded.indices.to_numpy(), encoded.dictionary


_last_calls: tuple[weakref.ref, _Calls] | None = None


def _calls(table: pa.Table) -> _Calls:
    """The flattened calls of `table`, reused while the same (immutable) table is analyzed;
    one entry is enough because the engine runs a split's analyzers back to back."""
    global _last_calls
    if _last_calls is not None and _last_calls[0]() is table:
        return _last_calls[1]
    calls = _Calls(table)
    _last_calls = (weakref.ref(table), calls)
    # Drop the flattened arrays with the table rather than keep them alive until next use.
    weakref.finalize(table, _forget, calls)
    return calls


def _forget(calls: _Calls) -> None:
    global _last_calls
    if _last_calls is not None and _last_calls[1] is calls:
        _last_calls = None


@analyzer("leak", columns=("tool_calls",))
def leak(table: pa.Table, params: dict[str, Any]) -> np.ndarray:
    """1.0 for a row with a call whose name is in `leak_tools` or whose `name args` matches a
    regex in `leak_patterns` (RE2 syntax, searched anywhere), else 0.0."""
    calls = _calls(table)
    out = np.where(calls.counts < 0, np.nan, 0.0)
    if len(calls.flat) == 0:
        return out
    # Decide each distinct (name, args) pair once, then map the answer back to the calls.
    pairs, names, args = calls.pair_codes
    tools = pa.array(params.get("leak_tools") or [], pa.string())
    hit = pc.is_in(names, value_set=tools)
    patterns = params.get("leak_patterns") or []
    if patterns:
        text = pc.binary_join_element_wise(names, args, " ")
        for pattern in patterns:
            hit = pc.or_(hit, pc.match_substring_regex(text, pattern))
    out[calls.any_per_row(hit.to_numpy(zero_copy_only=False)[pairs])] = 1.0
    return out


@analyzer("max_same_tool_streak", columns=("tool_calls",))
def max_same_tool_streak(table: pa.Table, params: dict[str, Any]) -> np.ndarray:
    """Longest run of consecutive calls to the same tool in a row (the echo-trap signature);
    NaN for rows without calls."""
    calls = _calls(table)
    out = np.full(calls.num_rows, np.nan)
    if len(calls.flat) == 0:
        return out
    repeats = calls.repeats_name
    # The length of the run each call ends, less one: its index less that of its run's first
    # call (the latest call that does not repeat the one before), carried forward in int32.
    index = np.arange(len(repeats), dtype=np.int32 if len(repeats) < 2**31 else np.int64)
    run = np.where(repeats, 0, index)
    np.maximum.accumulate(run, out=run)
    np.subtract(index, run, out=run)
    out[calls.with_calls] = np.maximum.reduceat(run, calls.starts[calls.with_calls]) + 1
    return out


@analyzer("echo_trap", columns=("turns", "correct"))
def echo_trap(table: pa.Table, params: dict[str, Any]) -> np.ndarray:
    """h0's echo trap, the method's Level-1 definition: 1.0 for a rollout that ran longer than
    `echo_turns` turns with correctness 0, else 0.0; NaN where turns are unknown."""
    turns = table.column("turns").to_numpy(zero_copy_only=False).astype(float)
    correct = table.column("correct").to_numpy(zero_copy_only=False).astype(float)
    with np.errstate(invalid="ignore"):  # NaN compares False
        hit = (correct == 0) & (turns > params["echo_turns"])
    return np.where(np.isnan(turns), np.nan, hit.astype(float))


@analyzer("echo_repeat", columns=("tool_calls", "correct"))
def echo_repeat(table: pa.Table, params: dict[str, Any]) -> np.ndarray:
    """The echo trap's signature at any horizon (h1): 1.0 for a rollout with correctness 0
    that made one call (same name and args; a null reads as empty) `echo_repeats` times in a
    row, else 0.0; NaN where tool calls are unknown. A repeat gets the same answer, so it
    cannot progress. Boolean passes over neighbouring calls, no per-row list work."""
    calls = _calls(table)
    correct = table.column("correct").to_numpy(zero_copy_only=False).astype(float)
    times = int(params["echo_repeats"])
    if times <= 1:
        looped = calls.with_calls  # one call is a run of one
    else:
        # A call ends a run of `times` equal calls where it and the `times - 2` calls before it
        # each repeat their predecessor (a row's first call repeats nothing, so no run
        # crosses rows).
        repeated = calls.repeats_name & calls.repeats_args
        ends = repeated.copy()
        for back in range(1, times - 1):
            ends[back:] &= repeated[:-back]
            ends[:back] = False
        looped = calls.any_per_row(ends)
    with np.errstate(invalid="ignore"):  # NaN compares False
        hit = (correct == 0) & looped
    return np.where(calls.counts < 0, np.nan, hit.astype(float))


def mean_by_step(steps: np.ndarray, values: np.ndarray) -> tuple[float | None, list[list[float]]]:
    """(mean of `values`, [[step, mean of that step's values], ...]) with NaN values left
    out; (None, []) when every value is NaN. How an analyzer's per-row numbers become a
    metric and its series."""
    keep = ~np.isnan(values)
    if not keep.any():
        return None, []
    steps = steps[keep]
    values = values[keep]
    low, high = (int(steps.min()), int(steps.max())) if steps.dtype.kind == "i" else (0, -1)
    if low <= high and high - low <= 4 * len(steps) + 1024:
        # Step numbers are dense: bin them directly instead of sorting for np.unique.
        # Both sum each step's values in row order, so the means are bit-identical.
        counts = np.bincount(steps - low)
        uniq = np.flatnonzero(counts)
        sums = np.bincount(steps - low, weights=values)[uniq]
        counts = counts[uniq]
        uniq = uniq + low
    else:
        uniq, inverse = np.unique(steps, return_inverse=True)
        sums = np.bincount(inverse, weights=values)
        counts = np.bincount(inverse)
    points = [[int(s), float(v)] for s, v in zip(uniq, sums / counts, strict=True)]
    return float(values.mean()), points


def call_table(table: pa.Table) -> pa.Table:
    """The `calls` SQL view of `table`: one row per tool call, with its rollout's `seed` and
    `step` (dictionary arrays over the rollouts' columns; SQL sees plain integers) and its
    `name` (dictionary-encoded: DuckDB then groups codes, not strings) and `args`. Built from
    the same flattened calls as the analyzers."""
    calls = _calls(table)
    if pa.types.is_dictionary(calls.names.type):
        name = calls.names  # coded as read (evidence.io.encode_tool_calls)
    else:
        codes, names = calls.name_codes
        null_name = pc.is_null(calls.names).to_numpy(zero_copy_only=False)
        name = pa.DictionaryArray.from_arrays(
            pa.array(codes, mask=null_name if null_name.any() else None), names
        )
    parents = pa.array(calls.parents)
    return pa.table(
        {
            # The rollout's value by reference (its row as a dictionary index): no copy of
            # seed and step per call, and a query that reads neither never converts them.
            "seed": pa.DictionaryArray.from_arrays(parents, table.column("seed").combine_chunks()),
            "step": pa.DictionaryArray.from_arrays(parents, table.column("step").combine_chunks()),
            "name": name,
            "args": calls.args,
        }
    )
