"""`rollout.engine: vllm`. Without vLLM the recipe is refused in one line naming
the field and the install command. Where vLLM imports (a venv with `evotrainer[vllm]`): both
engines sample the same distribution (the trainer's log-probabilities of vLLM's samples are
vLLM's own; at temperature 0 vLLM picks the trainer model's greedy tokens), a seed decides
the draws, the policy reaches vLLM after an update (LoRA included), and GRPO runs end to end
on it, single- and multi-turn."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from real_checkpoint import chat_tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from evotrainer.contract.rollout import check_rollout, rollout_engine
from evotrainer.engine import run_job
from evotrainer.engine.rollout import batch_tensors, token_logprobs
from evotrainer.errors import EvoError
from evotrainer.store.recipe import resolve

torch.set_num_threads(1)


def test_without_vllm_the_engine_is_refused_in_one_line_naming_the_field(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("evotrainer.contract.rollout.find_spec", lambda name: None)
    recipe = resolve({"rollout": {"engine": "vllm"}}, [])
    with pytest.raises(EvoError) as refused:
        check_rollout(recipe)
    message = str(refused.value)
    assert refused.value.field == "rollout.engine" and "\n" not in message
    assert "pip install 'evotrainer[vllm]'" in message and "torchvision" in message
    with pytest.raises(EvoError, match="rollout.engine"):
        run_job(recipe, tmp_path / "out")
    # Absent, null or builtin: the built-in sampler, nothing to install.
    for section in (None, {}, {"engine": None}, {"engine": "builtin"}):
        check_rollout(resolve({"rollout": section}, []))
        assert rollout_engine(resolve({"rollout": section}, [])) == "builtin"
    assert "rollout" not in resolve({}, [])  # not in the base recipe: digests unchanged


def test_the_launcher_records_the_refusal_in_result_json(tmp_path):
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.skip("vLLM is installed here")
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(resolve({"rollout": {"engine": "vllm"}}, [])))
    done = subprocess.run([sys.executable, "-m", "evotrainer.engine", str(recipe),
                           str(tmp_path / "out"), "v1"], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "rollout.engine" in done.stderr
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["status"] == "failed" and "rollout.engine" in result["error"]


# ------------------------------------------------------------------ where vLLM is installed


def served_llama(tokenizer) -> LlamaForCausalLM:
    """A random Llama whose head size vLLM's CPU attention takes (64)."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


@pytest.fixture(scope="module")
def served():
    pytest.importorskip("vllm")
    from evotrainer.engine.vllm_rollout import VllmSampler

    tokenizer = chat_tokenizer()
    model = served_llama(tokenizer)
    sampler = VllmSampler(model, tokenizer, 0, log=lambda _: None)
    yield model, tokenizer, sampler
    sampler.close()


def test_the_engine_still_sets_its_threads_once_vllm_runs_in_process(served):
    """vLLM's CPU worker turns torch.set_num_threads into a no-op for the whole process."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(before + 1)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


def trainer_logprobs(model, contexts, generations, pad_id) -> list[list[float]]:
    rows = [c + g.tokens for c, g in zip(contexts, generations, strict=True)]
    ids, attn, positions, _ = batch_tensors(rows, [[1] * len(g.tokens) for g in generations],
                                            pad_id)
    tail = max(len(g.tokens) for g in generations)
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, attn, positions, tail)
    return [logp[i, tail - len(g.tokens):].tolist() for i, g in enumerate(generations)]


def sample(sampler, tokenizer, contexts, seed, temperature=1.0, tokens=16):
    torch.manual_seed(seed)
    return sampler(contexts, [tokenizer.eos_token_id], tokens, temperature, 1.0,
                   tokenizer.pad_token_id)


def test_the_trainer_scores_vllms_samples_as_vllm_does(served):
    model, tokenizer, sampler = served
    contexts = [tokenizer.encode("def add(a, b):")] * 3 + [tokenizer.encode("What is 3 + 4?")]
    gens = sample(sampler, tokenizer, contexts, seed=1)
    assert all(len(g.tokens) == len(g.logprobs) > 0 for g in gens)
    for ours, g in zip(trainer_logprobs(model, contexts, gens, tokenizer.pad_token_id), gens,
                       strict=True):
        assert ours == pytest.approx(g.logprobs, abs=1e-4)
    # A seed decides the draws (drawn from torch's generator, as the built-in sampler's).
    assert [g.tokens for g in sample(sampler, tokenizer, contexts, seed=1)] == [
        g.tokens for g in gens]
    assert [g.tokens for g in sample(sampler, tokenizer, contexts, seed=2)] != [
        g.tokens for g in gens]


def test_at_temperature_zero_vllm_picks_the_trainers_greedy_tokens(served):
    model, tokenizer, sampler = served
    context = tokenizer.encode("Complete the following Python function.")
    greedy = sample(sampler, tokenizer, [context], seed=0, temperature=0.0, tokens=12)[0]
    with torch.no_grad():
        ours = model.generate(torch.tensor([context]), do_sample=False, max_new_tokens=12,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)[0, len(context):].tolist()
    assert greedy.tokens == ours[: len(greedy.tokens)] and len(greedy.tokens) > 0


def test_an_update_reaches_vllm_lora_included(served):
    peft = pytest.importorskip("peft")
    model, tokenizer, sampler = served
    policy = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                        target_modules="all-linear"))
    with torch.no_grad():  # an adapter that has trained: B is no longer zero
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    contexts = [tokenizer.encode("def add(a, b):")] * 2
    sampler.load(policy)
    try:
        gens = sample(sampler, tokenizer, contexts, seed=3)
        with torch.no_grad():
            now = trainer_logprobs(policy, contexts, gens, tokenizer.pad_token_id)
            with policy.disable_adapter():
                before = trainer_logprobs(policy, contexts, gens, tokenizer.pad_token_id)
        for ours, old, g in zip(now, before, gens, strict=True):
            assert ours == pytest.approx(g.logprobs, abs=1e-4)
            assert old != pytest.approx(g.logprobs, abs=1e-2)
    finally:
        policy.unload()  # the fixture's model as it was, for the other tests
        sampler.load(model)


@pytest.mark.slow
@pytest.mark.parametrize("domain", ["arith", "toolenv"])
def test_grpo_runs_on_vllm_single_and_multi_turn(tmp_path, domain):
    pytest.importorskip("vllm")
    recipe = resolve(
        {
            "model": {"tiny": {"family": "llama", "hidden_size": 128, "intermediate_size": 256,
                               "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
                               "max_position_embeddings": 256},
                      "warm_start": {"steps": 20}},
            "domain": {"name": domain, "train_size": 16, "val_size": 4},
            "grpo": {"steps": 2, "group_size": 4, "prompts_per_step": 2, "eval_every": 2,
                     "eval_k": 2, "max_response_tokens": 8},
            "seeds": [0],
            "rollout": {"engine": "vllm"},
        },
        [],
    )
    result = run_job(recipe, tmp_path / "out")
    assert result["status"] == "ok"
    log = (tmp_path / "out" / "train.log").read_text()
    assert "vLLM engine started" in log
    train = pq.read_table(tmp_path / "out" / "rollouts" / "train.parquet").to_pylist()
    assert len(train) == 2 * 2 * 4 and all(r["response_tokens"] > 0 for r in train)
    if domain == "toolenv":
        assert max(r["turns"] for r in train) >= 1
