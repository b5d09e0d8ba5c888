"""bench/real_model.py at its smallest size, on a tiny random Llama built here (no download):
the bound, every engine that imports here against the unpacked baseline, and GRPO steps split
into sampling, scoring and training against the baseline, all from one run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from real_checkpoint import save_hf
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
        "--parts", "bound,sampling,steps", "--engines", "unpacked,builtin,generate",
        "--rounds", "1", "--prompts", "1", "--group", "2", "--tokens", "4", "--train", "4",
        "--val", "2", "--steps", "1", "--model-path", str(save_hf(tmp_path / "model")),
        "--data", str(data), "--out", str(tmp_path / "out"),
    ])
    bound = report["bound"]
    assert bound["bound_tokens_per_s"] > 0 and bound["bound_by"] in ("memory", "compute")
    sampling = report["sampling"]
    for engine in ("unpacked", "builtin", "generate"):
        assert sampling[engine]["tokens_per_s"] > 0 and sampling[engine]["of_bound"] > 0
    assert sampling["unpacked"]["vs_unpacked"] == 1.0
    steps = report["steps"]
    assert set(steps) >= {"baseline", "builtin"} and steps["baseline"]["speedup"] == 1.0
    for split in steps.values():
        assert split["sampling_s"] + split["scoring_s"] + split["training_s"] == pytest.approx(
            split["time_per_step"])
    assert json.loads((tmp_path / "out" / "real_model.json").read_text())["steps"]
