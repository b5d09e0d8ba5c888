"""The built-in sampler: its preallocated KV cache decodes exactly as
transformers' growing one does, and its draw (the cumulative sums inverted, in place of
`torch.multinomial` on a real model's vocabulary) samples the tempered top-p distribution it
reports log-probs for."""

from __future__ import annotations

import pytest
import torch
from real_checkpoint import chat_tokenizer, tiny_llama
from transformers import DynamicCache

from evotrainer.engine import rollout
from evotrainer.engine.rollout import (
    DRAW_BLOCK,
    DRAW_MIN_VOCABULARY,
    PreallocatedLayer,
    decode_cache,
    draw,
    generate,
    prepacked,
    sample_next,
)
from evotrainer.errors import EvoError

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


def test_draw_samples_each_index_in_proportion_to_its_weight_and_never_a_zero():
    """One draw per row, 200,000 rows: the counts fit the weights (chi-square far below the
    0.01% critical value for 4 degrees of freedom, 23.5), zero-weight indices (first, middle,
    last: outside a top-p nucleus) are never drawn, and the weights need not sum to one."""
    weights = torch.tensor([0.0, 5.0, 1e-2 * 5, 0.0, 2.0, 30.0, 8.0, 0.0])
    rows = 200_000
    torch.manual_seed(0)
    drawn = draw(weights.expand(rows, -1))
    assert drawn.shape == (rows,) and drawn.dtype == torch.long
    counts = torch.bincount(drawn, minlength=len(weights)).double()
    assert counts[weights == 0].sum() == 0
    expected = rows * weights.double() / weights.sum()
    alive = weights > 0
    chi2 = float(((counts[alive] - expected[alive]) ** 2 / expected[alive]).sum())
    assert chi2 < 23.5
    # A one-hot row always draws its index, wherever it sits.
    for index in (0, 3, 7):
        assert draw(torch.nn.functional.one_hot(torch.tensor([index] * 50), 8).float()).eq(
            index).all()


def test_draw_across_blocks_picks_the_block_by_its_sum_and_skips_empty_ones():
    """A vocabulary of several DRAW_BLOCK blocks, the last one partial (padded): weights in the
    first, second and last blocks, one whole block empty, tiny and large weights together. The
    counts of 200,000 draws fit the weights (chi-square below 23.5, the 0.01% critical value
    for 4 degrees of freedom) and no zero-weight index is ever drawn."""
    vocabulary = 3 * DRAW_BLOCK + 5
    weights = torch.zeros(vocabulary)
    live = {0: 4.0, 7: 0.05, DRAW_BLOCK + 44: 1.0, 3 * DRAW_BLOCK + 3: 2.5, 3 * DRAW_BLOCK: 0.5}
    for index, weight in live.items():
        weights[index] = weight
    rows = 200_000
    torch.manual_seed(1)
    drawn = draw(weights.expand(rows, -1))
    counts = torch.bincount(drawn, minlength=vocabulary).double()
    assert counts[weights == 0].sum() == 0
    expected = rows * weights.double() / weights.sum()
    alive = weights > 0
    chi2 = float(((counts[alive] - expected[alive]) ** 2 / expected[alive]).sum())
    assert chi2 < 23.5
    # The last live index of the padded block, alone, is always drawn.
    one = torch.zeros(vocabulary)
    one[-1] = 1.0
    assert draw(one.expand(50, -1)).eq(vocabulary - 1).all()


def test_sample_next_draws_from_the_tempered_nucleus_and_reports_its_logprobs():
    """A vocabulary large enough to draw by `draw`: five live tokens among -inf ones."""
    vocabulary = DRAW_MIN_VOCABULARY + 3
    row = torch.full((vocabulary,), float("-inf"))
    live = torch.tensor([0, 17, 2048, vocabulary - 2, vocabulary - 1])
    row[live] = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    torch.manual_seed(1)
    tokens, logps = sample_next(row.expand(20_000, -1), 0.7, 0.8)
    scaled = row[live] / 0.7
    kept = scaled.softmax(-1).cumsum(-1) - scaled.softmax(-1) < 0.8  # the top-p nucleus
    nucleus = scaled.masked_fill(~kept, float("-inf")).log_softmax(-1)
    counts = torch.bincount(tokens, minlength=vocabulary)
    assert counts.sum() == counts[live[kept]].sum() == 20_000  # nothing outside the nucleus
    expected = 20_000 * nucleus[kept].exp()
    assert ((counts[live[kept]] - expected).abs() < 5 * expected.sqrt()).all()
    index = {int(t): i for i, t in enumerate(live)}
    assert torch.allclose(logps, nucleus[[index[int(t)] for t in tokens]])


def test_small_vocabularies_draw_exactly_what_torch_multinomial_draws():
    """The tiny models' seeded runs sample what they always did."""
    logits = torch.randn(6, DRAW_MIN_VOCABULARY - 1)
    torch.manual_seed(5)
    tokens, _ = sample_next(logits, 1.0, 1.0)
    torch.manual_seed(5)
    assert torch.equal(tokens, torch.multinomial(logits.log_softmax(-1).exp(), 1).squeeze(-1))


@pytest.mark.parametrize("vocabulary", [400, DRAW_MIN_VOCABULARY])
def test_a_diverged_policy_is_refused_in_one_line_naming_the_learning_rate(vocabulary):
    """torch.multinomial used to raise its own RuntimeError (a traceback) on NaN; the inverted
    sums would draw garbage from it without a word."""
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(2, vocabulary)
        logits[1, 3] = bad
        for top_p in (1.0, 0.9):
            with pytest.raises(EvoError) as refused:
                sample_next(logits, 1.0, top_p)
            assert refused.value.field == "grpo.lr" and "not finite" in str(refused.value)


def test_a_lora_policy_samples_on_its_adapters_merged_into_the_packed_weights():
    """A LoRA layer over a large linear computes with base + delta packed once: the same
    logits as peft's own forward, its adapter matrices untouched while sampling, every layer
    itself again on exit, and adapters switched off give the base model's logits."""
    pytest.importorskip("peft")
    from test_rollout_speed import wide_llama

    from evotrainer.engine.model import with_lora

    tokenizer = chat_tokenizer()
    policy = with_lora(wide_llama(tokenizer), {"r": 4, "alpha": 8})
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: give the adapter an effect
                parameter.normal_(std=0.05)
    policy.eval()
    adapter_calls = []
    for name, module in policy.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda *_: adapter_calls.append(1))
    ids = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b")] * 3)
    with torch.no_grad():
        plain = policy(input_ids=ids).logits
        with policy.disable_adapter():
            base = policy(input_ids=ids).logits
        assert not torch.allclose(plain, base, atol=1e-3)  # the adapter changes the policy
        adapter_calls.clear()
        with prepacked(policy) as packed:
            merged = policy(input_ids=ids).logits
        assert packed == 7 and not adapter_calls  # q, k, v, o, gate, up, down: merged, once
        assert torch.allclose(merged, plain, atol=1e-4)
        with policy.disable_adapter(), prepacked(policy) as packed:
            assert packed == 7
            assert torch.allclose(policy(input_ids=ids).logits, base, atol=1e-4)
        assert torch.equal(policy(input_ids=ids).logits, plain)  # peft's forward again
        assert adapter_calls
    assert all("forward" not in m.__dict__ for m in policy.modules())
