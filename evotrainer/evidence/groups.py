"""What a dead GRPO group is: one definition for every figure named `dead_group_ratio`.

A group (the rollouts of one prompt at one step, at least two of them) is dead when the
population std of its rewards is below DEAD_GROUP_STD: the method's dead-data ratio,
"std(group CR) < 0.001". Its advantages are then noise, however the rewards are scaled.
The engine's logged metric (`dead_groups` over a step's reward matrix), the harness SQL (the
`groups` view's `dead` column, from DEAD_GROUP_SQL) and the replay backtests all read it here,
so TensorBoard and a diagnosis say the same thing under one name.

Not the same concept: a group filter's "all rewards equal" test (contract/filters.py ZERO_STD),
which drops groups whose advantages are exactly zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# numpy is imported by the two functions: DEAD_GROUP_SQL is read where a harness revision is
# checked (`validate`, `plan`), which uses no numpy.
if TYPE_CHECKING:
    import numpy as np

DEAD_GROUP_STD = 1e-3

# The rule as a SQL expression over a group's rows (stddev_pop: the population std, as
# numpy's default), for the harness's `groups` view.
DEAD_GROUP_SQL = f"stddev_pop(reward) < {DEAD_GROUP_STD!r}"


def dead_groups(stds: np.ndarray) -> np.ndarray:
    """Whether each group is dead, from its rewards' population std."""
    import numpy as np

    return np.asarray(stds, dtype=float) < DEAD_GROUP_STD


def dead_group_ratio(rewards: np.ndarray) -> float:
    """Share of dead groups in a (groups, group size) reward matrix."""
    import numpy as np

    return float(np.mean(dead_groups(np.asarray(rewards, dtype=float).std(axis=1))))
