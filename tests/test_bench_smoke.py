"""Each bench/ script this file names, run at its smallest size: a bench that no longer runs
is caught here, never when someone needs its figures. Nothing here is timed."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ingest_bench_runs_every_flavour(capsys):
    """bench/ingest.py: the three dump flavours, one run each, a ratio printed per flavour."""
    ratios = bench("ingest").main(["--rows", "400", "--runs", "1", "--response-kb", "0.5"])
    assert set(ratios) == {"v1", "legacy", "legacy-val"}
    assert all(ratio > 0 for ratio in ratios.values())
    out = capsys.readouterr().out
    assert out.count("of the parse's speed") == 3


def test_harness_bench_runs_on_one_version(capsys, standin, monkeypatch):
    """bench/harness.py: one stand-in version of four recorded steps, the plain backtest,
    the early-stop replays both ways and `harness diff` cold and again, each timed once.
    (The `standin` fixture restores the backend and PYTHONPATH the bench sets for
    itself.)"""
    monkeypatch.setattr(sys, "path", list(sys.path))
    times = bench("harness").main(["--versions", "1", "--steps", "4", "--runs", "1"])
    assert set(times) == {"baseline", "cold", "warm", "cold_cpu", "warm_cpu", "replay_steps",
                          "replay_prefixes"}
    out = capsys.readouterr().out
    assert "of the plain backtest" in out and "from each run's prefixes" in out


def test_diagnose_bench_runs_at_a_small_size(capsys):
    """bench/diagnose.py: h0 against the per-record loop and the bare scan (their values
    must agree before it prints), and the incremental diagnosis."""
    bench("diagnose").main(["--rows", "20000"])
    out = capsys.readouterr().out
    assert "diagnosis / scan of the same source" in out and "incremental diagnosis" in out


def test_report_bench_runs_on_one_version(capsys, standin, monkeypatch):
    """bench/report.py: one stand-in version, the bare read and `evotrainer report` once each,
    the report's CPU printed as a multiple of the bare read's."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    times = bench("report").main(["--versions", "1", "--runs", "1"])
    assert set(times) == {"bare_cpu", "bare_wall", "report_cpu", "report_wall"}
    assert all(0 < value < math.inf for value in times.values())
    assert "the bare read's CPU" in capsys.readouterr().out


def test_lineage_bench_runs_on_a_short_chain_against_a_tree_before(capsys):
    """bench/lineage.py: a chain of 3 versions, each command once, the naive reader and the
    floor, one launch, and the cold commands against a tree before (this one), once each."""
    bench("lineage").main(["--sizes", "3", "--shapes", "chain", "--naive-up-to", "3",
                           "--before", str(BENCH.parent), "--runs", "1"])
    out = capsys.readouterr().out
    assert "naive/lineage" in out and "floor" in out
    assert out.count("CPU now/before") == 3
