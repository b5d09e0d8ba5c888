"""Decoding groups whose rows continue a few shared prompts, each prompt's keys and values held
once: the sampler's path for real models.

A GRPO batch is a few prompts times a group of samples. The padded decode (`rollout.generate`'s
other path) copies each prompt's KV cache into every row of its group and attends over it row
by row, so a step reads the prompt's keys and values `group` times; on SmolLM2-135M, four
~190-token prompts times 8 samples, that attention was 19% of the sampling call. Here each
prompt is prefilled on its own (no padding, so no mask and no wasted positions) and its keys
and values stay one copy; a decode step attends each prompt's rows to that copy in one product
and the rows' own generated positions apart, and merges the two softmaxes by their
log-sum-exp (as flash-decoding merges its splits). The arithmetic is attention's, reordered:
tests/test_group_decode.py holds the logits to the padded path's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from evotrainer.engine import decode_kernels
from evotrainer.engine.model import lora_layer_class, lora_weight, with_cache

ATTENTION = "evotrainer_group_decode"
# Architectures whose attention goes through transformers' attention interface with plain
# causal softmax attention on every layer (no sliding window, soft-capping or sinks).
FAMILIES = ("llama", "qwen2", "qwen3")
# Models with at least this many weights decode this way; the tiny models (well under a
# million) keep the padded path, so their seeded runs, and the lineages pinned on them, sample
# what they always did.
MIN_WEIGHTS = 1 << 24


def applies(model: PreTrainedModel, prompts: int, rows: int) -> bool:
    """Whether `model` decodes `rows` continuing `prompts` distinct contexts over shared
    prompts: an architecture this attention takes, and two rows a prompt or more on average
    (a multi-turn episode's later turns are all distinct; one prefill per row would cost more
    there)."""
    if prompts * 2 > rows:
        return False
    config = model.config
    full_attention = all(
        kind == "full_attention" for kind in getattr(config, "layer_types", None) or []
    )
    return (
        config.model_type in FAMILIES
        and full_attention
        and not getattr(config, "use_sliding_window", False)
        and sum(p.numel() for p in model.parameters()) >= MIN_WEIGHTS
    )


class GroupLayer(DynamicLayer):
    """One layer's cache: each prompt's keys and values, [kv_heads, length, head_dim] once, and
    each row's generated ones in buffers of `capacity` positions sized once."""

    def __init__(self, prompt_keys: list[torch.Tensor], prompt_values: list[torch.Tensor],
                 rows: int, capacity: int) -> None:
        super().__init__()
        self.prompt_keys, self.prompt_values = prompt_keys, prompt_values
        kv_heads, _, dim = prompt_keys[0].shape
        self.key_buffer = prompt_keys[0].new_empty(rows, kv_heads, capacity, dim)
        self.value_buffer = prompt_values[0].new_empty(rows, kv_heads, capacity, dim)
        self.capacity, self.length = capacity, 0
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the decode cache holds {self.capacity} positions, not {end}")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        # What attention reads of the rows' own positions; the prompts' come from the layer.
        return self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer = self.key_buffer[indices]
        self.value_buffer = self.value_buffer[indices]


class GroupCache(DynamicCache):
    """The decode cache of a batch whose row i continues prompt `prompt_of_row[i]`."""

    def __init__(self, layers: list[GroupLayer], prompt_of_row: torch.Tensor) -> None:
        super().__init__()
        self.layers = layers
        self.layer_class_to_replicate = None
        self.select_rows(prompt_of_row)

    def select_rows(self, prompt_of_row: torch.Tensor) -> None:
        self.prompt_of_row = prompt_of_row
        # Each prompt's rows: a slice where they are consecutive (a batch laid out prompt by
        # prompt, as the engine's groups are, stays so as rows leave), else their indices;
        # and always as indices, in the same order, for the scripted step (`decode_kernels`).
        self.rows_of_prompt: list[tuple[int, slice | torch.Tensor]] = []
        self.member_indices: list[torch.Tensor] = []
        for prompt in prompt_of_row.unique().tolist():
            members = (prompt_of_row == prompt).nonzero().squeeze(-1)
            self.member_indices.append(members)
            first, last = int(members[0]), int(members[-1])
            consecutive = last - first + 1 == len(members)
            self.rows_of_prompt.append((prompt, slice(first, last + 1) if consecutive else members))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)
        self.select_rows(self.prompt_of_row[indices])


