"""Write the golden verl dumps in this folder with verl's OWN writer code, and verl's own
metrics for them.

What runs is verl's code, on the CPU, on trainer objects made with `object.__new__` that hold
just the attributes the methods read:

- legacy trainer (`verl.trainer.ppo.ray_trainer.RayPPOTrainer`): the whole `_validate()`
  (real `RLHFDataset`, `collate_fn`, `StatefulDataLoader`, `DataProto.repeat`/`union`,
  `pad_dataproto_to_divisor`, `extract_reward`, `_val_metrics_update` →
  `process_validation_metrics`) and `_log_rollout_data` on a train batch built the way
  `fit()` builds it (uuid per prompt, `repeat(n, interleave=True)`, union).
- V1 trainer (`verl.trainer.ppo.v1.trainer_base.PPOTrainer`): `_validate()` and
  `_log_rollout_data` with a dict-backed stand-in for TransferQueue (`kv_batch_put/get`,
  `kv_clear`) and a scripted agent loop that writes `{uid}_{session}_{index}` keys, one
  session producing two outputs (multi-output agent loop).

Only the rollout server is scripted: a fixed response per (dataset row, sample), scored with
verl's `default_compute_score` (gsm8k rule). The reward extras are `acc`, `task_id` and
`data_source`, as our reward module (`evotrainer/backends/verl_reward.py`) returned before it
also returned the dataset row's `index` (the exact legacy group key, which
tests/test_verl_groups.py adds to these dumps in balanced and shuffled orders). The dataset
has two rows with the same prompt text and different answers (duplicate prompts).

verl's own numbers go to `verl_metrics.json`: the validation metric dicts `_validate()`
returns, and for the train batches the GRPO groups from `compute_grpo_outcome_advantage`
(legacy, per uid) and `compute_advantage_for_multi_trajectories` (V1, final output per
session), a group being dead when verl gives all its samples a zero advantage.

Needs, beyond `.ci/run`'s verl chain (verl 0.9.1 --no-deps, torch, tensordict, transformers,
ray, hydra-core, omegaconf, codetiming), installed --no-deps into a THROWAWAY target:

    .venv/bin/pip install --no-deps --target /tmp/verlextra torchdata datasets pandas dill \\
        multiprocess xxhash fsspec TransferQueue pyzmq msgspec python-dateutil pytz tzdata \\
        pillow cachetools uvicorn
    PYTHONPATH=/tmp/verlextra .venv/bin/python tests/golden/verl/generate.py

(the import of `verl.trainer.ppo.*` names the next missing module if a new verl needs more).
To regenerate for a new verl version: install it into the venv, rerun the two lines, read the
diff of the dumps and of verl_metrics.json, and fix what the method signatures or stand-ins
need (the attributes each method reads are set in `legacy_trainer` / `v1_trainer`). The
tokenizer in `tokenizer/` is a word-level one built here (no download).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
TRAIN_N = 4  # actor_rollout_ref.rollout.n
VAL_N = 4  # actor_rollout_ref.rollout.val_kwargs.n
RESPONSE_LENGTH = 8
DATA_SOURCE = "openai/gsm8k"

# (question, answer). Rows 1 and 2 share their prompt text: a dataset with duplicate prompts.
ROWS = [
    ("what is two plus two", "4"),
    ("name the number after four", "5"),
    ("name the number after four", "6"),
    ("what is three times three", "9"),
]
# Scripted responses per dataset row, one per sample: "#### N" answers, a wrong one, a cut one.
RESPONSES = [
    ["the answer #### 4", "the answer #### 4", "the answer #### 4", "the answer #### 4"],
    ["it is #### 5", "it is #### 6", "it is #### 5", "no idea"],
    ["it is #### 5", "it is #### 5", "it is #### 5", "it is #### 5"],
    ["#### 9", "#### 9", "so so so so so so so so so", "#### 9"],
]
# V1 multi-output: (dataset row, session) whose agent loop returns two outputs; the earlier
# one is a wrong draft, the final one the scripted response.
MULTI_OUTPUT = {(1, 3), (3, 2)}
DRAFT = "draft #### 7"


def build_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"user", "assistant", ":", DRAFT}
    for question, _ in ROWS:
        words.update(question.split())
    for responses in RESPONSES:
        for response in responses:
            words.update(response.split())
    words.update(DRAFT.split())
    specials = ["<pad>", "<unk>", "<eos>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(words - set(specials)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    tokenizer.save_pretrained(path)
    return tokenizer


def write_dataset(path: Path) -> None:
    rows = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "val", "index": i, "task_id": f"t{i}", "question": question},
        }
        for i, (question, answer) in enumerate(ROWS)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def dataloader(parquet: Path, tokenizer: Any, batch_size: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    config = OmegaConf.create(
        {
            "prompt_key": "prompt",
            "max_prompt_length": 64,
            "filter_overlong_prompts": False,
            "cache_dir": tempfile.mkdtemp(),
            "return_raw_chat": True,
        }
    )
    dataset = RLHFDataset(data_files=[str(parquet)], tokenizer=tokenizer, config=config)
    return StatefulDataLoader(
        dataset, batch_size=batch_size, shuffle=False, drop_last=False, collate_fn=collate_fn
    )


def score(row: int, text: str) -> float:
    from verl.utils.reward_score import default_compute_score

    return float(default_compute_score(DATA_SOURCE, text, ROWS[row][1]))


def encode(tokenizer: Any, texts: list[str], length: int, *, left: bool) -> torch.Tensor:
    """Token ids padded to `length` (prompts on the left, responses on the right, as verl)."""
    rows = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)[:length]
        pad = [tokenizer.pad_token_id] * (length - len(ids))
        rows.append(pad + ids if left else ids + pad)
    return torch.tensor(rows, dtype=torch.long)


def last_token_scores(responses: torch.Tensor, scores: list[float], pad_id: int) -> torch.Tensor:
    """Token-level scores as verl's reward loop writes them: the score on the last token."""
    out = torch.zeros(responses.shape, dtype=torch.float32)
    for i, value in enumerate(scores):
        last = int((responses[i] != pad_id).sum().item()) - 1
        out[i, max(last, 0)] = value
    return out


