"""A verl 0.9.1 replay buffer that drops GRPO groups with EvoTrainer's group filters.

verl's own dynamic sampling (`algorithm.filter_groups`) evicts a finished group only when its
metric is identical across the group. This subclass, loaded through verl's custom-sampler hook
(`trainer.v1.sampler.custom_sampler.{path,name}`, copied beside the job's data at submit),
asks the recipe's filter from `evotrainer.contract.filters` instead, so the embedded engine, the
backtests and verl agree on which groups are dropped. Evicted groups are refilled with fresh
prompts, as with verl's filter.

`_dapo_filtered_keys` is a private method of verl 0.9.1: this module is pinned to that version.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
import transfer_queue as tq
from verl.trainer.ppo.v1.replay_buffer import FILTER_GROUPS_REWARD_METRIC, ReplayBuffer

from evotrainer.contract.filters import make_filter


class EvoGroupFilterReplayBuffer(ReplayBuffer):
    def __init__(self, *args: Any, sampler_kwargs: Any, **kwargs: Any) -> None:
        # verl hands a custom sampler none of the filter settings: they come from
        # sampler_kwargs.spec (JSON written by the render).
        spec = json.loads(sampler_kwargs["spec"])
        super().__init__(
            *args,
            sampler_kwargs=sampler_kwargs,
            filter_groups_metric=spec["metric"],
            train_batch_size=spec["train_batch_size"],
            gen_batch_size=1,
            max_inflight_gen_batches=spec["max_inflight_gen_batches"],
            **kwargs,
        )
        self.group_filter = make_filter(spec["filter"])

    def _group_metrics(self, partition_id: str, uids: set[str]) -> dict[str, list[float]]:
        """The filter metric of every session of the given finished groups: of its final
        output, the one verl trains on (a multi-output agent loop writes several)."""
        keys = final_outputs(k for k in self.partitions[partition_id] if k.split("_")[0] in uids)
        if not keys:
            return {}
        use_reward = self.filter_groups_metric == FILTER_GROUPS_REWARD_METRIC
        field = "rm_scores" if use_reward else "extra_fields"
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=[field])
        metrics: dict[str, list[float]] = defaultdict(list)
        for key, value in zip(keys, list(data[field]), strict=True):
            if use_reward:
                metrics[key.split("_")[0]].append(float(value.sum().item()))
            else:
                extra = getattr(value, "data", value)
                info = extra.get("reward_extra_info", {}) if isinstance(extra, dict) else {}
                metrics[key.split("_")[0]].append(float(info[self.filter_groups_metric]))
        return metrics

    def _dapo_filtered_keys(self, partition_id: str) -> tuple[set[str], Counter]:
        if partition_id == "val":
            return set(), Counter()
        cache = self._dapo_classification_cache[partition_id]
        finished = self.finished_keys[partition_id]
        for uid in cache.keys() - finished:
            del cache[uid]
        # Finished groups never change, so each is judged once, in the order they finish.
        new = sorted(finished - cache.keys())
        if new:
            metrics = self._group_metrics(partition_id, set(new))
            rewards = [np.asarray(metrics.get(uid, []), dtype=float) for uid in new]
            keep = self.group_filter.keep(rewards)
            for uid, values, kept in zip(new, rewards, keep, strict=True):
                cache[uid] = None if kept else float(values.mean()) if values.size else 0.0
        dropped = {uid: value for uid, value in cache.items() if value is not None}
        return set(dropped), Counter(dropped.values())


def final_outputs(keys: Iterable[str]) -> list[str]:
    """The keys `{uid}_{session}_{index}` with the highest index of their session, in the
    given order (verl's rule in `compute_advantage_for_multi_trajectories`)."""
    keys = list(keys)
    final: dict[str, tuple[int, str]] = {}
    for key in keys:
        session, _, index = key.rpartition("_")
        if session not in final or final[session][0] < int(index):
            final[session] = (int(index), key)
    kept = {key for _, key in final.values()}
    return [key for key in keys if key in kept]
