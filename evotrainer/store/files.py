"""Small file helpers shared by the engine and the backends."""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write via a temp file and rename, so a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON document at `path`, or None when it is missing or not (yet) complete."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