def group_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One decode position per row: softmax attention over the row's prompt (shared with its
    group) and its own generated positions (`key`, `value`), as transformers' attention
    interface calls it. Returns [rows, 1, heads, head_dim]."""
    cache: GroupCache = kwargs["group_cache"]
    layer = cache.layers[module.layer_idx]
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    # Query head h reads key head h // (heads / kv_heads), as transformers' repeat_kv lays out.
    q = query.float().reshape(rows, kv_heads, heads // kv_heads, dim)
    own = torch.matmul(q, key.float().transpose(-1, -2)) * scaling
    own_lse = own.logsumexp(-1, keepdim=True)
    own_out = torch.matmul(own.softmax(-1), value.float())
    prompt_out, prompt_lse = torch.empty_like(own_out), torch.empty_like(own_lse)
    for prompt, members in cache.rows_of_prompt:
        # [kv_heads, rows of this prompt x query heads per kv head, head_dim]: one product
        # against the prompt's single copy.
        qp = q[members].transpose(0, 1).reshape(kv_heads, -1, dim)
        scores = torch.matmul(qp, layer.prompt_keys[prompt].float().transpose(-1, -2)) * scaling
        lse = scores.logsumexp(-1, keepdim=True)
        out = torch.matmul(scores.softmax(-1), layer.prompt_values[prompt].float())
        prompt_out[members] = out.reshape(kv_heads, -1, heads // kv_heads, dim).transpose(0, 1)
        prompt_lse[members] = lse.reshape(kv_heads, -1, heads // kv_heads, 1).transpose(0, 1)
    # The two softmaxes merged: the prompt's share of the whole is sigmoid(lse_p - lse_own).
    share = torch.sigmoid(prompt_lse - own_lse)
    merged = own_out + share * (prompt_out - own_out)
    return merged.reshape(rows, 1, heads, dim).to(query.dtype), None


AttentionInterface.register(ATTENTION, group_attention)


@contextmanager
def _attention(model: PreTrainedModel, name: str) -> Iterator[None]:
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = saved


class GroupDecode:
    """Prefill each of the distinct `prompts` once, then decode every row (row i continues
    `prompts[prompt_of_row[i]]`) over them. `logits` holds the rows' next-token logits;
    `step(tokens)` feeds one token per row and returns the next logits; `select(keep)` drops
    the rows not kept."""

    def __init__(self, model: PreTrainedModel, prompts: list[list[int]],
                 prompt_of_row: torch.Tensor, capacity: int) -> None:
        self.model = model
        prompt_keys: list[list[torch.Tensor]] = [[] for _ in range(model.config.num_hidden_layers)]
        prompt_values: list[list[torch.Tensor]] = [[] for _ in prompt_keys]
        last_logits = []
        for prompt in prompts:
            cache = DynamicCache()
            out = model(input_ids=torch.tensor([prompt]), **with_cache(cache), logits_to_keep=1)
            last_logits.append(out.logits[0, -1])
            for i, layer in enumerate(cache.layers):
                prompt_keys[i].append(layer.keys[0])
                prompt_values[i].append(layer.values[0])
        self.cache = GroupCache(
            [GroupLayer(keys, values, len(prompt_of_row), capacity)
             for keys, values in zip(prompt_keys, prompt_values, strict=True)],
            prompt_of_row,
        )
        self.logits = torch.stack(last_logits)[prompt_of_row]
        # Read once: the weights do not change while a sampling call decodes.
        self.projections = scripted_projections(model)
        self.positions = torch.tensor([len(prompt) for prompt in prompts])[prompt_of_row]

    def select(self, keep: torch.Tensor) -> None:
        indices = keep.nonzero().squeeze(-1)
        self.cache.batch_select_indices(indices)
        self.positions = self.positions[indices]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.projections is not None:
            logits = self._scripted_step(tokens, self.projections)
        else:
            with _attention(self.model, ATTENTION):
                logits = self.model(
                    input_ids=tokens[:, None],
                    position_ids=self.positions[:, None],
                    group_cache=self.cache,
                    **with_cache(self.cache),
                ).logits[:, -1]
        self.positions = self.positions + 1
        return logits

    def _scripted_step(self, tokens: torch.Tensor, projections: Projections) -> torch.Tensor:
        """The step as `decode_kernels.decode_layers` runs it, the embedding, the rotary
        embedding, the final norm and the vocabulary projection from the model's own modules."""
        decoder = self.model.get_decoder()
        hidden = decoder.embed_tokens(tokens)
        cos, sin = decoder.rotary_emb(hidden[:, None], self.positions[:, None])
        layers = self.cache.layers
        order = [prompt for prompt, _ in self.cache.rows_of_prompt]
        attention = decoder.layers[0].self_attn
        hidden = decode_kernels.decode_layers(
            hidden, cos, sin, *projections, decode_kernels.INT8_RANGE,
            [[layer.prompt_keys[p] for p in order] for layer in layers],
            [[layer.prompt_values[p] for p in order] for layer in layers],
            self.cache.member_indices,
            [members.start if isinstance(members, slice) else -1
             for _, members in self.cache.rows_of_prompt],
            [layer.key_buffer for layer in layers], [layer.value_buffer for layer in layers],
            layers[0].length, self.model.config.num_attention_heads,
            self.model.config.num_key_value_heads, float(attention.scaling))
        for layer in layers:
            layer.length += 1
        return self.model.get_output_embeddings()(decoder.norm(hidden))


