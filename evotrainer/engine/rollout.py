"""Sampling episodes: single-turn completions or multi-turn tool episodes, batched per turn.

Every trajectory is a token list after the prompt with a parallel mask: 1 for tokens the
policy sampled (trained), 0 for environment observations (masked out of the loss).

Prompts are the domain's text after bos, or, for a tokenizer with a chat template (instruct
models, `model.chat_template: auto`), one user message rendered by the template with the
assistant's turn opened. `generate` is our own decode loop over one KV cache: a group's
identical contexts are prefilled once and the cache rows copied, and rows leave the batch as
soon as they stop, so a long prompt and a ragged group cost far less than `model.generate`.
The cache is allocated once for the whole decode (`PreallocatedLayer`): each step writes its
column in place instead of copying the whole cache.
While it samples, the large linear layers run on weights packed once for oneDNN
(`prepacked`): a plain fp32 `linear` has MKL re-pack the whole weight matrix on every
small-batch call, which was a third of the sampler's time on a real model; with
`rollout.quantization: int8` they run on int8 copies instead (`_int8_forward`). A caller that
scores episodes as they finish (`on_finished`) gets each one as soon as it is over, while the
rest of the batch is still sampling.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from evotrainer.domains import Domain, Task
from evotrainer.engine import decode_kernels, group_decode
from evotrainer.engine.model import lora_layer_class, lora_weight, with_cache
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


# Linear layers at least this large sample on prepacked weights: a real model's vocabulary
# projection and MLP (SmolLM2-135M: 28M and 0.9M weights) gain; the tiny models' layers
# (at most 33K) keep torch's own kernel, so their seeded runs sample what they always did.
PACK_MIN_WEIGHTS = 1 << 18
# The row count oneDNN lays the packed weights out for; any batch size runs on them.
PACK_BATCH = 8


# In int8 (`rollout.quantization`) smaller layers are packed too: SmolLM2's key and value
# projections (110K weights) took 82-95 us a call in float32 inside the decode step (their
# weights come from memory each step), and the step ran 39-44 ms against 48-52 with them in int8.
# Still above the tiny models' layers.
INT8_MIN_WEIGHTS = 1 << 16
# Int8 layers whose inputs are quantized in two passes (`decode_kernels.int8_product`), besides
# the vocabulary projection: the key and value projections, whose outputs every later step
# attends to, and each MLP's output projection (`down_proj` in Llama, Qwen and Mistral). The
# vocabulary projection's and the MLP output's inputs carry a few channels of massive
# activations (SmolLM2-135M's final hidden state: a row's largest entry ~12x its root mean
# square), which leave the other entries a few steps of one 8-bit grid. Exact KL from the
# float32 policy, teacher-forced on HumanEval's first 24 solutions, nats/token: 0.026 with the
# vocabulary projection in float32 and the rest in one pass; 0.037 with it in int8 too; 0.024
# with it and the MLP outputs in two passes; 0.034 with the keys and values in int8 in one
# pass, 0.026 in two (0.018 along the decode's own path, against 0.023 before). Every layer
# in two passes came to 0.013 but ~5 ms more a batch-8 step.
TWO_PASS_LAYERS = ("k_proj", "v_proj", "down_proj")

# Sibling projections that read the same input are packed as one product, its output split
# among them: an attention's query, key and value, an MLP's gate and up projections. Fewer,
# larger products stream their weights faster: at batch 8, SmolLM2's five shapes as two int8
# products took 358 against 440 us a layer, weights from memory, and each product saved is
# one quantization of its input fewer.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# Packed copies of frozen weights (a LoRA policy's vocabulary projection, any layer its
# adapters leave alone), kept across sampling calls: training never changes them, so they are
# packed once per run, not once per update (SmolLM2's vocabulary projection: about 0.1 s in
# int8, 0.08 s for oneDNN). Keyed by the layer (a fused group's by the module holding it)
# and its weights' storage and version counters, which any in-place write through a
# parameter bumps (a `load_state_dict` included).
_frozen_packs: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[Any, ...], Callable]] = (
    weakref.WeakKeyDictionary())


@dataclass
class _Layer:
    """A linear layer `prepacked` can pack: its weight (a LoRA layer's with its adapters
    merged) and the plain layer that holds its bias."""

    name: str
    module: torch.nn.Module
    weight: torch.Tensor
    base: torch.nn.Module


def _layer(name: str, module: torch.nn.Module, lora_linear: type | None) -> _Layer | None:
    if lora_linear is not None and type(module) is lora_linear:
        weight = lora_weight(module)  # None for a LoRA variant that does not merge
        return None if weight is None else _Layer(name, module, weight, module.base_layer)
    if type(module) is torch.nn.Linear:
        return _Layer(name, module, module.weight, module)
    return None


def _packing_units(
    model: torch.nn.Module, lora_linear: type | None
) -> Iterator[tuple[torch.nn.Module, list[_Layer]]]:
    """The model's layers as they are packed: each group of SIBLINGS as one unit (keyed by
    the module holding them) where all are packable layers over the same input, every other
    layer alone."""
    done: set[int] = set()  # in a unit already: a fused sibling, a merged LoRA layer's base
    for name, module in model.named_modules():  # parents before their children
        for names in SIBLINGS:
            members = [_layer(f"{name}.{child}", getattr(module, child), lora_linear)
                       for child in names if isinstance(getattr(module, child, None),
                                                        torch.nn.Module)]
            if (len(members) == len(names) and all(members)
                    and len({(m.weight.shape[1], m.weight.dtype) for m in members}) == 1):
                done.update(id(m) for layer in members for m in (layer.module, layer.base))
                yield module, members
        layer = _layer(name, module, lora_linear)
        if layer is not None and id(module) not in done:
            done.update((id(module), id(layer.base)))
            yield module, [layer]


@contextmanager
def prepacked(model: torch.nn.Module, weights: str = "float32") -> Iterator[int]:
    """Inside: every float32 `nn.Linear` with at least PACK_MIN_WEIGHTS weights computes with a
    copy of its weights reordered once for oneDNN, instead of MKL packing them again on each
    call; a peft LoRA layer over such a layer computes with its adapters merged into that
    copy (one product per sampling call instead of two small ones per layer and step: a
    LoRA r=16 SmolLM2 policy samples ~10% faster so); SIBLINGS with as many weights together
    share one such copy. For no-grad use only (sampling); the copies of trainable weights
    are dropped on exit, so the next update's weights are packed afresh (frozen ones are
    kept: `_frozen_packs`). Yields how many layers were packed (0 without oneDNN).

    `weights: int8` (`rollout.quantization`) packs the layers with at least INT8_MIN_WEIGHTS
    as int8 instead (`_int8_forward`; TWO_PASS_LAYERS, their siblings and the vocabulary
    projection with their inputs quantized in two passes): a quarter of the bytes to stream
    per decode step and int8 products, the policy's own float32 weights untouched."""
    packed: list[torch.nn.Module] = []
    int8 = weights == "int8"
    if int8 and torch.backends.quantized.engine not in ("x86", "fbgemm"):
        raise EvoError(
            "this machine's torch has no fbgemm, which int8 rollouts run on",
            field="rollout.quantization", hint="remove rollout.quantization to sample in float32")
    head = model.get_output_embeddings()
    minimum = INT8_MIN_WEIGHTS if int8 else PACK_MIN_WEIGHTS
    units = (_packing_units(model, lora_layer_class())
             if int8 or torch.backends.mkldnn.is_available() else iter(()))
    for owner, members in units:
        if (not all(_packable(m.weight, 0) for m in members)
                or sum(m.weight.numel() for m in members) < minimum):
            continue
        two_pass = any(m.base is head or m.name.rsplit(".", 1)[-1] in TWO_PASS_LAYERS
                       for m in members)
        pack = partial(_int8_forward, two_pass=two_pass) if int8 else _packed_forward
        if all(m.base is m.module for m in members) and not any(
                p.requires_grad for m in members for p in m.module.parameters()):
            key = (weights, *((m.weight.data_ptr(), m.weight._version,
                               None if m.base.bias is None else m.base.bias._version)
                              for m in members))
            cached = _frozen_packs.get(owner)
            if cached is None or cached[0] != key:
                cached = _frozen_packs[owner] = (key, pack(*_joined(members)))
            product = cached[1]
        else:
            product = pack(*_joined(members))
        forwards = ([product] if len(members) == 1
                    else _split_forwards(product, [m.weight.shape[0] for m in members]))
        for member, forward in zip(members, forwards, strict=True):
            member.module.forward = forward
            packed.append(member.module)
    try:
        yield len(packed)
    finally:
        for module in packed:
            del module.forward  # the class's forward again


