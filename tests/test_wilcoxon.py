"""The gate's Wilcoxon signed-rank test, computed without scipy.stats, against scipy's own
(zero_method="wilcox", defaults) over the cases its method switches on: exact without ties
or zeros up to 50 differences, every sign flip with them up to 13, the normal approximation
with the tie correction beyond."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from evotrainer.diagnosis.stats import _wilcoxon


def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    out = []
    for n in (1, 2, 5, 9, 13, 14, 20, 50, 51, 80, 300):
        out.append(rng.normal(0.1, 1, n))                       # no ties, no zeros
        out.append(np.round(rng.normal(0.1, 1, n), 1))          # ties
        with_zeros = np.round(rng.normal(0.05, 0.2, n), 1)      # ties and zeros
        out.append(with_zeros)
        out.append(rng.choice([-0.5, -0.25, 0.0, 0.25, 0.5, 1.0], n))  # per-task score steps
    out.append(np.array([0.0, 0.0, 0.5]))
    out.append(np.full(20, 0.25))
    out.append(-np.arange(1, 31) / 30)
    return out


@pytest.mark.parametrize("diff", _cases(), ids=lambda d: f"n{len(d)}")
def test_matches_scipy(diff: np.ndarray) -> None:
    statistic, p = _wilcoxon(diff)
    if not np.any(diff != 0):
        assert (statistic, p) == (0.0, 1.0)
        return
    expected = sps.wilcoxon(diff, zero_method="wilcox")
    assert statistic == pytest.approx(float(expected.statistic), abs=1e-9)
    assert p == pytest.approx(float(expected.pvalue), rel=1e-9, abs=1e-12)


def test_all_zero_differences_are_no_evidence() -> None:
    assert _wilcoxon(np.zeros(12)) == (0.0, 1.0)
