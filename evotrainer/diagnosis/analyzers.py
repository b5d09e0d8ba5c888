"""Named Python analyzers for what SQL cannot say comfortably.

An analyzer maps each rollout of its split to a number (NaN leaves the row out); the metric
is the mean over rows and its series the mean per step. Register one with `@analyzer(name,
columns)`; `columns` are the rollout columns it reads.
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
    """A table's tool calls flattened once: the call names, `name args` texts and name codes
    are built on first use and shared by every tool-call analyzer that sees the same table
    (the engine hands each analyzer of a split the same table object)."""

    def __init__(self, table: pa.Table) -> None:
        # Chunk by chunk: combining the chunks first would copy every call's strings.
        column = table.column("tool_calls")
        self.num_rows = table.num_rows
        self.flat = pc.list_flatten(column)
        # Call count per row; -1 when the row has no tool-call data.
        self.counts = pc.fill_null(pc.list_value_length(column), -1).to_numpy()
        # The row of each call (list_flatten skips null lists, so they count as empty here).
        self.parents = np.repeat(np.arange(self.num_rows), np.maximum(self.counts, 0))

    @cached_property
    def names(self) -> pa.ChunkedArray:
        return pc.fill_null(pc.struct_field(self.flat, "name"), "")

    @cached_property
    def text(self) -> pa.ChunkedArray:
        args = pc.fill_null(pc.struct_field(self.flat, "args"), "")
        return pc.binary_join_element_wise(self.names, args, " ")

    @cached_property
    def same_as_previous(self) -> np.ndarray:
        """Whether each call after the first has the name of the call before it (a null name
        counts as "")."""
        names = self.names
        return pc.equal(names[1:], names[:-1]).to_numpy(zero_copy_only=False)


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
    tools = pa.array(params.get("leak_tools") or [], pa.string())
    hit = pc.is_in(calls.names, value_set=tools)
    for pattern in params.get("leak_patterns") or []:
        hit = pc.or_(hit, pc.match_substring_regex(calls.text, pattern))
    # Repeated row indices are fine: every hit of a row writes the same 1.0.
    out[calls.parents[hit.to_numpy(zero_copy_only=False)]] = 1.0
    return out


@analyzer("max_same_tool_streak", columns=("tool_calls",))
def max_same_tool_streak(table: pa.Table, params: dict[str, Any]) -> np.ndarray:
    """Longest run of consecutive calls to the same tool in a row (the echo-trap signature);
    NaN for rows without calls."""
    calls = _calls(table)
    out = np.full(calls.num_rows, np.nan)
    if len(calls.flat) == 0:
        return out
    parents = calls.parents
    # A run starts where the row or the tool name changes.
    start = np.empty(len(parents), dtype=bool)
    start[0] = True
    np.logical_not(calls.same_as_previous, out=start[1:])
    start[1:] |= parents[1:] != parents[:-1]
    run_starts = np.flatnonzero(start)
    run_lengths = np.diff(run_starts, append=len(parents))
    # Runs are ordered by row, so each row's runs are one contiguous slice.
    run_rows = parents[run_starts]
    first = np.flatnonzero(np.r_[True, run_rows[1:] != run_rows[:-1]])
    out[run_rows[first]] = np.maximum.reduceat(run_lengths, first)
    return out
