"""Int8 rollouts and the loss's correction for them: the built-in sampler can sample
training groups on int8 copies of the policy's layers (`rollout.quantization: int8`), and the
surrogate is then weighted by truncated importance ratios against the distribution the tokens
were drawn from (`rollout.importance_cap`, verl's token-level rollout correction)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from real_checkpoint import chat_tokenizer, tiny_llama

from evotrainer.contract.rollout import check_rollout
from evotrainer.contract.typed import Recipe
from evotrainer.domains import Task
from evotrainer.engine import decode_kernels, grpo, rollout, run_job
from evotrainer.engine.grpo import (
    FullRows,
    SharedPrompts,
    importance_weights,
    policy_loss,
    sampler_logprobs,
)
from evotrainer.engine.rollout import Episode, generate, prepacked
from evotrainer.errors import EvoError
from evotrainer.store.recipe import resolve

torch.set_num_threads(1)

# The default recipe's GRPO settings with the loss's own set by hand.
GRPO = Recipe.from_dict(resolve({}, [])).grpo
LOSS = replace(GRPO, clip_low=0.2, clip_high=0.28, kl_coef=0.0, kl_estimator="k3",
               loss_agg="token-mean")


def test_an_int8_layer_is_near_its_float_layer_and_each_row_is_quantized_alone():
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160)
    x = torch.randn(6, 96)
    x[0] *= 50  # one row far larger than the others
    forward = rollout._int8_forward(layer.weight, layer.bias)
    with torch.no_grad():
        want, got = layer(x), forward(x)
        assert float((got - want).norm() / want.norm()) < 0.02
        # Per-token scales: a row's output does not depend on what else is in the batch (a
        # per-batch input scale would have the large row crush the small ones' resolution).
        for row in range(6):
            assert torch.equal(forward(x[row : row + 1])[0], got[row])
        assert forward(x[None]).shape == (1, 6, 160)


def _int8_layer_in_a_process(instructions: str, script: str) -> str:
    """`script` run where fbgemm uses `instructions` only (its AVX2, AVX512 or AVX512_E1 (VNNI)
    kernels; a machine without them runs its best below)."""
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": instructions}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, check=True)
    return done.stdout


def test_int8_sums_are_exact_on_fbgemms_avx2_kernel():
    """fbgemm's AVX2 int8 product adds pairs of u8 x s8 products in 16 bits: weights over 63
    overflow them (with 127, 99% of the output off, measured). A process held to AVX2, inputs
    and weights at their extremes: the int8 layer is its float layer, to int8's resolution."""
    script = (
        "import torch\n"
        "from evotrainer.engine.rollout import _int8_forward\n"
        "weight = torch.full((64, 576), 0.5)\n"
        "weight[::2] = -0.5\n"
        "x = torch.full((8, 576), 3.0)\n"
        "x[1] = -3.0\n"
        "want = x @ weight.T\n"
        "got = _int8_forward(weight, None)(x)\n"
        "print(float((got - want).abs().max() / want.abs().max()))\n"
    )
    assert float(_int8_layer_in_a_process("AVX2", script)) < 1e-6


def test_int8_layers_compute_bit_for_bit_the_same_on_every_instruction_set():
    """Why fbgemm is not pinned with the engine's other kernels (PINNED_KERNELS): the integer
    sums are exact and leave the product through one float multiply, so AVX2, AVX-512 and
    VNNI give the same bits, ragged shapes and massive channels included, in one pass or two."""
    script = (
        "import torch\n"
        "from evotrainer.engine.rollout import _int8_forward\n"
        "torch.manual_seed(0)\n"
        "for rows, inputs, outputs in ((8, 576, 3072), (292, 1536, 576), (3, 577, 100)):\n"
        "    x = torch.randn(rows, inputs) * torch.rand(rows, 1) * 10\n"
        "    x[:, 3] *= 20\n"
        "    weight = torch.randn(outputs, inputs)\n"
        "    for two_pass in (False, True):\n"
        "        out = _int8_forward(weight, None, two_pass)(x)\n"
        "        print(out.view(torch.int32).sum(dtype=torch.int64).item(), float(out.sum()))\n"
    )
    kernels = {name: _int8_layer_in_a_process(name, script)
               for name in ("AVX2", "AVX512", "AVX512_E1")}
    assert len(set(kernels.values())) == 1, kernels


