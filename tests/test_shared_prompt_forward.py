"""The training forward that runs each prompt once for its whole group must compute what one
full row per episode computes: the same log-probabilities, entropies and LoRA gradients, on
ragged prompts, ragged responses, masked environment tokens and a group the filter thinned;
and both compute them at the sampling temperature: the sampler's own log-probabilities."""

from __future__ import annotations

import pytest
import torch
from real_checkpoint import chat_tokenizer, tiny_llama

from evotrainer.domains import Task
from evotrainer.engine.grpo import FullRows, SharedPrompts
from evotrainer.engine.model import AdapterOff, with_lora
from evotrainer.engine.rollout import Episode, generate

torch.set_num_threads(1)


def episodes(tokenizer) -> list[Episode]:
    task = Task(task_id="t", prompt="", answer="", data_source="test")
    short = tokenizer.encode("def add")
    long = tokenizer.encode("Complete the following Python function.")
    gen = torch.Generator().manual_seed(0)
    made = []
    # Two members of the short prompt's group (the filter took the others), four of the long
    # one's; response lengths 1..9, and one multi-turn episode whose middle is environment text.
    for prompt, lengths in ((short, [5, 1]), (long, [9, 3, 7, 2])):
        for length in lengths:
            ids = torch.randint(3, len(tokenizer), (length,), generator=gen).tolist()
            made.append(Episode(task=task, prompt_ids=list(prompt), ids=ids, mask=[1] * length))
    made[2].mask = [1, 1, 1, 0, 0, 0, 1, 1, 1]  # turn, environment reply, turn
    return made


def by_episode(values: torch.Tensor, batch: FullRows | SharedPrompts) -> list[list[float]]:
    """Each episode's masked-in values, in order, whatever the batch's layout."""
    return [row[m.bool()].tolist() for row, m in zip(values, batch.mask, strict=True)]


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompt_forward_matches_full_rows_in_values_and_gradients(lora):
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer)
    if lora:
        model = with_lora(model, {"r": 4, "alpha": 8})
        with torch.no_grad():  # a fresh adapter is zero on one side: make it count
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1)
    model.train()
    made = episodes(tokenizer)
    pad = tokenizer.pad_token_id
    full, shared = FullRows(made, pad), SharedPrompts(made, pad)
    assert shared.prompt_ids.shape[0] == 2  # each distinct prompt runs once

    results = {}
    for name, batch in (("full", full), ("shared", shared)):
        model.zero_grad()
        logp, entropy = batch.logprobs(model, 0.7)
        (logp * batch.mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (by_episode(logp, batch), by_episode(entropy, batch), grads)

    (full_logp, full_entropy, full_grads), (logp, entropy, grads) = results.values()
    assert [len(r) for r in logp] == [sum(e.mask) for e in made]
    for got, want in zip(logp, full_logp, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    for got, want in zip(entropy, full_entropy, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    assert grads.keys() == full_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], atol=1e-5, rtol=1e-4)

    if lora:  # the reference (adapter off) takes the same path
        with torch.no_grad():
            ref_full = by_episode(full.logprobs(AdapterOff(model), 0.7)[0], full)
            ref_shared = by_episode(shared.logprobs(AdapterOff(model), 0.7)[0], shared)
        for got, want in zip(ref_shared, ref_full, strict=True):
            assert got == pytest.approx(want, abs=1e-5)
        assert ref_shared != logp  # and it is not the policy


@pytest.mark.parametrize("batch_kind", [FullRows, SharedPrompts])
def test_the_loss_reads_the_samplers_own_log_probabilities_at_its_temperature(batch_kind):
    """Episodes sampled at temperature 0.6 (top-p 1): the training forward's log-probabilities
    of their tokens are the ones the sampler drew them with, as verl's actor and TRL divide the
    logits by the rollout temperature. At temperature 1 they are not (the engine before)."""
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer).eval()
    task = Task(task_id="t", prompt="", answer="", data_source="test")
    contexts = [tokenizer.encode(text) for text in ("def add", "Complete the function.")
                for _ in range(3)]
    torch.manual_seed(0)
    with torch.no_grad():
        generations = generate(model, contexts, [tokenizer.eos_token_id], 8, 0.6, 1.0,
                               tokenizer.pad_token_id)
    made = [Episode(task=task, prompt_ids=c, ids=g.tokens, mask=[1] * len(g.tokens))
            for c, g in zip(contexts, generations, strict=True)]
    batch = batch_kind(made, tokenizer.pad_token_id)
    with torch.no_grad():
        tempered = by_episode(batch.logprobs(model, 0.6)[0], batch)
        plain = by_episode(batch.logprobs(model, 1.0)[0], batch)
    for got, generation in zip(tempered, generations, strict=True):
        assert got == pytest.approx(generation.logprobs, abs=1e-5)
    assert max(abs(a - b) for x, y in zip(plain, tempered, strict=True)
               for a, b in zip(x, y, strict=True)) > 1e-2