class ScriptedRollout:
    """Legacy `async_rollout_manager`: prompts rendered with the chat template, the scripted
    response of each (dataset row, sample), rm_scores and reward extras as verl's reward loop
    returns them (`meta_info.reward_extra_keys`)."""

    def __init__(self, tokenizer: Any, n: int) -> None:
        self.tokenizer, self.n = tokenizer, n

    def generate_sequences(self, batch: Any) -> Any:
        from verl.protocol import DataProto

        rows = [int(info["index"]) for info in batch.non_tensor_batch["extra_info"]]
        samples = [i % self.n for i in range(len(rows))]  # repeat(interleave=True) order
        prompts = [
            self.tokenizer.apply_chat_template(
                list(raw), tokenize=False, add_generation_prompt=True
            )
            for raw in batch.non_tensor_batch["raw_prompt"]
        ]
        texts = [RESPONSES[r][s] for r, s in zip(rows, samples, strict=True)]
        responses = encode(self.tokenizer, texts, RESPONSE_LENGTH, left=False)
        values = [score(r, t) for r, t in zip(rows, texts, strict=True)]
        out = DataProto.from_dict(
            tensors={
                "prompts": encode(self.tokenizer, prompts, 16, left=True),
                "responses": responses,
                "rm_scores": last_token_scores(responses, values, self.tokenizer.pad_token_id),
            },
            non_tensors={
                "acc": np.array(values, dtype=object),
                "task_id": np.array([f"t{r}" for r in rows], dtype=object),
            },
        )
        out.meta_info["reward_extra_keys"] = ["acc", "task_id", "data_source"]
        return out


def legacy_trainer(tokenizer: Any, parquet: Path, out: Path) -> Any:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "n": TRAIN_N,
                    "val_kwargs": {"n": VAL_N, "do_sample": True},
                    "agent": {"num_workers": 1},
                }
            },
            "trainer": {"validation_data_dir": str(out / "val"), "log_val_generations": 0},
        }
    )
    trainer.tokenizer = tokenizer
    trainer.val_dataloader = dataloader(parquet, tokenizer, batch_size=len(ROWS))
    trainer.async_rollout_manager = ScriptedRollout(tokenizer, VAL_N)
    trainer.use_rm = False
    trainer.global_steps = 2
    trainer._init_dump_executor()
    return trainer