def _joined(members: list[_Layer]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The members' weights and biases as one layer's (its outputs theirs, in order)."""
    if len(members) == 1:
        return members[0].weight, members[0].base.bias
    weight = torch.cat([m.weight.detach() for m in members])
    biases = [m.base.bias for m in members]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat([
        m.weight.new_zeros(m.weight.shape[0]) if b is None else b.detach()
        for m, b in zip(members, biases, strict=True)])


def _split_forwards(
    product: Callable[[torch.Tensor], torch.Tensor], sizes: list[int]
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """The siblings' forwards over one product of their joined weights: the first call with an
    input computes every sibling's output, and each sibling called with that same input
    (unchanged) takes its part. The decode step (`group_decode.scripted_projections`) reads
    the product from the first and `decode_kernels.JOINED` from the rest."""
    last: list[Any] = [None]  # (input, its version, the parts)

    def forward_of(index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            held = last[0]
            if held is None or held[0] is not x or held[1] != x._version:
                held = last[0] = (x, x._version, product(x).split(sizes, -1))
            return held[2][index]

        forward.product = (  # type: ignore[attr-defined]
            product.product if index == 0  # type: ignore[attr-defined]
            else (decode_kernels.JOINED, torch.empty(0), None, None))
        return forward

    return [forward_of(index) for index in range(len(sizes))]


def _packable(weight: torch.Tensor, minimum: int) -> bool:
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.numel() >= minimum
    )


def _packed_forward(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH)
    bias = None if bias is None else bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = decode_kernels.packed_product(x.reshape(-1, x.shape[-1]), packed, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    forward.product = (decode_kernels.PACKED, packed, bias, None)  # type: ignore[attr-defined]
    return forward


# Int8 weights span [-63, 63], not [-127, 127]: fbgemm's AVX2 kernel adds two u8 x s8
# products in 16 bits, and 2 x 255 x 127 overflows them (a product came out 99% off,
# measured). Within 63 the sums are exact (2 x 255 x 63 < 2^15) on every instruction set, and
# the product leaves them by one float multiply, so int8 rollouts sample bit for bit the same
# with fbgemm's AVX2, AVX-512 or VNNI kernels: fbgemm need not be pinned (PINNED_KERNELS), and
# runs at this machine's best (VNNI here: 97 against 175 us for SmolLM2's MLP projection).
INT8_WEIGHT_MAX = 63
# Int8 weights are quantized and packed in blocks of this many output rows. fbgemm packs a
# large matrix slower per weight (SmolLM2's vocabulary projection: 207 ms in one block,
# 102-116 in blocks of 3,072-6,144 rows) and its product runs no slower in blocks (5.1-5.3 ms
# at 16 rows in blocks of 3,072-6,144 against 5.9 in one); the quantization's temporaries
# stay in cache (11-15 ms against 69 for the same matrix's largest entries).
INT8_BLOCK_ROWS = 4096
# Each block is quantized this many rows at a time through one float buffer that stays in
# cache (a matrix of SmolLM2's vocabulary-projection shape: 36 ms against 56 a block at once).
INT8_QUANTIZE_ROWS = 256


def _int8_forward(
    weight: torch.Tensor, bias: torch.Tensor | None, two_pass: bool = False
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer in int8 (W8A8) on fbgemm's dynamic linear: weights quantized once, symmetric
    per output row and prepacked; each call scales every row (one token's activations) by its
    largest entry, quantizes it on the fixed grid (`decode_kernels.INT8_RANGE`), multiplies in
    int8 with exact int32 sums and scales back. A row's result is the same whatever else is
    in the batch: fbgemm's own per-batch scale put SmolLM2-135M's next-token distribution
    ~0.3 nats/token off at batch 8. fbgemm rather than `torch._int_mm` (oneDNN, pinned to
    AVX2 with the rest): 97 against 330-490 us for SmolLM2's MLP projection at batch 8."""
    weight = weight.detach()
    inputs = weight.shape[1]
    weight_scale = weight.new_empty(weight.shape[0])
    buffer = weight.new_empty(min(INT8_QUANTIZE_ROWS, weight.shape[0]), inputs)
    packed = []
    for first in range(0, weight.shape[0], INT8_BLOCK_ROWS):
        block = weight[first : first + INT8_BLOCK_ROWS]
        integers = block.new_zeros((len(block), inputs + decode_kernels.INT8_RANGE.shape[1]),
                                   dtype=torch.int8)
        for start in range(0, len(block), INT8_QUANTIZE_ROWS):
            rows = block[start : start + INT8_QUANTIZE_ROWS]
            values = buffer[: len(rows)]
            scale = torch.amax(torch.abs(rows, out=values), 1,
                               out=weight_scale[first + start : first + start + len(rows)])
            scale.div_(INT8_WEIGHT_MAX).clamp_(min=1e-12)
            integers[start : start + len(rows), :inputs] = torch.div(
                rows, scale[:, None], out=values).round_()
        with warnings.catch_warnings():
            # fbgemm's packing takes its weights as a quantized tensor, a kind torch 2.13
            # marks deprecated; it only wraps the integers here, and only the packed weights
            # are kept. One scale for the whole tensor (1: the rows' own are applied to the
            # outputs), as per-row ones cost the packing two tensor lookups a row (~0.3 s for
            # SmolLM2).
            warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
            quantized = torch._make_per_tensor_quantized_tensor(integers, 1.0, 0)
        packed.append(torch.ops.quantized.linear_prepack(quantized, None))
    bias = None if bias is None else bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = decode_kernels.int8_product(x.reshape(-1, x.shape[-1]), packed, weight_scale,
                                          bias, decode_kernels.INT8_RANGE, two_pass)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    kind = decode_kernels.INT8_TWO_PASS if two_pass else decode_kernels.INT8
    forward.product = (kind, weight_scale, bias, packed)  # type: ignore[attr-defined]
    return forward


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers sized once for the whole decode, `capacity`
    positions: a step writes its column in place, where `DynamicLayer` copies the whole cache
    with `torch.cat` (SmolLM2-135M, a 208-token prompt, batch 8: 22% of the profiled decode;
    11% less CPU time a step without it). Attention reads the filled part, a view."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            rows, heads, _, dim = key_states.shape
            self.key_buffer = key_states.new_empty(rows, heads, self.capacity, dim)
            self.value_buffer = value_states.new_empty(rows, heads, self.capacity, dim)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:  # a one-column write there would broadcast into nothing
            raise ValueError(f"the decode cache holds {self.capacity} positions, not {end}")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length > 0:
            self.key_buffer = self.key_buffer[indices]
            self.value_buffer = self.value_buffer[indices]
            self.keys = self.key_buffer[:, :, : self.length]
            self.values = self.value_buffer[:, :, : self.length]


def decode_cache(capacity: int) -> DynamicCache:
    """A KV cache of `PreallocatedLayer`s, each holding `capacity` positions."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = partial(PreallocatedLayer, capacity)
    return cache


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)  # sampled, the stop token included
    logprobs: list[float] = field(default_factory=list)  # under the sampling distribution
    stopped: bool = False


# Vocabularies at least this large draw by inverting the cumulative sums (`draw`); the tiny
# models' (at most a few hundred tokens) keep torch.multinomial, whose cost is nothing there,
# so their seeded runs, and the lineages pinned on them, sample what they always did.
DRAW_MIN_VOCABULARY = 1 << 12


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
    # A NaN or inf logit makes its whole row NaN (a token outside the nucleus is -inf, never
    # NaN), so the first column tells a diverged policy from a sound one.
    if bool(logp[:, 0].isnan().any()):
        raise EvoError(
            "the policy's next-token probabilities are not finite (NaN or inf): an update "
            "diverged",
            field="grpo.lr",
            hint="lower grpo.lr (or grpo.grad_clip) and run the version again",
        )
    probs = logp.exp()
    if probs.shape[-1] >= DRAW_MIN_VOCABULARY:
        tokens = draw(probs)
    else:
        tokens = torch.multinomial(probs, 1).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


# `draw` sums the vocabulary in blocks of this many entries.
DRAW_BLOCK = 256


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row, index i with probability probs[i] / sum(probs), in two levels: a
    block of DRAW_BLOCK entries drawn by its sum, then an entry of that block by inverting the
    block's cumulative sums in float64 at a second uniform draw. `torch.multinomial` draws an
    exponential per vocabulary entry instead (9 ms of a ~130 ms decode step for SmolLM2 at
    batch 8), and one float64 cumulative sum over the whole vocabulary took 4 ms at batch 8
    and 15 ms at batch 32, against 0.14 and 0.21 ms here. Each index's probability is exact but
    for its block's float32 sum, off by about 1e-7 of itself (a single float32 cumulative sum
    over the vocabulary would put one of probability 1e-6 off by ~6%). A zero-probability
    index (outside the top-p nucleus, or the last block's padding) has an empty interval, and
    where rounding puts a draw past the last nonzero entry it lands on that entry."""
    rows, vocab = probs.shape
    blocks = -(-vocab // DRAW_BLOCK)
    if vocab % DRAW_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, blocks * DRAW_BLOCK - vocab))
    probs = probs.reshape(rows, blocks, DRAW_BLOCK)
    block_sums = probs.sum(-1)
    block = _invert(block_sums.double().cumsum(-1), block_sums)
    chosen = probs[torch.arange(rows), block.squeeze(-1)]
    return (block * DRAW_BLOCK + _invert(chosen.double().cumsum(-1), chosen)).squeeze(-1)


