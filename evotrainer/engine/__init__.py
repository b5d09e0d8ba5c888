"""The embedded GRPO engine (torch + transformers, CPU-friendly).

`check_recipe` is importable without torch; `run_job` imports the training stack on first use.
The algorithm reads top to bottom in `evotrainer/engine/grpo.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evotrainer.engine.checks import check_recipe


def run_job(
    recipe: dict[str, Any],
    out_dir: Path,
    version: str = "adhoc",
    progress: bool = False,
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """See `evotrainer.engine.grpo.run_job`."""
    from evotrainer.engine.grpo import run_job as _run_job

    return _run_job(recipe, out_dir, version, progress, cache_dir)


__all__ = ["check_recipe", "run_job"]
