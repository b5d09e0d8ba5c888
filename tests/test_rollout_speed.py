"""The built-in engine's speed-ups keep its numbers: prepacked weights sample the same distribution
and leave the tiny models' kernels alone; scoring beside the sampler gives exactly the serial
scores and starts before the batch is done; the step is split into sampling, scoring and
training; `threads: auto` follows the machine's cores and load."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from real_checkpoint import chat_tokenizer, tiny_llama
from test_engine import read_rows
from test_real_model import PROBLEMS
from transformers import LlamaConfig, LlamaForCausalLM

from evotrainer.backends.base import JobSpec
from evotrainer.backends.local import LocalBackend
from evotrainer.contract.typed import Recipe
from evotrainer.domains import make_domain
from evotrainer.engine import decode_kernels, engine_threads, run_job
from evotrainer.engine.model import build_tiny, char_tokenizer
from evotrainer.engine.rollout import PACK_MIN_WEIGHTS, prepacked, sample_episodes
from evotrainer.engine.scoring import Scoring
from evotrainer.store.recipe import BASE_RECIPE, resolve

torch.set_num_threads(1)


def wide_llama(tokenizer) -> LlamaForCausalLM:
    """Layers above PACK_MIN_WEIGHTS (the MLP: 640 x 512), as a real model's are."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=640,
                         num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_prepacked_layers_compute_the_same_logits_and_are_restored_on_exit():
    tokenizer = chat_tokenizer()
    model = wide_llama(tokenizer)
    ids = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b")] * 3)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with prepacked(model) as packed:
            fast = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    large = [m for m in model.modules()
             if type(m) is torch.nn.Linear and m.weight.numel() >= PACK_MIN_WEIGHTS]
    assert packed == len(large) == 7  # q, k, v, o, gate, up, down; the 400-row lm_head is small
    assert torch.allclose(fast, plain, atol=1e-4) and not torch.equal(fast, plain)
    assert torch.equal(again, plain)  # the class's own forward again
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_siblings_share_one_product_and_never_reuse_a_stale_output():
    """q/k/v and gate/up run as one packed product each; a sibling takes its part of the
    product its input already went through, never one made before that input changed."""
    model = wide_llama(chat_tokenizer())
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(3, 512)
    with torch.no_grad():
        want = {name: getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")}
        want_up = mlp.up_proj(x)
        with prepacked(model):
            assert attention.k_proj.forward.product[0] == decode_kernels.JOINED
            got = {name: getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")}
            alone = mlp.up_proj(x)  # no gate call before it: the product runs for it
            x.add_(1.0)  # the same tensor, changed in place after the query's product
            changed = attention.k_proj(x)
            attention.q_proj(torch.randn(3, 512))
            other_input = torch.randn(3, 512)  # another tensor, at the same version
            other = attention.v_proj(other_input)
    for name, value in want.items():
        assert torch.allclose(got[name], value, atol=1e-4)
    assert torch.allclose(alone, want_up, atol=1e-4)
    with torch.no_grad():
        assert torch.allclose(changed, attention.k_proj(x), atol=1e-4)
        assert torch.allclose(other, attention.v_proj(other_input), atol=1e-4)


def test_the_tiny_models_have_no_layer_large_enough_to_pack():
    """Their seeded runs (and the figures pinned on them) sample what they always did."""
    tokenizer = char_tokenizer()
    tiny = build_tiny(BASE_RECIPE["model"]["tiny"], tokenizer, 0)
    with prepacked(tiny) as packed:
        assert packed == 0
    with prepacked(tiny_llama(chat_tokenizer())) as packed:
        assert packed == 0


def humaneval(tmp_path):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return {"name": "humaneval", "data": {"train": str(data)}}


def test_workers_score_exactly_as_the_engine_does_and_start_while_the_batch_samples(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer).eval()
    with torch.no_grad():  # end-of-turn likely: rows stop at different lengths
        model.lm_head.weight[tokenizer.eos_token_id] *= 0
        model.model.norm.weight.fill_(1.0)
    section = humaneval(tmp_path)
    domain = make_domain(section)
    tasks = [domain.task_at(i) for i in range(3) for _ in range(3)]
    calls = {"forward": 0}
    model.register_forward_pre_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))
    weights = {"correctness": 1.0, "pass_fraction": 0.5}
    pool = Scoring(domain, section, weights, workers=2)
    finished_at: list[int] = []

    def finished(index, episode):
        finished_at.append(calls["forward"])
        pool.submit(index, episode)

    try:
        torch.manual_seed(0)
        episodes = sample_episodes(model, tokenizer, domain, tasks, None, 30, 1.0, 1.0, True,
                                   on_finished=finished)
        # Episodes reached the scorers before the sampler's last forward pass.
        assert len(finished_at) == len(episodes) and min(finished_at) < calls["forward"]
        assert {e.finish_reason for e in episodes} == {"stop", "length"}
        in_workers = pool.collect(episodes)
    finally:
        pool.close()
    serial = Scoring(domain, section, weights, workers=0).collect(episodes)
    assert in_workers[0].tolist() == serial[0].tolist()
    assert [s.components for s in in_workers[1]] == [s.components for s in serial[1]]
    assert [s.correct for s in in_workers[1]] == [s.correct for s in serial[1]]


