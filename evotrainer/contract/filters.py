"""Group filters: which GRPO groups enter the loss.

A filter sees one batch of groups at a time as plain arrays of rewards and answers a boolean
mask; it may keep state across calls (the EMA filter does). The engine calls it once per
training step, and the backtest tool replays it over stored rollouts the same way, so the
numbers agree. Registry: `FILTERS` (name → class) and `make_filter(spec)` for the recipe's
`group_filter: {name, params}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import NormalDist
from typing import Any, ClassVar

import numpy as np

from evotrainer.errors import EvoError

# "All rewards equal" up to the rounding of weighted float sums: such a group's advantages
# are exactly zero, so the zero-std filters drop it. Not the dead-group rule behind every
# `dead_group_ratio` (evidence/groups.py: std < 1e-3), which also counts groups whose rewards
# differ by less than any signal.
ZERO_STD = 1e-8


def group_stds(group_rewards: Sequence[np.ndarray]) -> np.ndarray:
    return np.array([float(np.std(np.asarray(r, dtype=float))) for r in group_rewards])


class GroupFilter:
    """Base: keep every group. Subclasses declare `defaults` (their parameters)."""

    name: ClassVar[str] = "none"
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, **params: Any) -> None:
        self.params = {**self.defaults, **params}

    def keep(self, group_rewards: Sequence[np.ndarray]) -> np.ndarray:
        return np.ones(len(group_rewards), dtype=bool)


class ZeroStdFilter(GroupFilter):
    """Drop groups whose rewards are all equal: their advantages are 0 and they only dilute
    the token-mean (DAPO's dynamic-sampling criterion without the resampling)."""

    name = "zero_std"

    def keep(self, group_rewards: Sequence[np.ndarray]) -> np.ndarray:
        return group_stds(group_rewards) > ZERO_STD


class StdGroupFilter(GroupFilter):
    """The method's StdGroupFilter (EMA-adaptive top-p, after RAGEN-2).

    std = 0 groups are always dropped. In `top_p` mode a group is kept when its reward std is at
    least `ema_mean - z * ema_std`, z = Φ⁻¹(keep_ratio) (0.9 → 1.28), where the EMA tracks the
    std of informative (std > 0) groups with weight `ema_decay` on new data; zero groups are
    left out of the EMA because the hard rule already handles them and they would drag the
    threshold below every informative group. The first max(20, 1/ema_decay) groups use the
    std = 0 rule only (warm-up). In `absolute` mode the threshold is `min_std_threshold`. If
    fewer than `min_keep_ratio` of the informative groups pass, the ones with the largest std
    are kept up to that share.
    """

    name = "std_group_filter"
    defaults = {
        "mode": "top_p",
        "keep_ratio": 0.9,
        "min_keep_ratio": 0.5,
        "ema_decay": 0.1,
        "min_std_threshold": 0.01,
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        p = self.params
        self.z = NormalDist().inv_cdf(p["keep_ratio"])
        self.warmup = max(20, int(np.ceil(1.0 / p["ema_decay"])))
        self.seen = 0
        self.ema_mean: float | None = None
        self.ema_var = 0.0

    def threshold(self) -> float:
        """The current std threshold (0 during warm-up)."""
        if self.params["mode"] == "absolute":
            return self.params["min_std_threshold"]
        if self.seen < self.warmup or self.ema_mean is None:
            return 0.0
        return self.ema_mean - self.z * float(np.sqrt(self.ema_var))

    def keep(self, group_rewards: Sequence[np.ndarray]) -> np.ndarray:
        stds = group_stds(group_rewards)
        alive = stds > ZERO_STD
        keep = alive & (stds >= self.threshold())
        floor = int(np.ceil(self.params["min_keep_ratio"] * alive.sum()))
        if keep.sum() < floor:
            ranked = np.argsort(-np.where(alive, stds, -np.inf), kind="stable")
            keep[ranked[:floor]] = True
        for s in stds[alive]:
            self._update(float(s))
        self.seen += len(stds)
        return keep

    def _update(self, x: float) -> None:
        decay = self.params["ema_decay"]
        if self.ema_mean is None:
            self.ema_mean = x
            return
        delta = x - self.ema_mean
        self.ema_mean += decay * delta
        # Exponentially weighted variance (West's incremental form).
        self.ema_var = (1 - decay) * (self.ema_var + decay * delta * delta)


FILTERS: dict[str, type[GroupFilter]] = {
    cls.name: cls for cls in (GroupFilter, ZeroStdFilter, StdGroupFilter)
}


def check_filter_spec(spec: dict[str, Any] | None) -> None:
    """EvoError naming `group_filter.*` for an unknown filter or a bad parameter."""
    spec = spec or {"name": "none"}
    name = spec.get("name", "none")
    if name not in FILTERS:
        raise EvoError(
            f"unknown group filter {name!r}",
            field="group_filter.name",
            hint=f"choose one of: {', '.join(FILTERS)}",
        )
    cls = FILTERS[name]
    params = spec.get("params") or {}
    for key in params:
        if key not in cls.defaults:
            raise EvoError(
                f"group filter {name!r} has no parameter {key!r}",
                field=f"group_filter.params.{key}",
                hint=f"known parameters: {', '.join(cls.defaults) or 'none'}",
            )
    p = {**cls.defaults, **params}
    if cls is StdGroupFilter:
        if p["mode"] not in ("top_p", "absolute"):
            raise EvoError(
                f"mode must be top_p or absolute, got {p['mode']!r}",
                field="group_filter.params.mode",
                hint="mode: top_p",
            )
        for key in ("keep_ratio", "min_keep_ratio"):
            if not 0 < p[key] <= 1 or (key == "keep_ratio" and p[key] >= 1):
                raise EvoError(
                    f"{key} must be in (0, 1), got {p[key]!r}",
                    field=f"group_filter.params.{key}",
                    hint=f"{key}: 0.9",
                )
        if not 0 < p["ema_decay"] <= 1:
            raise EvoError(
                f"ema_decay must be in (0, 1], got {p['ema_decay']!r}",
                field="group_filter.params.ema_decay",
                hint="ema_decay: 0.1",
            )


def make_filter(spec: dict[str, Any] | None) -> GroupFilter:
    """A fresh (stateless-so-far) filter from the recipe's `group_filter` section."""
    check_filter_spec(spec)
    spec = spec or {"name": "none"}
    return FILTERS[spec.get("name", "none")](**(spec.get("params") or {}))
