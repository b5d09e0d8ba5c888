"""Named Python analyzers for what SQL cannot say comfortably.

An analyzer maps each rollout of its split to a number (NaN leaves the row out); the metric
is the mean over rows and its series the mean per step. Register one with `@analyzer(name,
columns)`; `columns` are the rollout columns it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


def _flat_calls(table: pa.Table) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """Flattened tool calls, the row of each call, and each row's call count (-1 when the
    row has no tool-call data)."""
    calls = table.column("tool_calls").combine_chunks()
    counts = pc.fill_null(pc.list_value_length(calls), -1).to_numpy()
    parents = pc.list_parent_indices(calls).to_numpy()
    return pc.list_flatten(calls), parents, counts


@analyzer("leak", columns=("tool_calls",))
def leak(table: pa.Table, params: dict[str, Any]) -> np.ndarray:
    """1.0 for a row with a call whose name is in `leak_tools` or whose `name args` matches a
    regex in `leak_patterns` (RE2 syntax, searched anywhere), else 0.0."""
    flat, parents, counts = _flat_calls(table)
    out = np.where(counts < 0, np.nan, 0.0)
    if len(flat) == 0:
        return out
    names = pc.fill_null(flat.field("name"), "")
    text = pc.binary_join_element_wise(names, pc.fill_null(flat.field("args"), ""), " ")
    hit = pc.is_in(names, value_set=pa.array(params.get("leak_tools") or [], pa.string()))
    for pattern in params.get("leak_patterns") or []:
        hit = pc.or_(hit, pc.match_substring_regex(text, pattern))
    out[np.unique(parents[hit.to_numpy(zero_copy_only=False)])] = 1.0
    return out


@analyzer("max_same_tool_streak", columns=("tool_calls",))
def max_same_tool_streak(table: pa.Table, params: dict[str, Any]) -> np.ndarray:
    """Longest run of consecutive calls to the same tool in a row (the echo-trap signature);
    NaN for rows without calls."""
    flat, parents, counts = _flat_calls(table)
    out = np.full(table.num_rows, np.nan)
    if len(flat) == 0:
        return out
    codes = pc.dictionary_encode(pc.fill_null(flat.field("name"), "")).indices.to_numpy()
    # A run starts where the row or the tool name changes.
    start = np.ones(len(codes), dtype=bool)
    start[1:] = (codes[1:] != codes[:-1]) | (parents[1:] != parents[:-1])
    run_starts = np.flatnonzero(start)
    run_lengths = np.diff(np.append(run_starts, len(codes)))
    # Runs are ordered by row, so each row's runs are one contiguous slice.
    run_rows = parents[run_starts]
    first = np.flatnonzero(np.r_[True, run_rows[1:] != run_rows[:-1]])
    out[run_rows[first]] = np.maximum.reduceat(run_lengths, first)
    return out
