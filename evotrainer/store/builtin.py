"""Where the built-in library (schemas, harness revisions, skills) lives.

In the repository it sits at the top level (`spec/schemas`, `harness_revisions/`, `skills/`);
the wheel carries the same folders under `evotrainer/_builtin/`.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent
# The folder of harness revisions, in the built-in library and at a workspace's top.
HARNESS_FOLDER = "harness_revisions"


def harness_file(name: str) -> str:
    """The path of harness revision `name`, relative to a workspace (or the library)."""
    return f"{HARNESS_FOLDER}/{name}.yaml"


def builtin_dir(name: str) -> Path:
    """`name` is one of "spec/schemas", "harness_revisions", "skills"."""
    for root in (_PACKAGE / "_builtin", _PACKAGE.parent):
        if (root / name).is_dir():
            return root / name
    raise FileNotFoundError(f"built-in library folder {name!r} is missing from the installation")
