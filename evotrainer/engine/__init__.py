"""The embedded GRPO engine (torch + transformers, CPU-friendly).

`run_job` imports the training stack on first use; the recipe contract it checks first is
`evotrainer.contract.recipe`, shared with every backend.
The algorithm reads top to bottom in `evotrainer/engine/grpo.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from evotrainer.contract.model_start import base_model

# The CPU kernels every x86-64 machine with AVX2 runs alike. Left to itself, torch picks its
# kernels by the CPU (AVX-512 on one machine, AVX2 on another of the "same" kind) and so do
# MKL and oneDNN; their float sums round differently, the warm start drifts by the third
# decimal and a seeded run's whole lineage differs from machine to machine. torch's own
# kernels (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA) dispatch on the instruction
# set alone. MKL honours an AVX2 pin on Intel processors only and keeps its automatic branch
# elsewhere (oneMKL's documentation on conditional numerical reproducibility): an AMD EPYC and
# an Intel Xeon machine, both pinned to AVX2, trained the main job into different lineages.
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                  "ONEDNN_MAX_CPU_ISA": "AVX2"}
# MKL's COMPATIBLE branch (SSE2 without the approximate reciprocals, whose results differ
# between vendors) gives the same bits on every x86-64 processor, Intel or AMD. The tiny
# model trains on it: its matrices are small, so SSE2 costs little there (the arith block
# runs about a quarter longer), and a README lineage is then what every new user sees.
# A pretrained model keeps the AVX2 branch, for its speed. Its layers are too small for
# oneDNN's packed path (rollout.PACK_MIN_WEIGHTS), so MKL and torch's own kernels are all it
# runs on.
PORTABLE_MKL = "COMPATIBLE"


def offline_environment(recipe: dict[str, Any] | None = None) -> None:
    """The engine process's settings, made before torch's first computation: it never talks
    to the Hub (no downloads, no telemetry; huggingface_hub reads these at import time), and
    on x86-64 with AVX2 its CPU kernels are pinned (PINNED_KERNELS; MKL on PORTABLE_MKL when
    `recipe` trains the tiny model). MKL reads its pin at its first call, so a recipe read
    after torch is imported still chooses it. A variable the user sets wins (e.g.
    ATEN_CPU_CAPABILITY=default for the native kernels, trading reproducibility for speed)."""
    for key in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"
    if not _has_avx2():
        return
    pins = dict(PINNED_KERNELS)
    if recipe is not None and trains_tiny_model(recipe):
        pins["MKL_CBWR"] = PORTABLE_MKL
    for key, value in pins.items():
        if key not in os.environ or os.environ[key] == PINNED_KERNELS[key]:
            os.environ[key] = value


def trains_tiny_model(recipe: dict[str, Any]) -> bool:
    """Whether the recipe's policy is the tiny model built from `model.tiny` (no checkpoint)."""
    return base_model(recipe.get("model") or {}).kind == "tiny"


def engine_threads(requested: int | str | None) -> int:
    """The recipe's `threads` (absent: 1), or for `threads: auto` as many as this process may
    run on (its CPU affinity) less the machine's load: on a loaded 2-core machine a batch-8
    forward ran 5.5x slower on 2 threads than on 1."""
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


__all__ = ["engine_threads", "offline_environment", "run_job", "trains_tiny_model"]