def test_int8_sampling_packs_every_layer_the_massive_inputs_quantized_in_two_passes(
        monkeypatch):
    monkeypatch.setattr(rollout, "PACK_MIN_WEIGHTS", 0)
    monkeypatch.setattr(rollout, "INT8_MIN_WEIGHTS", 0)
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer).eval()
    ids = torch.tensor([tokenizer.encode("def add(a, b):")])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with prepacked(model, "int8") as packed:
            linears = {name: m for name, m in model.named_modules()
                       if type(m) is torch.nn.Linear}
            assert packed == len(linears)
            # The key and value projections in two passes, and so their query sibling, whose
            # one product makes all three; the gate's makes the up projection's.
            each_layer = {
                "self_attn.q_proj": decode_kernels.INT8_TWO_PASS,
                "self_attn.k_proj": decode_kernels.JOINED,
                "self_attn.v_proj": decode_kernels.JOINED,
                "self_attn.o_proj": decode_kernels.INT8,
                "mlp.gate_proj": decode_kernels.INT8,
                "mlp.up_proj": decode_kernels.JOINED,
                "mlp.down_proj": decode_kernels.INT8_TWO_PASS,
            }
            assert {name: m.forward.product[0] for name, m in linears.items()} == {
                "lm_head": decode_kernels.INT8_TWO_PASS,
                **{f"model.layers.{layer}.{name}": kind
                   for layer in (0, 1) for name, kind in each_layer.items()},
            }
            got = model(input_ids=ids).logits
        assert all("forward" not in vars(m) for m in linears.values())  # restored on exit
        assert torch.equal(model(input_ids=ids).logits, want)
    assert 0 < float((got - want).norm() / want.norm()) < 0.05


def test_two_passes_resolve_a_row_around_its_massive_channels():
    """One 8-bit grid per row is as wide as the row's largest entry allows: beside a massive
    channel the others get a few steps. The second pass quantizes what the first left; against
    the int8 weights' exact product the input's error falls by two orders of magnitude, and a
    row's result still does not depend on the rest of the batch."""
    torch.manual_seed(0)
    weight = torch.randn(160, 96)
    x = torch.randn(6, 96)
    x[:, 5] *= 40  # a massive channel
    x[0] *= 50
    one_pass = rollout._int8_forward(weight, None)
    two_pass = rollout._int8_forward(weight, None, two_pass=True)
    scale = weight.abs().amax(1, keepdim=True) / rollout.INT8_WEIGHT_MAX
    exact = x @ ((weight / scale).round() * scale).T  # the int8 weights, the input unrounded
    error = {name: float((forward(x) - exact).norm() / exact.norm())
             for name, forward in (("one", one_pass), ("two", two_pass))}
    assert error["two"] < error["one"] / 100, error
    got = two_pass(x)
    for row in range(6):
        assert torch.equal(two_pass(x[row : row + 1])[0], got[row])


def test_frozen_layers_stay_packed_across_calls_until_their_weights_change(monkeypatch):
    """A LoRA policy's vocabulary projection never trains, so it is packed once per run; the
    trained layers are packed afresh on every call. A frozen weight written after all (in
    place, or by loading a checkpoint) is packed again: sampling never runs on a stale copy."""
    monkeypatch.setattr(rollout, "PACK_MIN_WEIGHTS", 0)
    monkeypatch.setattr(rollout, "INT8_MIN_WEIGHTS", 0)
    model = tiny_llama(chat_tokenizer()).eval()
    head, mlp = model.get_output_embeddings(), model.model.layers[0].mlp.up_proj
    head.weight.requires_grad_(False)
    hidden = torch.randn(3, head.in_features)

    def computes_with_its_weight() -> bool:
        want = hidden @ head.weight.T
        return float((head(hidden) - want).norm() / want.norm()) < 0.02

    with torch.no_grad():
        with prepacked(model, "int8"):
            first_head, first_mlp = head.forward, mlp.forward
        with prepacked(model, "int8"):
            assert head.forward is first_head
            assert mlp.forward is not first_mlp
        head.weight.mul_(-2)  # a write through the parameter
        with prepacked(model, "int8"):
            assert head.forward is not first_head
            assert computes_with_its_weight()
        state = {name: value.clone() for name, value in model.state_dict().items()}
        state["lm_head.weight"] = -state["lm_head.weight"]
        model.load_state_dict(state)
        with prepacked(model, "int8"):
            assert computes_with_its_weight()
        with prepacked(model, "float32"):  # another precision, another copy
            assert torch.allclose(head(hidden), hidden @ head.weight.T, atol=1e-5)


