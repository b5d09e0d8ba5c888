"""The embedded GRPO engine (torch + transformers, CPU-friendly).

`run_job` imports the training stack on first use; the recipe contract it checks first is
`evotrainer.contract.recipe`, shared with every backend.
The algorithm reads top to bottom in `evotrainer/engine/grpo.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The CPU kernels every x86-64 machine with AVX2 runs alike. Left to itself, torch picks its
# kernels by the CPU (AVX-512 on one machine, AVX2 on another of the "same" kind) and so do
# MKL and oneDNN; their float sums round differently, the warm start drifts by the third
# decimal and a seeded run's whole lineage differs from machine to machine. Measured here
# (AVX-512): the arith example's 30 steps ended at val avg@16 0.280 with the native kernels
# and 0.277 pinned to AVX2, from the same seed. MKL honours its pin on Intel processors only
# (oneMKL's documentation): an AMD EPYC and an Intel Xeon machine, both pinned, gave the
# main job different lineages. A variable the user sets wins (e.g.
# ATEN_CPU_CAPABILITY=default for the native kernels, trading reproducibility for speed).
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                  "ONEDNN_MAX_CPU_ISA": "AVX2"}


def offline_environment() -> None:
    """The engine process's settings, made before torch and transformers are imported: it
    never talks to the Hub (no downloads, no telemetry; huggingface_hub reads these at
    import time), and on x86-64 with AVX2 its CPU kernels are pinned (PINNED_KERNELS)."""
    for key in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"
    if _has_avx2():
        for key, value in PINNED_KERNELS.items():
            os.environ.setdefault(key, value)


def engine_threads(requested: int | str | None) -> int:
    """The recipe's `threads` (absent: 1), or for `threads: auto` as many as this process may
    run on (its CPU affinity) less the machine's load: on a loaded 2-core machine a batch-8
    forward ran 5.5x slower on 2 threads than on 1 (issue 30)."""
    if requested != "auto":
        return int(requested or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    idle = (cores or 1) - os.getloadavg()[0]
    return max(1, min(cores or 1, round(idle)))


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and " avx2" in line for line in cpuinfo)
    except OSError:  # not Linux: the kernels stay as torch picks them
        return False


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


__all__ = ["engine_threads", "offline_environment", "run_job"]