def _invert(cumulative: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row, the index whose interval of `cumulative` (the cumulative sums of `values`)
    holds a uniform draw below the row's total, never past its last nonzero value; [rows, 1]."""
    uniform = torch.rand((cumulative.shape[0], 1), dtype=torch.float64) * cumulative[:, -1:]
    return torch.minimum(torch.searchsorted(cumulative, uniform, right=True),
                         _last_nonzero(values))


def _last_nonzero(values: torch.Tensor) -> torch.Tensor:
    """Each row's last index holding a value above zero, as a [rows, 1] tensor."""
    positions = torch.arange(values.shape[-1]).expand_as(values)
    return torch.where(values > 0, positions, -1).amax(-1, keepdim=True)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    contexts: list[list[int]],
    stops: list[int],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    pad_id: int,
    on_stop: Callable[[int, Generation], None] | None = None,
) -> list[Generation]:
    """Sample a continuation of every context, all in one batch over one KV cache. `on_stop`
    (index, generation) runs for each row the moment it samples a stop token."""
    decoder = start_decode(model, contexts, max_new_tokens, pad_id)
    logits = decoder.logits
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
            if on_stop is not None:
                on_stop(row, results[row])
        if step == max_new_tokens - 1 or not running.any():
            break
        if not running.all():  # finished rows leave the batch and the cache
            decoder.select(running)
            rows, tokens = rows[running], tokens[running]
        logits = decoder.step(tokens)
    return results



