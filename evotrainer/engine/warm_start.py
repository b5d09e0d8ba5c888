"""The warm start: a short supervised stage on the domain's demonstrations, cached by digest.

GRPO needs reward variance within groups, so the stage stops early once sampled accuracy on
training tasks reaches `model.warm_start.stop_at_accuracy` (the probe: from a policy that is
already right every time, GRPO learns nothing). Versions sharing a base reuse the cached
result; the cache is keyed by content, so only the same base shares it: the model's digest
(its files, or the tiny model's config), the training tasks the demonstrations are made from
(every prompt and answer, whatever file or generator they came from), the warm-start
settings, the domain and environment, and the seed. A job trained on other data or other
weights behind the same paths never seeds a later one.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from evotrainer.domains import Domain, Task
from evotrainer.engine.model import load_checkpoint, model_digest, save_checkpoint
from evotrainer.engine.rollout import (
    batch_tensors,
    encode,
    prompt_ids,
    sample_episodes,
    token_logprobs,
)
from evotrainer.store.recipe import digest

DEFAULT_STOP_AT_ACCURACY = 0.35
CHECK_EVERY = 25  # SFT steps between accuracy checks
CHECK_TASKS = 64  # training tasks sampled once each per check


def warm_start_key(recipe: dict[str, Any], seed: int, tasks: list[Task]) -> str:
    """What determines the warm-started weights, by content; its digest names the cache
    entry. `tasks`: the training tasks the stage samples demonstrations from."""
    model = recipe["model"]
    return digest(
        {
            "model": model_digest(model),
            "dtype": model.get("dtype") or "float32",
            "chat_template": model.get("chat_template") or "auto",
            "warm_start": model.get("warm_start"),
            "tasks": tasks_digest(tasks),
            "domain": {
                k: recipe["domain"].get(k) for k in ("name", "params", "train_size", "val_size")
            },
            "environment": recipe.get("environment"),
            "max_response_tokens": recipe["grpo"]["max_response_tokens"],
            "seed": seed,
        }
    )


def tasks_digest(tasks: list[Task]) -> str:
    """sha256 over every task's id, prompt, answer, source and metadata, in order."""
    sha = hashlib.sha256()
    for task in tasks:
        fields = [task.task_id, task.prompt, task.answer, task.data_source, task.meta]
        sha.update(json.dumps(fields, sort_keys=True, default=repr).encode() + b"\n")
    return "sha256:" + sha.hexdigest()


def demonstration_batch(
    tokenizer: PreTrainedTokenizerBase,
    domain: Domain,
    tasks: list[Task],
    rng: random.Random,
    chat: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    rows, masks = [], []
    for task in tasks:
        ids, mask = [], []
        for text, trained in domain.demonstration(task, rng):
            piece = encode(tokenizer, text)
            ids += piece
            mask += [int(trained)] * len(piece)
        if domain.turn_end is None:  # single-turn answers end with eos, as sampled ones do
            ids.append(tokenizer.eos_token_id)
            mask.append(1)
        rows.append(prompt_ids(tokenizer, task.prompt, chat) + ids)
        masks.append(mask)
    return rows, masks


def sampled_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    domain: Domain,
    tasks: list[Task],
    env_config: dict[str, Any] | None,
    max_turn_tokens: int,
    chat: bool = False,
) -> float:
    episodes = sample_episodes(
        model, tokenizer, domain, tasks, env_config, max_turn_tokens, 1.0, 1.0, chat
    )
    return sum(domain.score(e.task, e.response, e.tool_calls).correct for e in episodes) / len(
        episodes
    )


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    domain: Domain,
    train_tasks: list[Task],
    recipe: dict[str, Any],
    env_config: dict[str, Any] | None,
    seed: int,
    cache_root: Path,
    log: Callable[[str], None],
    chat: bool = False,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Return the warm-started model (from the cache when present) and what the stage did."""
    cfg = recipe["model"].get("warm_start") or {}
    steps = cfg.get("steps", 0)
    if steps == 0:
        return model, {"steps": 0, "cached": False}
    key = warm_start_key(recipe, seed, train_tasks)
    entry = cache_root / key.removeprefix("sha256:")[:16]
    if (entry / "warm_start.json").is_file():
        info = json.loads((entry / "warm_start.json").read_text())
        log(
            f"warm start: cached {entry} ({info['steps']} steps, "
            f"sampled accuracy {info['accuracy']:.2f})"
        )
        dtype = recipe["model"].get("dtype") or "float32"
        return load_checkpoint(entry, dtype)[0], {**info, "cached": True}

    target = cfg.get("stop_at_accuracy", DEFAULT_STOP_AT_ACCURACY)
    max_tokens = recipe["grpo"]["max_response_tokens"]
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 1e-3))
    accuracy, done = float("nan"), 0
    for step in range(1, steps + 1):
        model.train()
        batch = [rng.choice(train_tasks) for _ in range(cfg.get("batch_size", 32))]
        rows, masks = demonstration_batch(tokenizer, domain, batch, rng, chat)
        ids, attn, positions, loss_mask = batch_tensors(rows, masks, tokenizer.pad_token_id)
        tail = max(len(m) for m in masks)
        loss_mask = loss_mask[:, -tail:]
        logp, _ = token_logprobs(model, ids, attn, positions, tail)
        loss = -(logp * loss_mask).sum() / loss_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done = step
        if step % CHECK_EVERY == 0 or step == steps:
            probe = rng.sample(train_tasks, min(CHECK_TASKS, len(train_tasks)))
            accuracy = sampled_accuracy(
                model, tokenizer, domain, probe, env_config, max_tokens, chat
            )
            log(f"warm start step {step}: loss {loss.item():.3f}, sampled accuracy {accuracy:.2f}")
            if target is not None and accuracy >= target:
                break
    info = {"steps": done, "accuracy": accuracy, "key": key}
    entry.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, tokenizer, entry)
    (entry / "warm_start.json").write_text(json.dumps(info, indent=2))
    return model, {**info, "cached": False}