# What `decode_kernels.decode_layers` takes of a model's layers: the norms' weights and
# epsilon, then each projection's kind, weight (an int8 one's per-output scales), bias and
# fbgemm weights.
Projections = tuple[list[torch.Tensor], float, list[int], list[torch.Tensor],
                    list[torch.Tensor | None], list[Any]]


def scripted_projections(model: PreTrainedModel) -> Projections | None:
    """The layers of a Llama-shaped model (a Llama or a Qwen2: RMS norms, rotary attention,
    a SiLU-gated MLP) as `decode_kernels.decode_layers` takes them: each projection as
    `rollout.prepacked` packed it, or its plain float32 weight (a LoRA layer's with its
    adapters merged); None where a layer holds anything else (Qwen3's query and key norms, a
    LoRA variant `lora_weight` does not merge), so the step runs through transformers'
    modules."""
    config = model.config
    if config.model_type not in ("llama", "qwen2") or config.hidden_act != "silu":
        return None
    norms: list[torch.Tensor] = []
    kinds: list[int] = []
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    int8: list[Any] = []
    epsilons = set()
    lora = lora_layer_class()
    for layer in model.get_decoder().layers:
        attention, mlp = layer.self_attn, layer.mlp
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norms.append(norm.weight.detach())
            epsilons.add(norm.variance_epsilon)
        for module in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                       mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            product = getattr(vars(module).get("forward"), "product", None)
            if product is not None:
                kind, weight, bias, packed = product
            elif type(module) is torch.nn.Linear:
                kind, weight, bias, packed = (decode_kernels.PLAIN, module.weight.detach(),
                                              module.bias, None)
            elif lora is not None and type(module) is lora and (
                merged := lora_weight(module)
            ) is not None:
                # A LoRA layer too small to pack (a key or value projection): its adapters
                # merged once here, one product a step instead of three.
                kind, weight, bias, packed = (decode_kernels.PLAIN, merged,
                                              module.base_layer.bias, None)
            else:
                return None
            kinds.append(kind)
            weights.append(weight)
            biases.append(None if bias is None else bias.detach())
            int8.append(packed)
    if len(epsilons) != 1:
        return None
    return norms, epsilons.pop(), kinds, weights, biases, int8
