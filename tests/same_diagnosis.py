"""Comparing two diagnoses that must agree: equal, but for the last bits of a float."""

from __future__ import annotations

import pytest


def assert_same(got, expected, where: str = "") -> None:
    """Equal, floats to 1e-12 relative: DuckDB's threads sum in the order they finish, so even
    one query run twice can differ in the last bits (records round them away)."""
    if isinstance(got, float) and isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-15, nan_ok=True), where
    elif isinstance(got, dict) and isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}.{key}")
    elif isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (x, y) in enumerate(zip(got, expected, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert got == expected, where
