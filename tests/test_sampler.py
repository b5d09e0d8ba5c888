"""The built-in sampler's decode loop (issue 30 A2): its preallocated KV cache decodes exactly
as transformers' growing one does."""

from __future__ import annotations

import pytest
import torch
from real_checkpoint import chat_tokenizer, tiny_llama
from transformers import DynamicCache

from evotrainer.engine import rollout
from evotrainer.engine.rollout import PreallocatedLayer, decode_cache, generate

torch.set_num_threads(1)


def stopping_llama():
    """A tiny Llama whose end-of-turn token is likely, so rows stop at different steps and
    leave the batch (and the cache) one by one."""
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 0
        model.model.norm.weight.fill_(1.0)
    return model, tokenizer


def test_the_preallocated_cache_decodes_exactly_as_the_growing_one(monkeypatch):
    model, tokenizer = stopping_llama()
    # Two distinct prompts of different lengths (left padding), three samples each.
    contexts = [tokenizer.encode("def add(a, b):")] * 3 + [tokenizer.encode("What is 3 + 4?")] * 3
    budget = 40

    def run() -> list[rollout.Generation]:
        torch.manual_seed(7)
        return generate(model, contexts, [tokenizer.eos_token_id], budget, 1.0, 1.0,
                        tokenizer.pad_token_id)

    caches: list[DynamicCache] = []
    monkeypatch.setattr(rollout, "decode_cache",
                        lambda capacity: caches.append(decode_cache(capacity)) or caches[-1])
    fast = run()
    monkeypatch.setattr(rollout, "decode_cache", lambda capacity: DynamicCache())
    grown = run()
    assert [g.tokens for g in fast] == [g.tokens for g in grown]
    assert [g.logprobs for g in fast] == [g.logprobs for g in grown]  # bit for bit
    lengths = sorted(len(g.tokens) for g in fast)
    assert lengths[0] < lengths[-1] == budget  # rows left the batch while others went on
    layers = caches[0].layers
    assert len(layers) == model.config.num_hidden_layers
    assert all(type(layer) is PreallocatedLayer for layer in layers)
    width = max(len(c) for c in contexts)
    assert layers[0].key_buffer.shape[2] == width + budget  # sized once, never grown
    assert layers[0].keys.shape[2] == layers[0].length <= width + budget - 1


def test_the_cache_refuses_to_write_past_its_capacity():
    """A write past the end would broadcast into an empty slice and be lost without a word."""
    layer = PreallocatedLayer(capacity=4)
    layer.update(torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, 8))
    layer.update(torch.ones(2, 1, 1, 8), torch.ones(2, 1, 1, 8))
    assert layer.keys.shape == (2, 1, 4, 8) and layer.keys[:, :, 3].eq(1).all()
    with pytest.raises(ValueError, match="holds 4 positions, not 5"):
        layer.update(torch.ones(2, 1, 1, 8), torch.ones(2, 1, 1, 8))
