"""A seeded run means the same on every x86-64 machine with AVX2: the engine pins torch's,
MKL's and oneDNN's CPU kernels to AVX2 before torch loads (issue 27 item 1: the same commit
gave another lineage on a machine of the same kind, whose CPU had other vector units)."""

from __future__ import annotations

import os

import pytest

from evotrainer.backends.base import job_environment
from evotrainer.engine import PINNED_KERNELS, _has_avx2, offline_environment


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
