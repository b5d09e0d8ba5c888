"""The group decode: rows that continue a few shared prompts, each prompt's keys
and values held once, give the logits the padded decode gives (every row holding a copy), on
each architecture it takes, as rows leave the batch; `generate` samples the same tokens
either way; and it applies only where it is exact and pays."""

from __future__ import annotations

import pytest
import torch
from real_checkpoint import chat_tokenizer, tiny_llama
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from evotrainer.engine import decode_kernels, group_decode, rollout
from evotrainer.engine.group_decode import GroupDecode
from evotrainer.engine.rollout import PaddedDecode, distinct_contexts, generate

torch.set_num_threads(1)

CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}


def random_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[family](
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def lora_policy(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with LoRA adapters (r=4) that change what it computes."""
    pytest.importorskip("peft")
    from evotrainer.engine.model import with_lora

    model = with_lora(model, {"r": 4, "alpha": 8}).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: give the adapter an effect
                parameter.normal_(std=0.05)
    return model


@pytest.mark.parametrize("layout", ["grouped", "interleaved"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_group_decode_gives_the_padded_decodes_logits(family, layout):
    """Three prompts of 5, 11 and 8 tokens, three rows each (laid out prompt by prompt, as the
    engine does, or interleaved), eight decode steps; after the fourth, four rows leave, all
    three of the first prompt's among them."""
    model = random_model(family)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (5, 11, 8)]
    if layout == "grouped":
        contexts = [p for p in prompts for _ in range(3)]
    else:
        contexts = [p for _ in range(3) for p in prompts]
    leaving = [i for i, c in enumerate(contexts) if c == prompts[0]] + [
        contexts.index(prompts[2])]
    with torch.no_grad():
        padded = PaddedDecode(model, contexts, 10, pad_id=0)
        grouped = GroupDecode(model, *distinct_contexts(contexts), 10)
        assert torch.allclose(grouped.logits, padded.logits, atol=1e-5)
        rows = len(contexts)
        for step in range(8):
            tokens = torch.randint(3, 300, (rows,), generator=generator)
            if step == 4:
                keep = torch.ones(rows, dtype=torch.bool)
                keep[leaving] = False
                padded.select(keep)
                grouped.select(keep)
                tokens, rows = tokens[keep], int(keep.sum())
            expected, got = padded.step(tokens), grouped.step(tokens)
            assert got.shape == (rows, 300)
            assert torch.allclose(got, expected, atol=1e-5), (step, (got - expected).abs().max())
    assert model.config._attn_implementation == "sdpa"  # switched for the step only


@pytest.mark.parametrize("lora", [False, True])
def test_generate_samples_the_same_tokens_over_shared_prompts(monkeypatch, lora):
    """A tiny Llama whose end-of-turn token is likely, so rows stop at different steps: two
    prompts times four rows, the same seed, the padded decode and the group decode; as a
    LoRA policy too (peft's model, its config the base's), sampling on packed weights."""
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 0
        model.model.norm.weight.fill_(1.0)
    if lora:
        model = lora_policy(model)
        monkeypatch.setattr(rollout, "PACK_MIN_WEIGHTS", 0)
    contexts = [tokenizer.encode(text) for text in ("def add(a, b):", "x = 1")
                for _ in range(4)]
    built = []
    monkeypatch.setattr(rollout.group_decode, "GroupDecode",
                        lambda *a: built.append(GroupDecode(*a)) or built[-1])

    def sample() -> list[rollout.Generation]:
        torch.manual_seed(3)
        with torch.no_grad(), rollout.prepacked(model):
            return generate(model, contexts, [tokenizer.eos_token_id], 24, 1.0, 1.0,
                            tokenizer.pad_token_id)

    padded = sample()
    assert not built  # a tiny model: under MIN_WEIGHTS
    monkeypatch.setattr(group_decode, "MIN_WEIGHTS", 0)
    scripted_calls = []
    script = decode_kernels.decode_layers
    monkeypatch.setattr(decode_kernels, "decode_layers",
                        lambda *a: scripted_calls.append(1) or script(*a))
    grouped = sample()
    assert len(built) == 1
    assert scripted_calls  # LoRA layers merged and packed, or plain ones: scripted either way
    assert [g.tokens for g in grouped] == [g.tokens for g in padded]
    assert [g.stopped for g in grouped] == [g.stopped for g in padded]
    assert len({len(g.tokens) for g in padded}) > 1  # rows did leave at different steps
    for a, b in zip(grouped, padded, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("weights", ["float32", "int8", "lora"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_scripted_step_computes_what_the_modules_compute(monkeypatch, family, weights):
    """Llama and Qwen2 layers step through `decode_kernels.decode_layers` on the products
    `prepacked` made (every layer packed here, for oneDNN or int8), or on a LoRA policy's
    layers too small to pack, their adapters merged; Qwen3's query and key norms keep
    transformers' modules. Either way a step's logits are the modules' own, two prompts of
    three rows (the first's apart, gathered by index; the second's consecutive, read as
    views), one row leaving."""
    model = random_model(family)
    if weights == "lora":
        model, weights = lora_policy(model), "float32"
    else:
        monkeypatch.setattr(rollout, "PACK_MIN_WEIGHTS", 0)
        monkeypatch.setattr(rollout, "INT8_MIN_WEIGHTS", 0)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (7, 4)]
    contexts = [prompts[p] for p in (0, 0, 1, 1, 1, 0)]
    scripted_calls = []
    script = decode_kernels.decode_layers
    monkeypatch.setattr(decode_kernels, "decode_layers",
                        lambda *a: scripted_calls.append(1) or script(*a))
    with torch.no_grad(), rollout.prepacked(model, weights):
        scripted = GroupDecode(model, *distinct_contexts(contexts), 6)
        with monkeypatch.context() as through_modules:
            through_modules.setattr(group_decode, "scripted_projections", lambda m: None)
            modules = GroupDecode(model, *distinct_contexts(contexts), 6)
        rows = len(contexts)
        for step in range(4):
            tokens = torch.randint(3, 300, (rows,), generator=generator)
            if step == 2:
                keep = torch.ones(rows, dtype=torch.bool)
                keep[1] = False
                scripted.select(keep)
                modules.select(keep)
                tokens, rows = tokens[keep], rows - 1
            got, want = scripted.step(tokens), modules.step(tokens)
            # int8: a float rounding apart can move an activation to the next int8 level.
            tolerance = 1e-5 if weights == "float32" else 1e-2 * float(want.abs().max())
            assert torch.allclose(got, want, atol=tolerance), (step, (got - want).abs().max())
    assert len(scripted_calls) == (0 if family == "qwen3" else 4)


def test_it_applies_to_repeated_prompts_on_the_architectures_it_takes(monkeypatch):
    model = random_model("llama")
    repeated = (2, 8)  # two prompts, four rows each
    assert not group_decode.applies(model, *repeated)  # well under MIN_WEIGHTS
    monkeypatch.setattr(group_decode, "MIN_WEIGHTS", 0)
    assert group_decode.applies(model, *repeated)
    # A multi-turn episode's later turns: every context distinct, one prefill a row.
    assert not group_decode.applies(model, 8, 8)
    assert not group_decode.applies(model, 5, 8)
    # Sliding-window attention is not plain causal attention over the whole prompt.
    sliding = random_model("qwen2")
    sliding.config.use_sliding_window = True
    assert not group_decode.applies(sliding, *repeated)
    sliding.config.use_sliding_window = False
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    assert not group_decode.applies(sliding, *repeated)