def test_the_importance_weights_are_truncated_ratios_with_verls_statistics():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3]]))
    sampled = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.6]]))  # ratios 1, 4, 3, 0.5
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is not trained
    weights, stats = importance_weights(old, sampled, mask, cap=2.0)
    assert weights[0].tolist() == pytest.approx([1.0, 2.0, 2.0, 0.0])
    assert stats["rollout_is_mean"] == pytest.approx(5 / 3)
    assert stats["rollout_is_ratio_fraction_high"] == pytest.approx(2 / 3)
    assert stats["rollout_kl"] == pytest.approx(-(math.log(1) + math.log(4) + math.log(3)) / 3)


def test_the_weights_scale_each_tokens_policy_gradient_and_not_the_kl():
    logp = torch.log(torch.tensor([[0.4, 0.6]])).requires_grad_()
    mask = torch.ones(1, 2)
    adv = torch.tensor([1.0])
    grads = []
    for importance in (None, torch.tensor([[0.5, 2.0]])):
        logp.grad = None
        loss, _ = policy_loss(logp, logp.detach(), None, adv, mask, LOSS, importance)
        loss.backward()
        grads.append(logp.grad.clone())
    scaled = grads[0][0] * torch.tensor([0.5, 2.0])
    assert grads[1][0].tolist() == pytest.approx(scaled.tolist())
    ref = torch.log(torch.tensor([[0.3, 0.3]]))
    with_kl = replace(LOSS, kl_coef=0.1)
    plain, _ = policy_loss(logp, logp.detach(), ref, adv * 0, mask, with_kl)
    weighted, _ = policy_loss(logp, logp.detach(), ref, adv * 0, mask, with_kl,
                              torch.tensor([[0.5, 2.0]]))
    assert weighted.item() == pytest.approx(plain.item())  # the KL term is not weighted


