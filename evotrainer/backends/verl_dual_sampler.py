"""The Dual-Level filter in verl 0.9.1's replay buffer: level 1 takes the sessions our reward
function marked (`evo_excluded`) out of their group and out of the training batch, level 2
(the filter's StdGroupFilter) judges each group on the sessions left.

The reference env marks such a trajectory with a −999 reward and ROLL zeroes its response
mask. verl lets neither a reward function nor a sampler mask one sample, but a sampler
chooses the keys of the batch it hands the trainer: an excluded session is left out of it
(its TransferQueue entries cleared, as verl clears an evicted group's), so it adds nothing to
the loss or to its group's GRPO statistics, which verl computes per prompt uid on the batch
it is given. V1 already trains on groups of varying size (multi-output sessions) and pads a
batch to the data-parallel size itself.

Loaded through verl's custom-sampler hook from the file the job copies beside its data; it
imports the group-filter buffer from the evotrainer package, which verl's processes import
(the reward function needs it too). `_materialize_batch` and `_clear_groups` are private
methods of verl 0.9.1: pinned to that version, as the base is.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import transfer_queue as tq
from transfer_queue import KVBatchMeta

from evotrainer.backends.verl_sampler import EvoGroupFilterReplayBuffer, final_outputs

EXCLUDED = "evo_excluded"  # the mark backends/verl_reward.py returns
EXCLUDED_METRIC = "training/dual_level/excluded_samples"


def session_of(key: str) -> str:
    """`{uid}_{session}` of a V1 key `{uid}_{session}_{index}`."""
    return key.rsplit("_", 1)[0]


class EvoDualLevelReplayBuffer(EvoGroupFilterReplayBuffer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # partition → the sessions level 1 took out, until their group leaves the buffer.
        self.excluded: dict[str, set[str]] = defaultdict(set)
        self.last_excluded = 0

    def _group_metrics(self, partition_id: str, uids: set[str]) -> dict[str, list[float]]:
        """Each finished group's rewards (of its sessions' final outputs) without the sessions
        level 1 marked, which are remembered for the batch."""
        keys = final_outputs(k for k in self.partitions[partition_id] if k.split("_")[0] in uids)
        if not keys:
            return {}
        data = tq.kv_batch_get(
            keys=keys, partition_id=partition_id, select_fields=["rm_scores", "extra_fields"]
        )
        metrics: dict[str, list[float]] = defaultdict(list)
        for key, score, extra in zip(
            keys, list(data["rm_scores"]), list(data["extra_fields"]), strict=True
        ):
            extra = getattr(extra, "data", extra)
            info = extra.get("reward_extra_info", {}) if isinstance(extra, dict) else {}
            if float(info.get(EXCLUDED, 0.0)):
                self.excluded[partition_id].add(session_of(key))
                continue
            metrics[key.split("_")[0]].append(float(score.sum().item()))
        return metrics

    def _materialize_batch(
        self, partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict
    ) -> KVBatchMeta:
        batch = super()._materialize_batch(partition_id, selected_prompt_uids, partition_snapshot)
        out = self.excluded[partition_id]
        dropped = [key for key in batch.keys if session_of(key) in out]
        if dropped:
            tq.kv_clear(partition_id=partition_id, keys=dropped)
            for key in dropped:
                self.partitions[partition_id].pop(key, None)
        selected = set(selected_prompt_uids)
        self.excluded[partition_id] = {s for s in out if s.split("_")[0] not in selected}
        self.last_excluded = len({session_of(key) for key in dropped})
        kept = [(k, t) for k, t in zip(batch.keys, batch.tags, strict=True) if k not in dropped]
        return KVBatchMeta(
            partition_id=partition_id, keys=[k for k, _ in kept], tags=[t for _, t in kept]
        )

    def _clear_groups(self, partition_id: str, uids: set[str]) -> None:
        super()._clear_groups(partition_id, uids)
        self.excluded[partition_id] = {
            s for s in self.excluded[partition_id] if s.split("_")[0] not in uids
        }

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict]:
        self.last_excluded = 0
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        if partition_id != "val":
            metrics[EXCLUDED_METRIC] = self.last_excluded
        return batch, metrics
