"""Sampling episodes: single-turn completions or multi-turn tool episodes, batched per turn.

Every trajectory is a token list after the prompt with a parallel mask: 1 for tokens the
policy sampled (trained), 0 for environment observations (masked out of the loss).

Prompts are the domain's text after bos, or, for a tokenizer with a chat template (instruct
models, `model.chat_template: auto`), one user message rendered by the template with the
assistant's turn opened. `generate` is our own decode loop over one KV cache: a group's
identical contexts are prefilled once and the cache rows copied, and rows leave the batch as
soon as they stop, so a long prompt and a ragged group cost far less than `model.generate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

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


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = False) -> list[int]:
    """The prompt's tokens: bos + text, or (`chat`) the chat template's rendering of one user
    message with the assistant turn opened (the template adds its own bos/system text)."""
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return encode(tokenizer, text)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + encode(tokenizer, prompt)


def stop_ids(
    tokenizer: PreTrainedTokenizerBase, domain: Domain, model: PreTrainedModel | None = None
) -> list[int]:
    """Tokens that end a turn: eos (first: a demonstration ends with it), the model's
    generation-config eos ids (an instruct model's end-of-turn token), plus the domain's action
    terminator when multi-turn."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for token in configured if isinstance(configured, list) else [configured]:
        if token is not None and token not in ids:
            ids.append(token)
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


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)  # sampled, the stop token included
    logprobs: list[float] = field(default_factory=list)  # under the sampling distribution
    stopped: bool = False


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from softmax(logits / temperature) restricted to the top-p
    nucleus; returns the tokens and their log-probabilities under that distribution."""
    logits = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    logp = logits.log_softmax(-1)
    tokens = torch.multinomial(logp.exp(), 1).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    contexts: list[list[int]],
    stops: list[int],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    pad_id: int,
) -> list[Generation]:
    """Sample a continuation of every context, all in one batch over one KV cache."""
    # Prefill each distinct context once; rows that share it (a group) copy its cache rows.
    distinct: dict[tuple[int, ...], int] = {}
    for context in contexts:
        distinct.setdefault(tuple(context), len(distinct))
    prefix_ids, prefix_attn = left_pad([list(c) for c in distinct], pad_id)
    cache = DynamicCache()
    out = model(
        input_ids=prefix_ids,
        attention_mask=prefix_attn,
        position_ids=(prefix_attn.cumsum(-1) - 1).clamp(min=0),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    source = torch.tensor([distinct[tuple(c)] for c in contexts])
    cache.batch_select_indices(source)
    logits = out.logits[source, -1]
    attn = prefix_attn[source]
    positions = attn.sum(-1)
    rows = torch.arange(len(contexts))  # the batch's rows, as indices into `contexts`
    stop_set = torch.tensor(stops)
    results = [Generation() for _ in contexts]
    for step in range(max_new_tokens):
        tokens, logps = sample_next(logits, temperature, top_p)
        for row, token, logp in zip(rows.tolist(), tokens.tolist(), logps.tolist(), strict=True):
            results[row].tokens.append(token)
            results[row].logprobs.append(logp)
        running = ~torch.isin(tokens, stop_set)
        for row in rows[~running].tolist():
            results[row].stopped = True
        if step == max_new_tokens - 1 or not running.any():
            break
        if not running.all():  # finished rows leave the batch and the cache
            cache.batch_select_indices(running.nonzero().squeeze(-1))
            rows, tokens, attn, positions = (
                rows[running],
                tokens[running],
                attn[running],
                positions[running],
            )
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)
        logits = model(
            input_ids=tokens[:, None],
            attention_mask=attn,
            position_ids=positions[:, None],
            cache=cache,
            use_cache=True,
        ).logits[:, -1]
        positions = positions + 1
    return results


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
    chat: bool = False,
) -> list[Episode]:
    """One episode per task (repeat a task G times for a group). Active episodes advance one
    turn per batched `generate` call until they stop, run out of tokens or hit max_turns."""
    model.eval()
    stops = stop_ids(tokenizer, domain, model)
    action_end = stops[-1] if domain.turn_end is not None else None  # multi-turn: more to come
    episodes = [Episode(task=t, prompt_ids=prompt_ids(tokenizer, t.prompt, chat)) for t in tasks]
    envs = [domain.environment(t, env_config) for t in tasks] if env_config else None
    max_turns = env_config["max_turns"] if env_config else 1
    try:
        _run_turns(model, tokenizer, domain, episodes, envs, max_turns, stops, action_end,
                   max_turn_tokens, temperature, top_p)
    finally:
        # Release what each episode holds (a container, a scratch repository) now, not when
        # the garbage collector gets to it: every episode here is over.
        for env in envs or []:
            close = getattr(env, "close", None)
            if callable(close):
                close()
    return episodes


def _run_turns(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    domain: Domain,
    episodes: list[Episode],
    envs: list[Any] | None,
    max_turns: int,
    stops: list[int],
    action_end: int | None,
    max_turn_tokens: int,
    temperature: float,
    top_p: float,
) -> None:
    """Advance the active episodes one batched turn at a time, in place."""
    active = list(range(len(episodes)))
    for _turn in range(max_turns):
        if not active:
            break
        generations = generate(
            model,
            [episodes[i].prompt_ids + episodes[i].ids for i in active],
            stops,
            max_turn_tokens,
            temperature,
            top_p,
            tokenizer.pad_token_id,
        )
        still_active = []
        for i, gen in zip(active, generations, strict=True):
            ep = episodes[i]
            action = gen.tokens
            ep.ids += action
            ep.mask += [1] * len(action)
            ep.logprobs += gen.logprobs
            ep.turns += 1
            body = action[:-1] if gen.stopped else action
            text = tokenizer.decode(body, skip_special_tokens=True)
            ep.text.append(
                text if not gen.stopped or envs is None else text + (domain.turn_end or "")
            )
            if not gen.stopped:
                ep.finish_reason = "length"
                continue
            if envs is None or action[-1] != action_end:
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
    model: PreTrainedModel,
    ids: torch.Tensor,
    attn: torch.Tensor,
    positions: torch.Tensor,
    tail: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each next token and the policy's entropy there, both (B, T-1), or
    (B, tail) for the last `tail` targets only: responses sit at the right end of left-padded
    rows, so the vocabulary-sized logits of the prompt never need to exist."""
    tail = ids.shape[1] - 1 if tail is None else tail
    logits = model(
        input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=tail + 1
    ).logits[:, :-1]
    logp_all = logits.float().log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, -tail:, None]).squeeze(-1)
    with torch.no_grad():  # a statistic only: its vocabulary-sized product needs no graph
        probs_logp = logp_all.detach()
        entropy = -(probs_logp.exp() * probs_logp).sum(-1)
    return logp, entropy