def run_legacy(tokenizer: Any, parquet: Path) -> dict:
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.reward import extract_reward

    out = HERE / "legacy"
    trainer = legacy_trainer(tokenizer, parquet, out)
    val_metrics = trainer._validate()

    # A train step as fit() makes it: a uid per prompt, n interleaved samples, the rollout.
    trainer.global_steps = 1
    batch = DataProto.from_single_dict(next(iter(trainer.val_dataloader)))
    batch.non_tensor_batch["uid"] = np.array(
        [str(uuid.uuid4()) for _ in range(len(batch))], dtype=object
    )
    batch = batch.repeat(repeat_times=TRAIN_N, interleave=True)
    rollout = ScriptedRollout(tokenizer, TRAIN_N).generate_sequences(trainer._get_gen_batch(batch))
    batch = batch.union(rollout)
    reward_tensor, reward_extra = extract_reward(batch)
    batch.batch["token_level_scores"] = reward_tensor
    trainer._log_rollout_data(batch, reward_extra, {}, str(out / "train"))
    trainer._shutdown_dump_executor()

    mask = (batch.batch["responses"] != tokenizer.pad_token_id).float()
    advantages, _ = compute_grpo_outcome_advantage(
        reward_tensor, mask, batch.non_tensor_batch["uid"]
    )
    train = train_figures(
        list(batch.non_tensor_batch["uid"]), advantages, reward_tensor.sum(-1).tolist()
    )
    return {"val": to_float(val_metrics), "train": train}


def train_figures(groups: list[str], advantages: torch.Tensor, scores: list[float]) -> dict:
    """verl's GRPO groups: a group is dead when verl gives every sample a zero advantage."""
    by_group: dict[str, list[float]] = defaultdict(list)
    for group, row in zip(groups, advantages, strict=True):
        by_group[group].append(float(row.abs().sum()))
    dead = sum(all(a == 0 for a in values) for values in by_group.values())
    return {
        "groups": len(by_group),
        "dead_groups": dead,
        "dead_group_ratio": dead / len(by_group),
        "samples": len(scores),
        "reward_mean": float(np.mean(scores)),
    }


class TransferQueueStandIn:
    """The `transfer_queue` calls trainer_base makes, over a dict: fields per (partition, key)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], dict[str, Any]] = {}

    def kv_batch_put(
        self,
        keys: list[str],
        partition_id: str,
        tags: list[dict] | None = None,
        fields: list[dict] | None = None,
    ) -> None:
        for i, key in enumerate(keys):
            self.rows[(partition_id, key)] = dict(fields[i]) if fields else {}

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> dict:
        rows = [self.rows[(partition_id, key)] for key in keys]
        out: dict[str, Any] = {}
        for name in select_fields:
            values = [row[name] for row in rows]
            if isinstance(values[0], torch.Tensor):
                out[name] = torch.nested.nested_tensor(values, layout=torch.jagged)
            else:
                array = np.empty(len(values), dtype=object)
                array[:] = values
                out[name] = array
        return out

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        for key in keys:
            self.rows.pop((partition_id, key), None)


class ScriptedAgentLoop:
    """V1 agent loop: for each prompt uid and session, one output (two in MULTI_OUTPUT), put
    into TransferQueue under `{uid}_{session}_{index}` with verl's fields."""

    def __init__(self, tq: TransferQueueStandIn, tokenizer: Any, n: int, partition: str) -> None:
        self.tq, self.tokenizer, self.n, self.partition = tq, tokenizer, n, partition
        self.keys: list[str] = []

    def generate_sequences(self, batch: Any) -> None:
        self.keys = []
        for pos, uid in enumerate(batch["uid"]):
            row = int(batch["extra_info"][pos]["index"])
            prompt = self.tokenizer.apply_chat_template(
                list(batch["raw_prompt"][pos]), tokenize=False, add_generation_prompt=True
            )
            for session in range(self.n):
                final = RESPONSES[row][session]
                texts = [DRAFT, final] if (row, session) in MULTI_OUTPUT else [final]
                for index, text in enumerate(texts):
                    value = score(row, text)
                    ids = self.tokenizer.encode(text, add_special_tokens=False)[:RESPONSE_LENGTH]
                    ids = torch.tensor(ids)
                    rm = torch.zeros(len(ids))
                    rm[-1] = value
                    key = f"{uid}_{session}_{index}"
                    self.keys.append(key)
                    self.tq.rows[(self.partition, key)] = {
                        "uid": str(uid),
                        "prompts": torch.tensor(self.tokenizer.encode(prompt)),
                        "responses": ids,
                        "rm_scores": rm,
                        "num_turns": 2,
                        "reward_model": {"ground_truth": ROWS[row][1]},
                        "data_source": str(batch["data_source"][pos]),
                        "extra_fields": {
                            "reward_extra_info": {
                                "acc": value,
                                "task_id": f"t{row}",
                                "data_source": DATA_SOURCE,
                            }
                        },
                    }