def arith_recipe(**extra) -> dict:
    return resolve(
        {
            "model": {"warm_start": {"steps": 5}},
            "domain": {"name": "arith", "train_size": 16, "val_size": 4},
            "grpo": {"steps": 2, "group_size": 4, "prompts_per_step": 2, "eval_every": 2,
                     "eval_k": 2, "max_response_tokens": 4},
            "seeds": [0],
            **extra,
        },
        [],
    )


def test_a_run_scored_by_workers_records_the_serial_run_and_splits_its_steps(tmp_path):
    serial = tmp_path / "serial"
    beside = tmp_path / "beside"
    run_job(arith_recipe(), serial)
    run_job(arith_recipe(rollout={"score_workers": 1}), beside)
    for split in ("train", "val"):
        assert read_rows(serial / "rollouts" / f"{split}.parquet") == read_rows(
            beside / "rollouts" / f"{split}.parquet")
    rows = read_rows(beside / "steps.parquet")
    per_step: dict[int, dict[str, float]] = {}
    for row in rows:
        per_step.setdefault(row["step"], {})[row["metric"]] = row["value"]
    for step in (1, 2):
        split = per_step[step]
        assert min(split["sampling_s"], split["scoring_s"], split["training_s"]) >= 0
        assert split["sampling_s"] + split["scoring_s"] + split["training_s"] == pytest.approx(
            split["time_per_step"])


def test_threads_null_follows_the_cores_and_the_load(monkeypatch, tmp_path):
    assert engine_threads(3) == 3  # the recipe's number wins
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    monkeypatch.setattr("os.getloadavg", lambda: (0.2, 0.0, 0.0))
    assert engine_threads("auto") == 4
    monkeypatch.setattr("os.getloadavg", lambda: (2.6, 0.0, 0.0))
    assert engine_threads("auto") == 1
    monkeypatch.setattr("os.getloadavg", lambda: (11.0, 0.0, 0.0))  # loaded: never below one
    assert engine_threads("auto") == 1
    # The typed recipe and a local job's environment follow it; absent (an override's null)
    # keeps its old meaning, one thread.
    monkeypatch.setattr("os.getloadavg", lambda: (1.2, 0.0, 0.0))
    recipe = {**copy.deepcopy(BASE_RECIPE), "threads": "auto"}
    assert Recipe.from_dict(recipe).threads == "auto"
    job = JobSpec("evo-v1-a1-0123456789", "v1", recipe, tmp_path, tmp_path / "out")
    assert LocalBackend().environment(job)["OMP_NUM_THREADS"] == "3"
    del recipe["threads"]
    assert Recipe.from_dict(recipe).threads == 1 and engine_threads(None) == 1
