"""Group filters: which GRPO groups (and, for `dual_level`, which trajectories) enter the loss.

A filter sees one batch of groups at a time as plain arrays of rewards and answers a boolean
mask; it may keep state across calls (the EMA filter does). The engine calls it once per
training step, and the backtest tool replays it over stored rollouts the same way, so the
numbers agree. Registry: `FILTERS` (name → class) and `make_filter(spec)` for the recipe's
`group_filter: {name, params}`; each class declares its parameters as `params_schema`.

A filter may also exclude single trajectories before the group level (`exclude`, the method's
level 1: abandonment, idle failure, echo traps, truncation). `filter_batch` applies both
levels in the one order every caller uses: excluded trajectories leave their group first (no
loss, not counted in the group's statistics), then the group test runs on what is left.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, ClassVar

import jsonschema

from evotrainer.errors import EvoError

# numpy is imported where a filter computes: checking a recipe's `group_filter` (on every
# `validate` and `plan`) reads only FILTERS' names, defaults and params schemas.
if TYPE_CHECKING:
    import numpy as np

# "All rewards equal" up to the rounding of weighted float sums: such a group's advantages
# are exactly zero, so the zero-std filters drop it. Not the dead-group rule behind every
# `dead_group_ratio` (evidence/groups.py: std < 1e-3), which also counts groups whose rewards
# differ by less than any signal.
ZERO_STD = 1e-8


def group_stds(group_rewards: Sequence[np.ndarray]) -> np.ndarray:
    """Population std of each group; a group with no reward left (all excluded) has none to
    spread, so 0 (np.std of nothing is nan)."""
    import numpy as np

    return np.array(
        [float(np.std(a)) if (a := np.asarray(r, dtype=float)).size else 0.0 for r in group_rewards]
    )


@dataclass(frozen=True)
class Trajectory:
    """What the trajectory level reads of one rollout. `turns` and `tool_calls` are None for a
    single-turn domain (its rules about acting on the task do not apply); `truncated` None when
    the length is unknown (a verl reward function never sees it)."""

    correct: float
    turns: int | None = None
    tool_calls: Sequence[Mapping[str, str]] | None = None
    truncated: bool | None = None


class GroupFilter:
    """Base: keep every group and every trajectory. Subclasses declare `defaults` (their
    parameters) and `params_schema` (the JSON Schema of `group_filter.params`)."""

    name: ClassVar[str] = "none"
    defaults: ClassVar[dict[str, Any]] = {}
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }

    def __init__(self, **params: Any) -> None:
        self.params = {**self.defaults, **params}

    def exclude(self, trajectory: Trajectory) -> str | None:
        """Why this trajectory leaves its group before the group test (None: it stays)."""
        return None

    def keep(self, group_rewards: Sequence[np.ndarray]) -> np.ndarray:
        import numpy as np

        return np.ones(len(group_rewards), dtype=bool)


class ZeroStdFilter(GroupFilter):
    """Drop groups whose rewards are all equal: their advantages are 0 and they only dilute
    the token-mean (DAPO's dynamic-sampling criterion without the resampling)."""

    name = "zero_std"
    params_schema = GroupFilter.params_schema

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
    params_schema = {
        "type": "object",
        "properties": {
            "mode": {"enum": ["top_p", "absolute"]},
            "keep_ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "min_keep_ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "ema_decay": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "min_std_threshold": {"type": "number", "minimum": 0},
        },
        "additionalProperties": False,
    }

    def __init__(self, **params: Any) -> None:
        import numpy as np

        super().__init__(**params)
        p = self.params
        self.z = NormalDist().inv_cdf(p["keep_ratio"])
        self.warmup = max(20, int(np.ceil(1.0 / p["ema_decay"])))
        self.seen = 0
        self.ema_mean: float | None = None
        self.ema_var = 0.0

    def threshold(self) -> float:
        """The current std threshold (0 during warm-up)."""
        import numpy as np

        if self.params["mode"] == "absolute":
            return self.params["min_std_threshold"]
        if self.seen < self.warmup or self.ema_mean is None:
            return 0.0
        return self.ema_mean - self.z * float(np.sqrt(self.ema_var))

    def keep(self, group_rewards: Sequence[np.ndarray]) -> np.ndarray:
        import numpy as np

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


# Tool calls that are not an action on the task: a call that did not parse, or reached a tool
# the environment does not offer (the domains record both under these names).
NOT_AN_ACTION = ("invalid", "unavailable")


class DualLevelFilter(GroupFilter):
    """The method's Dual-Level filter: trajectory-level anomaly exclusion (level 1), then
    StdGroupFilter on what is left of each group (level 2).

    Level 1 (the reference env's −999 cases), for a multi-turn trajectory:
    - `abandonment`: at most `abandon_max_turns` turns and no action on the task;
    - `idle`: no action on the task and incorrect;
    - `echo_trap`: more than `echo_min_turns` turns and incorrect, or (`echo_min_repeats` set)
      that many identical calls in a row and incorrect;
    and for any trajectory `truncated` (cut at the length budget) when `exclude_truncated`.
    An action is a tool call named in `action_tools`, or, when that is null, any call that
    parsed and reached an offered tool. Dropping degenerate trajectories first can raise a
    group's spread (the reference's rationale); a group left with fewer than two has none and
    is dropped by level 2. Level 2's parameters are StdGroupFilter's, with its defaults.
    """

    name = "dual_level"
    trajectory_defaults: ClassVar[dict[str, Any]] = {
        "abandon_max_turns": 3,
        "echo_min_turns": 60,
        "echo_min_repeats": None,
        "exclude_truncated": True,
        "action_tools": None,
    }
    defaults = {**trajectory_defaults, **StdGroupFilter.defaults}
    params_schema = {
        "type": "object",
        "properties": {
            "abandon_max_turns": {"type": "integer", "minimum": 0},
            "echo_min_turns": {"type": "integer", "minimum": 1},
            "echo_min_repeats": {"type": ["integer", "null"], "minimum": 2},
            "exclude_truncated": {"type": "boolean"},
            "action_tools": {"type": ["array", "null"], "items": {"type": "string"}},
            **StdGroupFilter.params_schema["properties"],
        },
        "additionalProperties": False,
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.group_level = StdGroupFilter(
            **{key: self.params[key] for key in StdGroupFilter.defaults}
        )

    def exclude(self, trajectory: Trajectory) -> str | None:
        p = self.params
        if p["exclude_truncated"] and trajectory.truncated:
            return "truncated"
        if trajectory.turns is None or trajectory.tool_calls is None:
            return None  # single-turn: no tool to act with
        names = [str(call.get("name", "")) for call in trajectory.tool_calls]
        actions = p["action_tools"]
        acted = any(
            (n in actions) if actions is not None else (n not in NOT_AN_ACTION) for n in names
        )
        failed = not trajectory.correct
        if not acted and trajectory.turns <= p["abandon_max_turns"]:
            return "abandonment"
        if not acted and failed:
            return "idle"
        if failed and trajectory.turns > p["echo_min_turns"]:
            return "echo_trap"
        repeats = p["echo_min_repeats"]
        if failed and repeats is not None and longest_repeat(trajectory.tool_calls) >= repeats:
            return "echo_trap"
        return None

    def keep(self, group_rewards: Sequence[np.ndarray]) -> np.ndarray:
        return self.group_level.keep(group_rewards)

    def threshold(self) -> float:
        return self.group_level.threshold()


def longest_repeat(tool_calls: Sequence[Mapping[str, str]]) -> int:
    """The longest run of identical consecutive calls (same name and arguments)."""
    longest = run = 0
    previous: tuple[str, str] | None = None
    for call in tool_calls:
        current = (str(call.get("name", "")), str(call.get("args", "")))
        run = run + 1 if current == previous else 1
        longest, previous = max(longest, run), current
    return longest


FILTERS: dict[str, type[GroupFilter]] = {
    cls.name: cls for cls in (GroupFilter, ZeroStdFilter, StdGroupFilter, DualLevelFilter)
}


@dataclass
class BatchDecision:
    """One step's filtering: the groups kept, each group's excluded members (True = out),
    and how many trajectories each level-1 rule took out."""

    keep_groups: np.ndarray
    excluded: list[np.ndarray]
    reasons: Counter = field(default_factory=Counter)

    def sample_mask(self) -> np.ndarray:
        """Per trajectory, in group order: does it enter the loss?"""
        import numpy as np

        if not self.excluded:
            return np.zeros(0, dtype=bool)
        return np.concatenate(
            [keep & ~out for keep, out in zip(self.keep_groups, self.excluded, strict=True)]
        )


def filter_batch(
    group_filter: GroupFilter,
    group_rewards: Sequence[np.ndarray],
    trajectories: Sequence[Sequence[Trajectory]] | None = None,
) -> BatchDecision:
    """Both levels over one step's groups: level 1 on each trajectory (when `trajectories`,
    parallel to `group_rewards`, is given), then the group test on each group's remaining
    rewards. Without trajectories nothing is excluded (a table with no turns, tool calls or
    lengths: the group level alone)."""
    import numpy as np

    rewards = [np.asarray(r, dtype=float) for r in group_rewards]
    reasons: Counter = Counter()
    excluded = []
    for index, group in enumerate(rewards):
        out = np.zeros(group.size, dtype=bool)
        if trajectories is not None:
            for member, trajectory in enumerate(trajectories[index]):
                reason = group_filter.exclude(trajectory)
                if reason is not None:
                    out[member] = True
                    reasons[reason] += 1
        excluded.append(out)
    keep = group_filter.keep([group[~out] for group, out in zip(rewards, excluded, strict=True)])
    return BatchDecision(np.asarray(keep, dtype=bool), excluded, reasons)


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
    problem = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(cls.params_schema).iter_errors(params)
    )
    if problem is not None:
        where = ".".join(str(part) for part in problem.absolute_path)
        raise EvoError(
            f"group filter {name!r}: {problem.message}",
            field=f"group_filter.params.{where}" if where else "group_filter.params",
            hint=f"defaults: {cls.defaults}",
        )


def make_filter(spec: dict[str, Any] | None) -> GroupFilter:
    """A fresh (stateless-so-far) filter from the recipe's `group_filter` section."""
    check_filter_spec(spec)
    spec = spec or {"name": "none"}
    return FILTERS[spec.get("name", "none")](**(spec.get("params") or {}))