def start_decode(
    model: PreTrainedModel, contexts: list[list[int]], max_new_tokens: int, pad_id: int
) -> group_decode.GroupDecode | PaddedDecode:
    """The contexts prefilled, ready to decode: over shared prompts where the group decode
    applies (a real model's groups), else padded."""
    prompts, prompt_of_row = distinct_contexts(contexts)
    if group_decode.applies(model, len(prompts), len(contexts)):
        return group_decode.GroupDecode(model, prompts, prompt_of_row, max_new_tokens)
    return PaddedDecode(model, contexts, max_new_tokens, pad_id)

class PaddedDecode:
    """The decode for the tiny models and the architectures `group_decode` does not take:
    the distinct contexts prefilled once, left-padded, and every row given a copy of its
    context's cache rows. `logits`, `step(tokens)` and `select(keep)` as `GroupDecode`'s."""

    def __init__(
        self, model: PreTrainedModel, contexts: list[list[int]], new_tokens: int, pad_id: int
    ) -> None:
        self.model = model
        prefix_ids, prefix_attn, source = distinct_rows(contexts, pad_id)
        self.cache = decode_cache(prefix_ids.shape[1] + new_tokens)
        out = model(
            input_ids=prefix_ids,
            attention_mask=prefix_attn,
            position_ids=(prefix_attn.cumsum(-1) - 1).clamp(min=0),
            **with_cache(self.cache),
            logits_to_keep=1,
        )
        self.cache.batch_select_indices(source)
        self.logits = out.logits[source, -1]
        self.attn = prefix_attn[source]
        self.positions = self.attn.sum(-1)

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep.nonzero().squeeze(-1))
        self.attn, self.positions = self.attn[keep], self.positions[keep]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, torch.ones_like(self.attn[:, :1])], dim=-1)
        logits = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.attn,
            position_ids=self.positions[:, None],
            **with_cache(self.cache),
        ).logits[:, -1]
        self.positions = self.positions + 1
        return logits

