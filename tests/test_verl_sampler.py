"""The group-filter replay buffer's own logic.

Real: `evotrainer/backends/verl_sampler.py` and the engine's `std_group_filter`.
Stand-in: verl's `ReplayBuffer` base and TransferQueue, whose import chain (datasets, peft,
torchdata, fastapi, … on top of torch) is too heavy for CPU CI. The stand-in keeps the 0.9.1
constructor keywords and the attributes the subclass reads (see verl's replay_buffer.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import sys
import types
from collections import defaultdict
from pathlib import Path

import torch

SAMPLER = Path(__file__).parents[1] / "evotrainer" / "backends" / "verl_sampler.py"


class StandInReplayBuffer:
    def __init__(
        self,
        trainer_mode,
        trainer_config,
        max_off_policy_threshold,
        max_off_policy_strategy,
        sampler_kwargs,
        poll_interval=2.0,
        refill_fn=None,
        filter_groups_metric=None,
        train_batch_size=None,
        gen_batch_size=None,
        max_inflight_gen_batches=1,
        sync_refill_failed_groups=False,
    ):
        self.filter_groups_metric = filter_groups_metric
        self.train_batch_size = train_batch_size
        self.gen_batch_size = gen_batch_size
        self.partitions = defaultdict(dict)
        self.finished_keys = defaultdict(set)
        self._dapo_classification_cache = defaultdict(dict)

    # verl 0.9.1's own bodies of the two methods the dual-level buffer extends (TransferQueue
    # calls go to the stand-in module).
    def _materialize_batch(self, partition_id, selected_prompt_uids, partition_snapshot):
        tq = sys.modules["transfer_queue"]
        tq.kv_clear(partition_id=partition_id, keys=selected_prompt_uids)
        keys, tags = [], []
        selected = set(selected_prompt_uids)
        for key, tag in partition_snapshot.items():
            if key.split("_")[0] in selected:
                keys.append(key)
                tags.append(tag)
        return tq.KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags)

    def _clear_groups(self, partition_id, uids):
        keys = {key for key in self.partitions[partition_id] if key.split("_")[0] in uids}
        sys.modules["transfer_queue"].kv_clear(partition_id=partition_id, keys=[*uids, *keys])
        for key in keys:
            del self.partitions[partition_id][key]


@dataclasses.dataclass
class KVBatchMeta:  # TransferQueue's batch handle: the fields verl's buffer fills
    partition_id: str
    keys: list
    tags: list


def load_sampler(monkeypatch, rewards: dict[str, float], marked: frozenset[str] = frozenset(),
                 cleared: list | None = None):
    cleared = [] if cleared is None else cleared
    """The sampler module over stand-ins; `marked`: the keys our reward function marked
    evo_excluded; `cleared` collects the keys cleared from TransferQueue."""
    fake_tq = types.ModuleType("transfer_queue")
    fake_tq.kv_batch_get = lambda keys, partition_id, select_fields: {
        "rm_scores": [torch.tensor([0.0, rewards[k]], dtype=torch.float64) for k in keys],
        "extra_fields": [
            {"reward_extra_info": {"evo_excluded": float(k in marked)}} for k in keys
        ],
    }
    fake_tq.kv_clear = lambda partition_id, keys: cleared.extend(keys)
    fake_tq.KVBatchMeta = KVBatchMeta
    fake_rb = types.ModuleType("verl.trainer.ppo.v1.replay_buffer")
    fake_rb.ReplayBuffer = StandInReplayBuffer
    fake_rb.FILTER_GROUPS_REWARD_METRIC = "reward"
    monkeypatch.setitem(sys.modules, "transfer_queue", fake_tq)
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.v1.replay_buffer", fake_rb)
    spec = importlib.util.spec_from_file_location("evo_verl_sampler", SAMPLER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EvoGroupFilterReplayBuffer


def test_sampler_drops_the_groups_the_engine_filter_drops(monkeypatch):
    # Group "a" is dead (all equal), "b" barely varies, "c" and "d" are informative.
    group_rewards = {"a": [1, 1], "b": [0.5, 0.52], "c": [0, 1], "d": [1, 0]}
    rewards = {f"{g}_{s}_0": r for g, rs in group_rewards.items() for s, r in enumerate(rs)}
    cls = load_sampler(monkeypatch, rewards)
    spec = {
        "metric": "reward",
        "train_batch_size": 4,
        "max_inflight_gen_batches": 1,
        "filter": {
            "name": "std_group_filter",
            "params": {"mode": "absolute", "min_std_threshold": 0.1, "min_keep_ratio": 0.1},
        },
    }
    buffer = cls(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        sampler_kwargs={"spec": json.dumps(spec)},
        refill_fn=lambda n: None,
    )
    assert (buffer.filter_groups_metric, buffer.gen_batch_size) == ("reward", 1)
    buffer.partitions["train"] = {key: {} for key in rewards}
    buffer.finished_keys["train"] = set(group_rewards)
    dropped, counts = buffer._dapo_filtered_keys("train")
    assert dropped == {"a", "b"}
    assert counts == {1.0: 1, 0.51: 1}
    assert buffer._dapo_filtered_keys("val") == (set(), {})
    # Judged once: a group that finished earlier keeps its verdict.
    assert buffer._dapo_filtered_keys("train")[0] == {"a", "b"}


def test_sampler_judges_a_multi_output_session_by_its_final_output(monkeypatch):
    # Group "m": session 0 wrote a draft (index 0, reward 0) then its final output (index 1,
    # reward 1); session 1 one output (reward 1). verl trains on final outputs only
    # (compute_advantage_for_multi_trajectories), so "m" is dead: [1, 1], not [0, 1, 1].
    rewards = {"m_0_0": 0.0, "m_0_1": 1.0, "m_1_0": 1.0, "c_0_0": 0.0, "c_1_0": 1.0}
    cls = load_sampler(monkeypatch, rewards)
    spec = {
        "metric": "reward",
        "train_batch_size": 2,
        "max_inflight_gen_batches": 1,
        "filter": {"name": "zero_std", "params": {}},
    }
    buffer = cls(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        sampler_kwargs={"spec": json.dumps(spec)},
        refill_fn=lambda n: None,
    )
    buffer.partitions["train"] = {key: {} for key in rewards}
    buffer.finished_keys["train"] = {"m", "c"}
    dropped, counts = buffer._dapo_filtered_keys("train")
    assert dropped == {"m"} and counts == {1.0: 1}


def test_dual_level_buffer_takes_marked_sessions_out_of_groups_and_batch(monkeypatch):
    """Level 1 in verl: sessions our reward function marked leave their group before level 2
    and leave the training batch (cleared from TransferQueue). Hand-computed, absolute level 2
    at 0.3: group "g" [1, 0, 0 | marked 1]: left [1, 0, 0], std 0.471, kept, 3 sessions
    trained; group "h" [1, 1, 1 | marked 0]: left [1, 1, 1], std 0, dropped (with the marked
    idle failure it would have had std 0.433 and trained on it)."""
    group_rewards = {"g": [1.0, 0.0, 0.0, 1.0], "h": [1.0, 1.0, 1.0, 0.0]}
    rewards = {f"{g}_{s}_0": r for g, rs in group_rewards.items() for s, r in enumerate(rs)}
    cleared: list[str] = []
    load_sampler(monkeypatch, rewards, frozenset({"g_3_0", "h_3_0"}), cleared)
    # The dual buffer imports the group-filter buffer by name: both imported afresh over the
    # stand-ins, and sys.modules left as it was found (monkeypatch restores each entry).
    for name in ("evotrainer.backends.verl_sampler", "evotrainer.backends.verl_dual_sampler"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        del sys.modules[name]
    dual = importlib.import_module("evotrainer.backends.verl_dual_sampler")
    spec = {
        "metric": "reward",
        "train_batch_size": 1,
        "max_inflight_gen_batches": 1,
        "filter": {"name": "dual_level", "params": {
            "mode": "absolute", "min_std_threshold": 0.3, "min_keep_ratio": 0.01}},
    }
    buffer = dual.EvoDualLevelReplayBuffer(
        trainer_mode="sync", trainer_config={}, max_off_policy_threshold=8,
        max_off_policy_strategy="drop", sampler_kwargs={"spec": json.dumps(spec)},
        refill_fn=lambda n: None,
    )
    buffer.partitions["train"] = {key: {"step": 1} for key in rewards}
    buffer.finished_keys["train"] = set(group_rewards)
    dropped, counts = buffer._dapo_filtered_keys("train")
    assert dropped == {"h"} and counts == {1.0: 1}
    assert buffer.excluded["train"] == {"g_3", "h_3"}
    batch = buffer._materialize_batch("train", ["g"], dict(buffer.partitions["train"]))
    assert batch.keys == ["g_0_0", "g_1_0", "g_2_0"] and len(batch.tags) == 3
    assert cleared == ["g", "g_3_0"]  # the prompt (verl's own clear), then the marked session
    assert "g_3_0" not in buffer.partitions["train"] and buffer.last_excluded == 1
    buffer._clear_groups("train", {"h"})  # verl evicts the dropped group
    assert buffer.excluded["train"] == set()
