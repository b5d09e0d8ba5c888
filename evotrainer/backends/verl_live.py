"""The rows a live look has read of a running verl job, kept between looks in the look's
cache folder: one Arrow IPC file per read, memory-mapped when read back, so a look costs what
the job wrote since the last one (`VerlBackend.live_evidence`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from evotrainer.store.files import atomic_write


class RowChunks:
    """Tables appended under a key (a seed's split), read back together in order."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def drop(self, key: str) -> None:
        """Forget what was read under `key` (its dump restarted)."""
        for old in self.folder.glob(f"{key}-*.arrow"):
            old.unlink()

    def append(self, key: str, table: pa.Table) -> None:
        number = 1 + max((_order(p)[1] for p in self.folder.glob(f"{key}-*.arrow")), default=0)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        atomic_write(self.folder / f"{key}-{number:06d}.arrow", sink.getvalue().to_pybytes())

    def read_all(self) -> pa.Table | None:
        chunks = [_read(p) for p in sorted(self.folder.glob("*.arrow"), key=_order)]
        return pa.concat_tables(chunks) if chunks else None


def _read(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def _order(path: Path) -> tuple[str, int]:
    key, _, number = path.stem.rpartition("-")
    return key, int(number)