# What samples one batched turn: (contexts, stop ids, max new tokens, temperature, top_p,
# pad id, on_stop) -> one Generation per context. `generate` over the policy is the built-in
# one; `evotrainer.engine.vllm_rollout.VllmSampler` is the other.
Sampler = Callable[
    [list[list[int]], list[int], int, float, float, int, Callable[[int, Generation], None] | None],
    list[Generation],
]


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
    on_finished: Callable[[int, Episode], None] | None = None,
    sampler: Sampler | None = None,
    weights: str = "float32",
) -> list[Episode]:
    """One episode per task (repeat a task G times for a group). Active episodes advance one
    turn per batched `generate` call until they stop, run out of tokens or hit max_turns.
    `on_finished(index, episode)` runs once per episode as soon as it is over (a single-turn
    episode: the moment it samples its stop token), so it can be scored while others sample.
    `sampler` replaces the built-in `generate` over `model` (which still gives the stop ids);
    `weights` is the built-in one's precision (`prepacked`)."""
    model.eval()
    stops = stop_ids(tokenizer, domain, model)
    action_end = stops[-1] if domain.turn_end is not None else None  # multi-turn: more to come
    episodes = [Episode(task=t, prompt_ids=prompt_ids(tokenizer, t.prompt, chat)) for t in tasks]
    envs = [domain.environment(t, env_config) for t in tasks] if env_config else None
    max_turns = env_config["max_turns"] if env_config else 1
    try:
        if sampler is not None:
            _run_turns(sampler, tokenizer, domain, episodes, envs, max_turns, stops, action_end,
                       max_turn_tokens, temperature, top_p, on_finished)
        else:
            with prepacked(model, weights):
                _run_turns(partial(generate, model), tokenizer, domain, episodes, envs,
                           max_turns, stops, action_end, max_turn_tokens, temperature, top_p,
                           on_finished)
    finally:
        # Release what each episode holds (a container, a scratch repository) now, not when
        # the garbage collector gets to it: every episode here is over.
        for env in envs or []:
            close = getattr(env, "close", None)
            if callable(close):
                close()
    return episodes