class Batch:
    """The KVBatchMeta fields trainer_base reads."""

    def __init__(self, keys: list[str], partition_id: str) -> None:
        self.keys, self.partition_id = keys, partition_id


class ReplayBufferStandIn:
    def __init__(self, loop: ScriptedAgentLoop) -> None:
        self.loop = loop

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Batch, None]:
        return Batch(list(self.loop.keys), partition_id), None


def run_v1(tokenizer: Any, parquet: Path) -> dict:
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    out = HERE / "v1"
    tq = TransferQueueStandIn()
    trainer_base.tq = tq  # the module's `import transfer_queue as tq`
    # PPOTrainer is abstract in its per-mode hooks, which the methods run here never call.
    concrete = type(
        "PPOTrainerUnderTest",
        (trainer_base.PPOTrainer,),
        {"on_sample_end": None, "on_step_end": None},
    )
    trainer = object.__new__(concrete)
    trainer.config = OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"n": TRAIN_N, "val_kwargs": {"n": VAL_N}}},
            "trainer": {"validation_data_dir": str(out / "val"), "log_val_generations": 0},
        }
    )
    trainer.tokenizer = tokenizer
    trainer.val_dataloader = dataloader(parquet, tokenizer, batch_size=len(ROWS))
    loop = ScriptedAgentLoop(tq, tokenizer, VAL_N, "val")
    trainer.agent_loop_manager = loop
    trainer.replay_buffer = ReplayBufferStandIn(loop)
    trainer.reward_loop_manager = type("RewardLoop", (), {"reward_loop_worker_handles": []})()
    trainer.global_steps = 2
    trainer._init_dump_executor()
    val_metrics = trainer._validate()

    # A train step: the agent loop fills the "train" partition, _log_rollout_data dumps it.
    trainer.global_steps = 1
    train_batch = next(iter(trainer.val_dataloader))
    train_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(ROWS))], dtype=object)
    train_loop = ScriptedAgentLoop(tq, tokenizer, TRAIN_N, "train")
    train_loop.generate_sequences(train_batch)
    keys = list(train_loop.keys)
    trainer._log_rollout_data(Batch(keys, "train"), {}, str(out / "train"))
    trainer._shutdown_dump_executor()

    data = tq.kv_batch_get(keys, "train", ["responses", "rm_scores", "uid"])
    responses = data["responses"].to_padded_tensor(padding=0.0)
    rewards = data["rm_scores"].to_padded_tensor(padding=0.0)
    mask = (
        torch.arange(responses.shape[1])[None, :]
        < torch.tensor([len(r) for r in data["responses"].unbind()])[:, None]
    ).float()
    proto = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask},
        non_tensors={"uid": data["uid"]},
    )
    proto = compute_advantage_for_multi_trajectories(proto, keys, AdvantageEstimator.GRPO)
    final = final_output_positions(keys)
    scores = rewards.sum(-1).tolist()
    train = train_figures(list(data["uid"]), proto.batch["advantages"], scores)
    train["sessions"] = len(final)
    # verl trains on the final output of each session (compute_advantage_for_multi_trajectories)
    train["reward_mean"] = float(np.mean([scores[i] for i in final]))
    return {"val": to_float(val_metrics), "train": train}


def final_output_positions(keys: list[str]) -> list[int]:
    """verl's rule (trainer_base / v1.utils): the highest index of each {uid}_{session}."""
    best: dict[str, tuple[int, int]] = {}
    for pos, key in enumerate(keys):
        uid, session, index = key.rsplit("_", 2)
        if f"{uid}_{session}" not in best or best[f"{uid}_{session}"][0] < int(index):
            best[f"{uid}_{session}"] = (int(index), pos)
    return sorted(pos for _, pos in best.values())


def to_float(metrics: dict) -> dict:
    return {k: float(v) for k, v in sorted(metrics.items())}


def main() -> None:
    import verl

    for flavour in ("legacy", "v1"):
        shutil.rmtree(HERE / flavour, ignore_errors=True)
    tokenizer = build_tokenizer(HERE / "tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        parquet = Path(tmp) / "data.parquet"
        write_dataset(parquet)
        figures = {
            "verl_version": verl.__version__,
            "train_n": TRAIN_N,
            "val_n": VAL_N,
            "response_length": RESPONSE_LENGTH,
            "legacy": run_legacy(tokenizer, parquet),
            "v1": run_v1(tokenizer, parquet),
        }
    (HERE / "verl_metrics.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    print(json.dumps(figures, indent=2), file=sys.stderr)


if __name__ == "__main__":
    main()
