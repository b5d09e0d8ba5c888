"""Group filters on plain arrays, as the engine and the backtest tool call them."""

from __future__ import annotations

import numpy as np
import pytest

from evotrainer.contract.filters import (
    FILTERS,
    DualLevelFilter,
    StdGroupFilter,
    Trajectory,
    filter_batch,
    make_filter,
)
from evotrainer.errors import EvoError


def groups(*stds: float) -> list[np.ndarray]:
    """Groups of 2 rewards whose population std is exactly the given value."""
    return [np.array([0.5 - s, 0.5 + s]) for s in stds]


def test_registry_and_simple_filters():
    assert set(FILTERS) == {"none", "zero_std", "std_group_filter", "dual_level"}
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


def calls(*names: str) -> list[dict[str, str]]:
    return [{"name": n, "args": str(i)} for i, n in enumerate(names)]


def test_dual_level_trajectory_rules_match_the_reference_cases():
    f = make_filter({"name": "dual_level", "params": {"echo_min_repeats": 4}})
    assert isinstance(f, DualLevelFilter)
    # Abandonment: <= 3 turns and no action, even when correct (a lucky one-line answer).
    assert f.exclude(Trajectory(1.0, turns=2, tool_calls=[])) == "abandonment"
    # A call that did not parse, or reached no offered tool, is no action on the task.
    assert f.exclude(Trajectory(1.0, 3, calls("invalid", "unavailable"))) == "abandonment"
    # Idle: longer, still no action, and incorrect; the same but correct stays.
    assert f.exclude(Trajectory(0.0, 5, calls("invalid"))) == "idle"
    assert f.exclude(Trajectory(1.0, 5, calls("invalid"))) is None
    # Echo trap: more than 60 turns and incorrect; 61 turns correct stays, 60 failing stays.
    assert f.exclude(Trajectory(0.0, 61, calls("shell"))) == "echo_trap"
    assert f.exclude(Trajectory(1.0, 61, calls("shell"))) is None
    assert f.exclude(Trajectory(0.0, 60, calls("shell"))) is None
    # ... or 4 identical calls in a row (echo_min_repeats), incorrect.
    same = [{"name": "compare", "args": "40"}] * 4
    assert f.exclude(Trajectory(0.0, 5, same)) == "echo_trap"
    assert f.exclude(Trajectory(0.0, 5, same[:3] + calls("compare"))) is None
    # Truncated: any trajectory, single-turn included; unknown length never excludes.
    assert f.exclude(Trajectory(1.0, truncated=True)) == "truncated"
    assert f.exclude(Trajectory(0.0)) is None  # single-turn, incorrect: not idle
    # action_tools narrows what counts: a shell-only episode is idle for the paper's SWE edits.
    edits = make_filter({"name": "dual_level", "params": {"action_tools": ["write", "patch"]}})
    assert edits.exclude(Trajectory(0.0, 6, calls("shell", "shell"))) == "idle"
    assert edits.exclude(Trajectory(0.0, 6, calls("shell", "patch"))) is None
    off = make_filter({"name": "dual_level", "params": {"exclude_truncated": False}})
    assert off.exclude(Trajectory(1.0, truncated=True)) is None


def test_dual_level_excludes_before_the_group_level():
    """Hand-computed: three groups of 4 under absolute level 2 (threshold 0.3).

    g0 rewards [1, 0, 0, 0]: member 1 is an abandonment. Left [1, 0, 0]: std = 0.4714 >= 0.3,
        kept (with all four, std 0.433 would also pass; the excluded one just leaves).
    g1 rewards [1, 1, 1, 0]: member 3 is idle. Left [1, 1, 1]: std 0, dropped; without level 1
        the group (std 0.433) would have trained on the idle failure.
    g2 rewards [1, 0, 1, 0]: members 0..2 truncated. One left: no spread, dropped.
    """
    absolute = {"mode": "absolute", "min_std_threshold": 0.3, "min_keep_ratio": 0.01}
    f = make_filter({"name": "dual_level", "params": absolute})
    act = calls("compare", "compare")
    rewards = [np.array([1.0, 0, 0, 0]), np.array([1.0, 1, 1, 0]), np.array([1.0, 0, 1, 0])]
    trajectories = [
        [Trajectory(1.0, 4, act), Trajectory(0.0, 1, []), Trajectory(0.0, 4, act),
         Trajectory(0.0, 4, act)],
        [Trajectory(1.0, 4, act)] * 3 + [Trajectory(0.0, 5, calls("invalid"))],
        [Trajectory(1.0, 4, act, truncated=True)] * 3 + [Trajectory(0.0, 4, act)],
    ]
    decision = filter_batch(f, rewards, trajectories)
    assert decision.keep_groups.tolist() == [True, False, False]
    assert [e.tolist() for e in decision.excluded] == [
        [False, True, False, False], [False, False, False, True], [True, True, True, False]]
    assert decision.reasons == {"abandonment": 1, "idle": 1, "truncated": 3}
    assert decision.sample_mask().tolist() == [True, False, True, True] + [False] * 8
    # The group level alone (no trajectories: a table without turns or lengths) keeps all 3.
    plain = make_filter({"name": "dual_level",
                         "params": {"mode": "absolute", "min_std_threshold": 0.3}})
    assert filter_batch(plain, rewards).keep_groups.tolist() == [True, True, True]


def test_dual_level_group_level_is_the_std_group_filter_with_its_state():
    """Level 2 is StdGroupFilter: the same decisions and EMA threshold on the same spreads."""
    dual, std = make_filter({"name": "dual_level"}), make_filter({"name": "std_group_filter"})
    for batch in (groups(*([0.0] + [0.5] * 19)), groups(0.5, 0.01, 0.5, 0.0)):
        assert dual.keep(batch).tolist() == std.keep(batch).tolist()
    assert dual.threshold() == std.threshold() > 0.01


def test_filter_params_follow_each_filters_schema():
    assert set(DualLevelFilter.params_schema["properties"]) == set(DualLevelFilter.defaults)
    for cls in FILTERS.values():
        assert set(cls.params_schema["properties"]) == set(cls.defaults)
    for params, where in (
        ({"abandon_max_turns": "3"}, "group_filter.params.abandon_max_turns"),
        ({"action_tools": ["write", 3]}, "group_filter.params.action_tools.1"),
        ({"keep_ratio": 1.0}, "group_filter.params.keep_ratio"),
        ({"exclude_truncated": 1}, "group_filter.params.exclude_truncated"),
    ):
        with pytest.raises(EvoError) as err:
            make_filter({"name": "dual_level", "params": params})
        assert err.value.field == where
