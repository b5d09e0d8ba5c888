"""One error type the CLI knows how to print: where, what, and how to fix it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class EvoError(Exception):
    """A user-facing error. The CLI prints it as one paragraph and exits 1.

    `where` is a location such as `spec/versions/v1.yaml:12:5`, `field` a dotted path
    inside the document, `hint` the fix.
    """

    def __init__(
        self, message: str, *, where: str | None = None, field: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.where = where
        self.field = field
        self.hint = hint

    def __str__(self) -> str:
        head = f"{self.where}: " if self.where else ""
        field = f"{self.field}: " if self.field else ""
        tail = f" Hint: {self.hint}" if self.hint else ""
        return f"{head}{field}{self.message}{tail}"

    def as_dict(self) -> dict:
        return {"where": self.where, "field": self.field, "message": self.message,
                "hint": self.hint}


@contextmanager
def unreadable_table(path: Path | str | None, hint: str) -> Iterator[None]:
    """Inside, a file Arrow cannot read as a table (a CSV given as Parquet, an empty or
    truncated file) becomes an EvoError naming the file and Arrow's reason."""
    import pyarrow as pa  # only where a table is read: importing it costs start-up time

    try:
        yield
    except pa.ArrowInvalid as err:
        raise EvoError(f"not a readable table: {err}", where=str(path), hint=hint) from None
