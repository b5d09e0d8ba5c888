"""bench/real_model.py at its smallest size, on a tiny random Llama built here (no download):
the bound, every engine that imports here against the baseline (the engine without its speed-ups),
and GRPO steps split into sampling, scoring and training against the baseline, all from one
run; the baseline really is the old engine, and the engine is itself again afterwards."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from real_checkpoint import chat_tokenizer, save_hf, tiny_llama
from test_real_model import PROBLEMS

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("real_model_bench", ROOT / "bench/real_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_bench_reports_engines_the_bound_and_the_step_split(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the dataset lies inside the job's working directory
    monkeypatch.setenv("EVOTRAINER_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    bench = load_bench()
    report = bench.main([
        "--parts", "bound,sampling,steps",
        "--engines", "baseline,prepacked,builtin,int8,generate",
        "--rounds", "1", "--prompts", "1", "--group", "2", "--tokens", "4", "--train", "4",
        "--val", "2", "--steps", "1", "--model-path", str(save_hf(tmp_path / "model")),
        "--data", str(data), "--out", str(tmp_path / "out"),
    ])
    bound = report["bound"]
    assert bound["bound_tokens_per_s"] > 0 and bound["bound_by"] in ("memory", "compute")
    sampling = report["sampling"]
    for engine in ("baseline", "prepacked", "builtin", "int8", "generate"):
        assert sampling[engine]["tokens_per_s"] > 0 and sampling[engine]["of_bound"] > 0
    # The int8 sampler's distance from the float32 policy, as the loss's correction logs it.
    assert {"rollout_kl", "rollout_is_mean"} <= set(sampling["int8"])
    assert sampling["int8"]["exact_kl"] >= -1e-6  # a KL: zero where no layer is int8
    assert sampling["baseline"]["vs_baseline"] == 1.0
    # The built-in sampler's decode, its prefill timed apart, against the same bound.
    builtin = sampling["builtin"]
    assert builtin["decode_tokens_per_s"] > 0
    assert builtin["decode_of_bound"] == pytest.approx(
        builtin["decode_tokens_per_s"] / bound["bound_tokens_per_s"])
    steps = report["steps"]
    assert set(steps) >= {"baseline", "builtin", "int8"} and steps["baseline"]["speedup"] == 1.0
    assert "rollout_kl" in steps["int8"] and "rollout_kl" not in steps["builtin"]
    for split in steps.values():
        assert split["sampling_s"] + split["scoring_s"] + split["training_s"] == pytest.approx(
            split["time_per_step"])
    assert json.loads((tmp_path / "out" / "real_model.json").read_text())["steps"]


def test_the_baseline_is_the_engine_without_its_fast_paths_and_only_inside(monkeypatch):
    bench = load_bench()
    from transformers.cache_utils import DynamicLayer

    from evotrainer.engine import group_decode, grpo, rollout

    calls: dict[str, object] = {}
    real_multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: calls.setdefault(
        "multinomial", real_multinomial(*a, **k)))
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer).eval()
    contexts = [tokenizer.encode("def add")] * 2
    caches = []
    # A vocabulary above the threshold: the engine as it is draws there without multinomial.
    monkeypatch.setattr(rollout, "DRAW_MIN_VOCABULARY", len(tokenizer) - 1)
    # A model above the threshold: the engine as it is decodes this group over one prompt.
    monkeypatch.setattr(group_decode, "MIN_WEIGHTS", 0)
    before = (rollout.decode_cache, rollout.DRAW_MIN_VOCABULARY, rollout.PACK_MIN_WEIGHTS,
              group_decode.MIN_WEIGHTS)
    with bench.without_fast_paths():
        assert grpo.SHARE_PROMPT_FORWARD is False and math.isinf(rollout.PACK_MIN_WEIGHTS)
        old_cache = rollout.decode_cache  # recorded by hand: the context restores its own
        rollout.decode_cache = lambda capacity: caches.append(old_cache(capacity)) or caches[-1]
        try:
            torch.manual_seed(0)
            rollout.generate(model, contexts, [tokenizer.eos_token_id], 3, 1.0, 1.0,
                             tokenizer.pad_token_id)
        finally:
            rollout.decode_cache = old_cache
    assert "multinomial" in calls
    # The padded decode (the group decode makes no such cache), grown by torch.cat.
    assert all(type(layer) is DynamicLayer for layer in caches[0].layers)
    assert (rollout.decode_cache, rollout.DRAW_MIN_VOCABULARY, rollout.PACK_MIN_WEIGHTS,
            group_decode.MIN_WEIGHTS) == before
    assert grpo.SHARE_PROMPT_FORWARD is True
