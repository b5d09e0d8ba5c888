"""Group filters on plain arrays, as the engine and the backtest tool call them."""

from __future__ import annotations

import numpy as np
import pytest

from evotrainer.contract.filters import FILTERS, StdGroupFilter, make_filter
from evotrainer.errors import EvoError


def groups(*stds: float) -> list[np.ndarray]:
    """Groups of 2 rewards whose population std is exactly the given value."""
    return [np.array([0.5 - s, 0.5 + s]) for s in stds]


def test_registry_and_simple_filters():
    assert set(FILTERS) == {"none", "zero_std", "std_group_filter"}
    batch = groups(0.0, 0.3, 0.0, 0.1)
    assert make_filter({"name": "none"}).keep(batch).tolist() == [True] * 4
    assert make_filter({"name": "zero_std"}).keep(batch).tolist() == [False, True, False, True]


def test_std_group_filter_warm_up_then_ema_threshold():
    f = make_filter({"name": "std_group_filter", "params": {}})
    assert isinstance(f, StdGroupFilter) and f.warmup == 20  # max(20, 1 / 0.1)
    # Warm-up: only std = 0 is dropped, however small the other spreads are.
    warm = f.keep(groups(*([0.0] + [0.01] + [0.5] * 18)))
    assert warm.tolist() == [False] + [True] * 19
    assert f.threshold() > 0.01  # EMA of mostly 0.5 spreads (mean near 0.5), z = 1.28
    # After warm-up a 0.01 spread falls under ema_mean - z * ema_std; 0.5 ones pass.
    assert f.keep(groups(0.5, 0.01, 0.5, 0.0)).tolist() == [True, False, True, False]


def test_std_group_filter_min_keep_ratio_keeps_the_widest_groups():
    f = make_filter(
        {
            "name": "std_group_filter",
            "params": {"mode": "absolute", "min_std_threshold": 0.4, "min_keep_ratio": 0.5},
        }
    )
    assert f.threshold() == 0.4
    # 4 informative groups all under 0.4: the floor keeps the best 2 (by std), never a zero.
    assert f.keep(groups(0.1, 0.3, 0.0, 0.2, 0.05)).tolist() == [False, True, False, True, False]


def test_filter_spec_errors_name_the_field():
    with pytest.raises(EvoError) as err:
        make_filter({"name": "snr"})
    assert err.value.field == "group_filter.name"
    with pytest.raises(EvoError) as err:
        make_filter({"name": "std_group_filter", "params": {"keep": 0.9}})
    assert err.value.field == "group_filter.params.keep"
    with pytest.raises(EvoError) as err:
        make_filter({"name": "std_group_filter", "params": {"mode": "top_k"}})
    assert err.value.field == "group_filter.params.mode"