def _run_turns(
    sampler: Sampler,
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
    on_finished: Callable[[int, Episode], None] | None = None,
) -> None:
    """Advance the active episodes one batched turn at a time, in place."""
    active = list(range(len(episodes)))
    for _turn in range(max_turns):
        if not active:
            break
        goes_on: dict[int, bool] = {}  # batch position -> the episode takes another turn

        def settle(
            position: int,
            gen: Generation,
            active: list[int] = active,
            goes_on: dict[int, bool] = goes_on,
        ) -> None:
            i = active[position]
            env = envs[i] if envs is not None else None
            goes_on[position] = _settle(episodes[i], env, gen, tokenizer, domain, action_end)
            if not goes_on[position] and on_finished is not None:
                on_finished(i, episodes[i])

        # A single-turn episode is over the moment it stops; a multi-turn one steps its
        # environment in the batch's order, after the turn, as it always has.
        generations = sampler(
            [episodes[i].prompt_ids + episodes[i].ids for i in active],
            stops,
            max_turn_tokens,
            temperature,
            top_p,
            tokenizer.pad_token_id,
            settle if envs is None else None,
        )
        for position, gen in enumerate(generations):
            if position not in goes_on:
                settle(position, gen)
        active = [active[p] for p in sorted(goes_on) if goes_on[p]]


