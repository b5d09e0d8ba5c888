"""The names of the registered analyzers (diagnosis/analyzers.py), without their code.

Checking a harness revision needs only whether a metric's analyzer is registered, and the
analyzers' module imports numpy and pyarrow: `validate` and `plan` read this list instead.
tests/test_declared_analyzers.py holds it equal to the registry."""

from __future__ import annotations

REGISTERED = frozenset({"echo_repeat", "echo_trap", "leak", "max_same_tool_streak"})