@pytest.mark.parametrize("batch_kind", [FullRows, SharedPrompts])
def test_the_samplers_log_probabilities_line_up_with_either_training_batch(batch_kind):
    """Float32 samples at temperature 0.7, one followed by an environment reply: laid out as the
    batch's mask, the sampler's log-probabilities are the trainer's, so every weight is 1."""
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer).eval()
    task = Task(task_id="t", prompt="", answer="", data_source="test")
    contexts = [tokenizer.encode(t) for t in ("def add", "Complete the function.") for _ in "abc"]
    torch.manual_seed(0)
    with torch.no_grad():
        generations = generate(model, contexts, [tokenizer.eos_token_id], 8, 0.7, 1.0,
                               tokenizer.pad_token_id)
    made = [Episode(task=task, prompt_ids=c, ids=list(g.tokens), mask=[1] * len(g.tokens),
                    logprobs=list(g.logprobs))
            for c, g in zip(contexts, generations, strict=True)]
    reply = tokenizer.encode(" ok")  # an environment reply after an action: not trained
    made[1].ids += reply
    made[1].mask += [0] * len(reply)
    batch = batch_kind(made, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer_logp = batch.logprobs(model, 0.7)[0]
    sampled = sampler_logprobs([e.logprobs for e in made], batch.mask)
    weights, stats = importance_weights(trainer_logp, sampled, batch.mask, 2.0)
    trained = batch.mask > 0
    assert int(trained.sum()) == sum(len(e.logprobs) for e in made)
    assert weights[trained].tolist() == pytest.approx([1.0] * int(trained.sum()), abs=1e-4)
    assert abs(stats["rollout_kl"]) < 1e-5


def test_int8_rollouts_train_with_the_correction_and_evaluate_in_float32(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(rollout, "PACK_MIN_WEIGHTS", 0)  # the tiny model's layers in int8 too
    monkeypatch.setattr(rollout, "INT8_MIN_WEIGHTS", 0)
    precisions: list[str] = []
    packing = rollout.prepacked

    def recorded(model, weights="float32"):
        precisions.append(weights)
        return packing(model, weights)

    monkeypatch.setattr(rollout, "prepacked", recorded)
    recipe = resolve({"rollout": {"quantization": "int8", "importance_cap": 2.0},
                      "grpo": {"steps": 2, "eval_every": 2}}, [])
    assert run_job(recipe, tmp_path / "out")["status"] == "ok"
    # Evaluation at steps 0 and 2 and the warm start's sampling before them in float32; the
    # training groups of steps 1 and 2 in int8.
    assert precisions.count("int8") == 2
    assert precisions[-4:] == ["float32", "int8", "int8", "float32"]
    rows = pq.read_table(tmp_path / "out" / "steps.parquet").to_pylist()
    metrics = {(r["step"], r["metric"]): r["value"] for r in rows}
    for step in (1, 2):
        assert 0 < metrics[(step, "rollout_is_mean")] <= 2.0
        assert 0 <= metrics[(step, "rollout_is_ratio_fraction_high")] <= 1
        assert metrics[(step, "rollout_kl")] != 0  # the int8 sampler is not the policy
    # Without the section nothing is weighted and no such metric is written.
    plain = tmp_path / "plain"
    assert run_job(resolve({"grpo": {"steps": 1}}, []), plain)["status"] == "ok"
    assert not any(r["metric"].startswith("rollout_")
                   for r in pq.read_table(plain / "steps.parquet").to_pylist())


@pytest.mark.parametrize(
    ("section", "field", "fix"),
    [
        ({"quantization": "int8"}, "rollout.importance_cap", "importance_cap: 2.0"),
        ({"quantization": "int8", "importance_cap": 2.0, "engine": "vllm"},
         "rollout.quantization", "engine: builtin"),
    ],
)
def test_an_unsound_rollout_section_is_refused_naming_its_field(section, field, fix,
                                                                  monkeypatch):
    monkeypatch.setattr("evotrainer.contract.rollout.find_spec", lambda name: object())
    with pytest.raises(EvoError) as refused:
        check_rollout(resolve({"rollout": section}, []))
    assert refused.value.field == field and fix in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_schema_refuses_a_cap_at_or_below_one_and_unknown_precisions():
    for section, field in (({"importance_cap": 1.0}, "rollout.importance_cap"),
                           ({"quantization": "int4"}, "rollout.quantization")):
        with pytest.raises(EvoError) as refused:
            Recipe.from_dict(resolve({"rollout": section}, []))
        assert refused.value.field == field
    Recipe.from_dict(resolve({"rollout": {"quantization": "int8", "importance_cap": 2}}, []))


def test_update_without_a_cap_is_the_unweighted_loss(monkeypatch):
    """`importance_cap` None leaves `policy_loss` unweighted: the runs before it train alike."""
    seen = []
    loss = grpo.policy_loss

    def spy(*args, **kwargs):
        seen.append(args[-1] if len(args) == 7 else kwargs.get("importance"))
        return loss(*args, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer)
    task = Task(task_id="t", prompt="", answer="", data_source="test")
    made = [Episode(task=task, prompt_ids=tokenizer.encode("def"), ids=[5, 6], mask=[1, 1],
                    logprobs=[-1.0, -2.0]) for _ in range(2)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = replace(LOSS, temperature=1.0, ppo_epochs=1, grad_clip=1.0)
    stats = grpo.update(model, None, optimizer, made, np.array([1.0, -1.0]), g,
                        tokenizer.pad_token_id)
    assert seen == [None] and "rollout_is_mean" not in stats
    stats = grpo.update(model, None, optimizer, made, np.array([1.0, -1.0]), g,
                        tokenizer.pad_token_id, importance_cap=2.0)
    assert seen[-1] is not None and "rollout_is_mean" in stats