def _settle(
    ep: Episode,
    env: Any,
    gen: Generation,
    tokenizer: PreTrainedTokenizerBase,
    domain: Domain,
    action_end: int | None,
) -> bool:
    """Append one turn's action (and the environment's reply) to its episode; True when the
    episode takes another turn."""
    action = gen.tokens
    ep.ids += action
    ep.mask += [1] * len(action)
    ep.logprobs += gen.logprobs
    ep.turns += 1
    body = action[:-1] if gen.stopped else action
    text = tokenizer.decode(body, skip_special_tokens=True)
    ep.text.append(text if not gen.stopped or env is None else text + (domain.turn_end or ""))
    if not gen.stopped:
        ep.finish_reason = "length"
        return False
    if env is None or action[-1] != action_end:
        ep.finish_reason = "stop"
        return False
    reply = env.step(text)
    if reply.tool_call is not None:
        ep.tool_calls.append(reply.tool_call)
    if reply.done:
        ep.finish_reason = "stop"
        return False
    obs = encode(tokenizer, reply.observation)
    ep.ids += obs
    ep.mask += [0] * len(obs)
    ep.text.append(reply.observation)
    ep.finish_reason = "tool_limit"  # stays so unless a later turn finishes
    return True


def distinct_contexts(rows: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """Each distinct row once, in first-seen order, and for every row the index of its
    distinct copy: a group's shared prompt runs once and its rows share the result."""
    distinct: dict[tuple[int, ...], int] = {}
    source = [distinct.setdefault(tuple(row), len(distinct)) for row in rows]
    return [list(row) for row in distinct], torch.tensor(source)


def distinct_rows(
    rows: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`distinct_contexts`, the distinct rows left-padded (ids, attention mask)."""
    unique, source = distinct_contexts(rows)
    ids, attn = left_pad(unique, pad_id)
    return ids, attn, source


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
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each next token and the policy's entropy there, both (B, T-1), or
    (B, tail) for the last `tail` targets only: responses sit at the right end of left-padded
    rows, so the vocabulary-sized logits of the prompt never need to exist. `temperature` as
    `target_logprobs`."""
    tail = ids.shape[1] - 1 if tail is None else tail
    logits = model(
        input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=tail + 1
    ).logits[:, :-1]
    return target_logprobs(logits, ids[:, -tail:], temperature)


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, T, V) predicting targets (B, T) → the targets' log-probabilities and the
    policy's entropy at each position, both (B, T), under softmax(logits / temperature): the
    distribution the sampler drew from at that temperature (top-p aside), as verl's actor and
    TRL's GRPOTrainer divide the logits by the rollout temperature before the loss."""
    logits = logits.float()
    if temperature != 1.0:  # x / 1.0 is x: at temperature 1 no copy of the logits
        logits = logits / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    with torch.no_grad():  # a statistic only: its vocabulary-sized product needs no graph
        probs_logp = logp_all.detach()
        entropy = -(probs_logp.exp() * probs_logp).sum(-1)
    return logp, entropy
