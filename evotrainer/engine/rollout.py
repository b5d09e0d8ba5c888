"""Sampling episodes: single-turn completions or multi-turn tool episodes, batched per turn.

Every trajectory is a token list after the prompt with a parallel mask: 1 for tokens the
policy sampled (trained), 0 for environment observations (masked out of the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from evotrainer.domains import Domain, Task
from evotrainer.errors import EvoError


@dataclass
class Episode:
    task: Task
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # everything after the prompt
    mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy
    logprobs: list[float] = field(default_factory=list)  # sampling log-probs of masked-in ids
    text: list[str] = field(default_factory=list)  # decoded segments, in order
    finish_reason: str = "length"
    turns: int = 0
    tool_calls: list[dict[str, str]] = field(default_factory=list)

    @property
    def response(self) -> str:
        return "".join(self.text)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + encode(tokenizer, prompt)


def stop_ids(tokenizer: PreTrainedTokenizerBase, domain: Domain) -> list[int]:
    """Tokens that end a turn: eos, plus the domain's action terminator when multi-turn."""
    ids = [tokenizer.eos_token_id]
    if domain.turn_end is not None:
        ids_end = encode(tokenizer, domain.turn_end)
        if len(ids_end) != 1:
            raise EvoError(
                f"the tokenizer splits {domain.turn_end!r} into {len(ids_end)} "
                "tokens; multi-turn domains need it to be one token",
                field="model.path",
                hint="use the built-in tiny model",
            )
        ids.append(ids_end[0])
    return ids


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask (generation appends on the right)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attn[i, width - len(row) :] = 1
    return ids, attn


@torch.no_grad()
def sample_episodes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    domain: Domain,
    tasks: list[Task],
    env_config: dict[str, Any] | None,
    max_turn_tokens: int,
    temperature: float,
    top_p: float,
) -> list[Episode]:
    """One episode per task (repeat a task G times for a group). Active episodes advance one
    turn per batched `generate` call until they stop, run out of tokens or hit max_turns."""
    model.eval()
    stops = stop_ids(tokenizer, domain)
    episodes = [Episode(task=t, prompt_ids=prompt_ids(tokenizer, t.prompt)) for t in tasks]
    envs = [domain.environment(t, env_config) for t in tasks] if env_config else None
    max_turns = env_config["max_turns"] if env_config else 1
    active = list(range(len(episodes)))
    for _turn in range(max_turns):
        if not active:
            break
        contexts = [episodes[i].prompt_ids + episodes[i].ids for i in active]
        ids, attn = left_pad(contexts, tokenizer.pad_token_id)
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            max_new_tokens=max_turn_tokens,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, ids.shape[1] :]
        logps = torch.stack(out.scores, dim=1).log_softmax(-1)
        still_active = []
        for row, i in enumerate(active):
            ep = episodes[i]
            tokens = new[row].tolist()
            stop_at = next((k for k, t in enumerate(tokens) if t in stops), None)
            action = tokens if stop_at is None else tokens[: stop_at + 1]
            ep.ids += action
            ep.mask += [1] * len(action)
            ep.logprobs += logps[row, torch.arange(len(action)), action].tolist()
            ep.turns += 1
            body = action if stop_at is None else action[:-1]
            text = tokenizer.decode(body, skip_special_tokens=True)
            ep.text.append(
                text if stop_at is None or envs is None else text + (domain.turn_end or "")
            )
            if stop_at is None:
                ep.finish_reason = "length"
                continue
            if envs is None or action[-1] == tokenizer.eos_token_id:
                ep.finish_reason = "stop"
                continue
            reply = envs[i].step(text)
            if reply.tool_call is not None:
                ep.tool_calls.append(reply.tool_call)
            if reply.done:
                ep.finish_reason = "stop"
                continue
            obs = encode(tokenizer, reply.observation)
            ep.ids += obs
            ep.mask += [0] * len(obs)
            ep.text.append(reply.observation)
            ep.finish_reason = "tool_limit"  # stays so unless a later turn finishes
            still_active.append(i)
        active = still_active
    return episodes


def batch_tensors(
    rows: list[list[int]], masks: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded full sequences for a training forward pass: ids, attention mask, position ids
    (counted from each row's first real token, as `generate` does) and the loss mask aligned
    with the next-token targets `ids[:, 1:]`. `masks[i]` covers the tail of `rows[i]`."""
    ids, attn = left_pad(rows, pad_id)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    loss_mask = torch.zeros(ids.shape, dtype=torch.float32)
    for i, mask in enumerate(masks):
        loss_mask[i, ids.shape[1] - len(mask) :] = torch.tensor(mask, dtype=torch.float32)
    return ids, attn, positions, loss_mask[:, 1:]


def token_logprobs(
    model: PreTrainedModel, ids: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each next token and the policy's entropy there, both (B, T-1)."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits[:, :-1]
    logp_all = logits.float().log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
