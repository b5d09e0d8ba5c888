"""The embedded GRPO engine (torch + transformers, CPU-friendly).

`check_recipe` is importable without torch; `run_job` imports the training stack on first use.
The algorithm reads top to bottom in `evotrainer/engine/grpo.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from evotrainer.engine.checks import check_recipe


def offline_environment() -> None:
    """The engine never talks to the Hub: no downloads, no telemetry. Call it before
    transformers is imported (huggingface_hub reads these at import time)."""
    for key in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"


def run_job(
    recipe: dict[str, Any],
    out_dir: Path,
    version: str = "adhoc",
    progress: bool = False,
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """See `evotrainer.engine.grpo.run_job`."""
    offline_environment()
    from evotrainer.engine.grpo import run_job as _run_job

    return _run_job(recipe, out_dir, version, progress, cache_dir)


__all__ = ["check_recipe", "offline_environment", "run_job"]
