"""bench/ifeval.py at its smallest size, on a tiny random Llama built here (no download) and a
two-row IFBench file: base and trained evaluated on both held-out sets, paired-bootstrap CIs
over prompts, step times, the per-family table of the training groups and the h0 diagnosis,
all in one report; TRL reported as missing when no interpreter with it is given."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("if_verifiable", reason="needs if-verifiable (the dev extra)")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parent.parent

IFBENCH = [
    {"key": "7", "prompt": "Describe rain in a few words.",
     "instruction_id_list": ["count:word_count_range"],
     "kwargs": [{"min_words": 1, "max_words": 50}]},
    {"key": "8", "prompt": "Describe snow in a few words.",
     "instruction_id_list": ["count:word_count_range"],
     "kwargs": [{"min_words": 1, "max_words": 50}]},
]


def load_bench():
    spec = importlib.util.spec_from_file_location("ifeval_bench", ROOT / "bench/ifeval.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_bench_compares_base_and_trained_on_both_held_out_sets(tmp_path, monkeypatch):
    from real_checkpoint import save_hf

    monkeypatch.chdir(tmp_path)  # the model lies inside the job's working directory
    monkeypatch.setenv("EVOTRAINER_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "IFBench_test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in IFBENCH))
    bench = load_bench()
    report = bench.main(["--smoke", "--model-path", str(save_hf(tmp_path / "model")),
                         "--ifbench-data", str(data), "--out", str(tmp_path / "out")])
    assert report["eval_sets"]["heldout"] == 2 and report["eval_sets"]["ifbench"] == 2
    assert report["trl"].startswith("missing")
    for name in ("heldout", "ifbench"):
        base = report["base"][name]
        assert 0 <= base["prompt_strict"] <= base["instruction_strict"] <= 1
        for level in ("prompt", "instruction"):
            ci = report["comparisons"][f"{name}/{level}/ours@2_vs_base"]
            assert ci["n_tasks"] == 2 and ci["ci_low"] <= ci["delta"] <= ci["ci_high"]
    # Evaluated every step (smoke: eval_every 1), with the step 0 point on the curve.
    assert set(report["evals"]["ours"]) == {1, 2}
    assert set(report["curves"]["ours"]) == {0, 1, 2}
    assert len(report["step_s"]["ours"]["all"]) == 2
    families = report["families"]
    assert families and all(f["data_source"].startswith("ifeval/") for f in families)
    assert all(0 <= f["all_wrong"] + f["all_correct"] <= 1 for f in families)
    # The tiny model's 4-token answers are all cut off: h0 says so.
    assert report["diagnosis_h0"]["metrics"]["truncation_rate"] == 1.0
    assert "truncation" in {a["name"] for a in report["diagnosis_h0"]["alerts"]}
    saved = json.loads((tmp_path / "out" / "ifeval.json").read_text())
    assert saved["comparisons"].keys() == report["comparisons"].keys()


@pytest.mark.slow
def test_the_evolve_part_compares_main_s_frontier_with_the_default_run(tmp_path, monkeypatch):
    """`evolve` on the quick example (its model the tiny one), then the example's recipe as is
    for the loop's total steps: main's frontier against it, on held-out prompts the gate's
    validation never showed."""
    from real_checkpoint import save_hf

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EVOTRAINER_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "IFBench_test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in IFBENCH))
    bench = load_bench()
    report = bench.main(["--smoke", "--parts", "evolve", "--plot", str(tmp_path / "c.svg"),
                         "--model-path", str(save_hf(tmp_path / "model")),
                         "--ifbench-data", str(data), "--out", str(tmp_path / "out")])
    evolve = report["evolve"]
    assert evolve["total_steps"] == sum(row["steps"] for row in evolve["lineage"]) >= 1
    assert evolve["frontier"] in {row["name"] for row in evolve["lineage"] if row["on_main"]}
    assert set(evolve["default_curve"]) == set(range(1, evolve["total_steps"] + 1))
    assert evolve["eval_sets"]["heldout"] == 2 and evolve["eval_sets"]["ifbench"] == 2
    for name in ("heldout", "ifbench"):
        ci = evolve["comparisons"][f"{name}/prompt/evolve_vs_default"]
        assert ci["n_tasks"] == 2 and ci["ci_low"] <= ci["delta"] <= ci["ci_high"]
    assert evolve["plot"] in (str(tmp_path / "c.svg"), "skipped: matplotlib is not installed")
