"""The sampler's decode step as TorchScript: every layer of a Llama-shaped model for one new
position per row, over the group decode's cache (`group_decode`).

A batch-8 decode step of SmolLM2-135M is ~2,700 small operations; run from Python they add
about 40% to their arithmetic (62-70 ms of wall time against 45-50 ms of operations,
`torch.profiler`). The same operations scripted ran 56 ms a step against 88 from transformers'
modules, measured in one process. torch.compile was no help here: the whole step in one
inductor graph ran 254 ms against 195 eager, after 145 s of compiling. `torch.jit.script`
warns that TorchScript is deprecated in torch 2.13, the version this project pins.

The products are the ones `rollout.prepacked` makes (`int8_product`, `packed_product`, plain
float32), so the step computes what the modules compute; tests/test_group_decode.py holds its
logits to the padded decode's.
"""

from __future__ import annotations

import warnings

import torch

# Projection kinds: a plain float32 weight, a weight packed for oneDNN, int8 packed for fbgemm
# with each input row quantized once or in two passes (`int8_product`); JOINED: computed by
# the product before it, packed for this one and its siblings together (`rollout.SIBLINGS`).
PLAIN, PACKED, INT8, INT8_TWO_PASS, JOINED = 0, 1, 2, 3, -1
# The grid every int8 input is quantized on: fbgemm's dynamic linear picks one from the whole
# batch's range, so each row is first scaled to [-1, 1] and two input columns pinned at 1 and
# -128/127 (their weights zero) make that range the same for any batch: steps of 1/127
# around a zero point of 128, so a row is quantized as round(127 x / max|x|), its own scale.
INT8_RANGE = torch.tensor([[1.0, -128 / 127]])

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*is deprecated.*")

    @torch.jit.script
    def _int8_blocks(inputs: torch.Tensor,
                     packed: list[torch.classes.quantized.LinearPackedParamsBase]) -> torch.Tensor:
        if len(packed) == 1:
            return torch.ops.quantized.linear_dynamic(inputs, packed[0], False)
        return torch.cat([torch.ops.quantized.linear_dynamic(inputs, block, False)
                          for block in packed], 1)

    @torch.jit.script
    def int8_product(
        rows: torch.Tensor,
        packed: list[torch.classes.quantized.LinearPackedParamsBase],
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        input_range: torch.Tensor,
        two_pass: bool,
    ) -> torch.Tensor:
        """`rows` [n, in] times int8 weights packed for fbgemm in blocks of output rows
        (`rollout._int8_forward`): each row scaled by its largest entry onto the grid
        `input_range` pins, exact int32 sums, scaled back per row and per output, plus
        `bias`.

        `two_pass`: each row is quantized in two passes, for inputs with a few massive
        channels, whose other entries one 8-bit grid leaves a few steps wide. The first pass
        is the row rounded to that grid, which fbgemm maps back to the same integers; the
        second is what the first left (within half a step) on a grid of its own. Both go
        through the one packed weight as 2n rows, so a row has ~15 bits for the cost of a
        product twice as tall (at n = 8: 112 against 67 us for SmolLM2's MLP projection)."""
        n, width = rows.shape
        # abs().amax: 4 us at 8 x 576, where linalg.vector_norm(ord=inf) took 15.
        scale = rows.abs().amax(1, keepdim=True).clamp_(min=1e-12)
        # Both passes and the pinned columns written into one buffer, where two torch.cat
        # copied them: the same at batch 8; a 292-token prefill's 960 x 576 product in two
        # passes took 1.84 against 1.97-2.02 ms.
        inputs = rows.new_empty((2 * n if two_pass else n, width + input_range.shape[1]))
        inputs[:, width:] = input_range
        scaled = torch.div(rows, scale, out=inputs[:n, :width])
        if two_pass:
            coarse = (scaled * 127).round_().div_(127)
            remainder = torch.sub(scaled, coarse, out=inputs[n:, :width])
            remainder_scale = remainder.abs().amax(1, keepdim=True).clamp_(min=1e-12)
            remainder.div_(remainder_scale)
            scaled.copy_(coarse)
            out = _int8_blocks(inputs, packed)
            out = out[:n].mul_(scale).add_(out[n:].mul_(scale * remainder_scale))
        else:
            out = _int8_blocks(inputs, packed).mul_(scale)
        out = out.mul_(weight_scale)
        return out if bias is None else out + bias

    @torch.jit.script
    def packed_product(rows: torch.Tensor, packed: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """`rows` [n, in] times float32 weights reordered once for oneDNN."""
        # TorchScript's "number": the schema's Scalar?[] takes no narrower list.
        no_arguments: list[int | float | complex | None] = []
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", no_arguments, "")

    @torch.jit.script
    def _project(
        index: int,
        rows: torch.Tensor,
        kinds: list[int],
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        int8: list[list[torch.classes.quantized.LinearPackedParamsBase] | None],
        input_range: torch.Tensor,
    ) -> torch.Tensor:
        kind, bias = kinds[index], biases[index]
        if kind >= 2:
            packed = int8[index]
            assert packed is not None
            return int8_product(rows, packed, weights[index], bias, input_range, kind == 3)
        if kind == 1:
            return packed_product(rows, weights[index], bias)
        return torch.nn.functional.linear(rows, weights[index], bias)

    @torch.jit.script
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    @torch.jit.script
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    @torch.jit.script
    def decode_layers(
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        norms: list[torch.Tensor],
        eps: float,
        kinds: list[int],
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        int8: list[list[torch.classes.quantized.LinearPackedParamsBase] | None],
        input_range: torch.Tensor,
        prompt_keys: list[list[torch.Tensor]],
        prompt_values: list[list[torch.Tensor]],
        members: list[torch.Tensor],
        firsts: list[int],
        key_buffers: list[torch.Tensor],
        value_buffers: list[torch.Tensor],
        length: int,
        heads: int,
        kv_heads: int,
        scaling: float,
    ) -> torch.Tensor:
        """`hidden` [rows, hidden] through every layer at one new position per row. Layer i's
        projections are entries 7i..7i+6 of the projection lists (query, key, value, output,
        gate, up, down; a JOINED key and value, or up, take their part of the query's, or
        gate's, product), its norms 2i and 2i+1. Row r continues prompt p where r is in
        `members[p]`, consecutive rows from `firsts[p]` on (-1 where they are not); each
        row's own keys and values so far fill `length` positions of the buffers, and this
        position's are written at `length`. The attention is
        `group_decode.group_attention`'s, as one softmax over the prompt's positions and the
        row's own."""
        rows = hidden.shape[0]
        dim = cos.shape[-1]
        group = heads // kv_heads
        for layer in range(len(key_buffers)):
            first = 7 * layer
            normed = _rms_norm(hidden, norms[2 * layer], eps)
            query = _project(first, normed, kinds, weights, biases, int8, input_range)
            if kinds[first + 1] == -1:  # JOINED: the query's product made the keys and values
                query, key, value = query.split([heads * dim, kv_heads * dim, kv_heads * dim], 1)
            else:
                key = _project(first + 1, normed, kinds, weights, biases, int8, input_range)
                value = _project(first + 2, normed, kinds, weights, biases, int8, input_range)
            query = _rotate(query.view(rows, heads, dim), cos, sin)
            key_buffers[layer][:, :, length] = _rotate(key.view(rows, kv_heads, dim), cos, sin)
            value_buffers[layer][:, :, length] = value.view(rows, kv_heads, dim)
            own_keys = key_buffers[layer][:, :, : length + 1]
            own_values = value_buffers[layer][:, :, : length + 1]
            # Query head h reads key head h // group, as transformers' repeat_kv lays out.
            grouped = query.view(rows, kv_heads, group, dim)
            own = torch.matmul(grouped, own_keys.transpose(-1, -2)) * scaling
            out = torch.empty_like(grouped)
            for prompt in range(len(members)):
                these, start = members[prompt], firsts[prompt]
                n = these.shape[0]
                # A prompt's rows are views where they are consecutive (the engine's groups
                # are), else gathered by index.
                if start >= 0:
                    asked = grouped.narrow(0, start, n)
                    own_scores = own.narrow(0, start, n)
                    own_rows = own_values.narrow(0, start, n)
                else:
                    asked = grouped.index_select(0, these)
                    own_scores = own.index_select(0, these)
                    own_rows = own_values.index_select(0, these)
                # [kv_heads, rows of this prompt x query heads per kv head, head_dim]: one
                # product against the prompt's single copy.
                asked = asked.transpose(0, 1).reshape(kv_heads, -1, dim)
                keys = prompt_keys[layer][prompt]
                scores = torch.matmul(asked, keys.transpose(-1, -2)) * scaling
                scores = scores.view(kv_heads, n, group, -1).transpose(0, 1)
                probabilities = torch.cat([own_scores, scores], -1).softmax(-1)
                on_own, on_prompt = probabilities.split([length + 1, keys.shape[-2]], -1)
                attended = torch.matmul(on_own, own_rows) + torch.matmul(
                    on_prompt.transpose(0, 1).reshape(kv_heads, n * group, -1),
                    prompt_values[layer][prompt],
                ).view(kv_heads, n, group, dim).transpose(0, 1)
                if start >= 0:
                    out.narrow(0, start, n).copy_(attended)
                else:
                    out.index_copy_(0, these, attended)
            hidden = hidden + _project(first + 3, out.reshape(rows, heads * dim), kinds, weights,
                                       biases, int8, input_range)
            normed = _rms_norm(hidden, norms[2 * layer + 1], eps)
            gate = _project(first + 4, normed, kinds, weights, biases, int8, input_range)
            if kinds[first + 5] == -1:
                gate, up = gate.chunk(2, 1)
            else:
                up = _project(first + 5, normed, kinds, weights, biases, int8, input_range)
            hidden = hidden + _project(first + 6, torch.nn.functional.silu(gate) * up, kinds,
                                       weights, biases, int8, input_range)
        return hidden
