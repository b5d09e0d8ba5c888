"""Paired statistics, cross-checked with scipy and with slow reference loops."""

import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
import typer
from scipy import stats as sps
from typer.testing import CliRunner

from evotrainer.commands import compare as compare_cmd
from evotrainer.errors import EvoError
from evotrainer.evidence.io import read_scores
from evotrainer.stats.paired import compare_tables, pass_at_k


def _scores(p, *, seeds=1, k=4, rng, sources=None):
    rows = {"seed": [], "task_id": [], "data_source": [], "sample_idx": [], "correct": []}
    for s in range(seeds):
        for t, prob in enumerate(p):
            for i in range(k):
                rows["seed"].append(s)
                rows["task_id"].append(f"t{t}")
                rows["data_source"].append(sources[t] if sources else "all")
                rows["sample_idx"].append(i)
                rows["correct"].append(float(rng.random() < prob))
    return pa.table(rows)


def _task_means(table):
    per = {}
    for row in table.to_pylist():
        per.setdefault(row["task_id"], {}).setdefault(row["seed"], []).append(row["correct"])
    return {t: [float(np.mean(v)) for _, v in sorted(seeds.items())] for t, seeds in per.items()}


def test_pass_at_k_matches_enumeration():
    for n, c, k in [(8, 3, 1), (8, 3, 4), (5, 0, 2), (5, 5, 5), (6, 2, 6)]:
        draws = list(itertools.combinations([1] * c + [0] * (n - c), k))
        assert pass_at_k(n, c, k) == pytest.approx(np.mean([any(d) for d in draws]))


def test_single_seed_ci_agrees_with_scipy_bootstrap():
    rng = np.random.default_rng(3)
    p = rng.random(60)
    a, b = _scores(p, rng=rng), _scores(np.clip(p + 0.1, 0, 1), rng=rng)
    result = compare_tables(a, b, B=10_000, seed=1)
    ma, mb = _task_means(a), _task_means(b)
    diff = np.array([mb[t][0] - ma[t][0] for t in sorted(ma)])
    ref = sps.bootstrap(
        (diff,),
        np.mean,
        n_resamples=10_000,
        method="percentile",
        random_state=np.random.default_rng(5),
    ).confidence_interval
    assert result["delta"] == pytest.approx(diff.mean())
    assert result["ci_low"] == pytest.approx(ref.low, abs=0.01)
    assert result["ci_high"] == pytest.approx(ref.high, abs=0.01)
    w = sps.wilcoxon(diff)
    assert result["p_wilcoxon"] == pytest.approx(w.pvalue)
    assert result["pass_at_k"][0] == {
        "k": 1,
        "a": pytest.approx(result["mean_a"]),
        "b": pytest.approx(result["mean_b"]),
        "delta": pytest.approx(result["delta"]),
    }
    assert result["pass_at_k"][1]["k"] == 4


def _reference(a, b, sources, B, seed):
    """Stratified, hierarchical paired bootstrap as a plain loop."""
    ma, mb = _task_means(a), _task_means(b)
    rng = np.random.default_rng(seed)
    tasks = sorted(ma)
    strata = {s: [t for t in tasks if sources[t] == s] for s in set(sources.values())}
    reps = []
    for _ in range(B):
        total = 0.0
        for members in strata.values():
            acc = 0.0
            for _ in members:
                t = members[rng.integers(len(members))]
                sa = [ma[t][rng.integers(len(ma[t]))] for _ in ma[t]]
                sb = [mb[t][rng.integers(len(mb[t]))] for _ in mb[t]]
                acc += np.mean(sb) - np.mean(sa)
            total += acc / len(tasks)
        reps.append(total)
    return np.quantile(reps, [0.025, 0.975])


def test_stratified_multi_seed_matches_a_slow_reference_loop():
    rng = np.random.default_rng(7)
    p = rng.random(24)
    sources = {f"t{i}": "easy" if i < 8 else "hard" for i in range(24)}
    src = [sources[f"t{i}"] for i in range(24)]
    a = _scores(p, seeds=3, rng=rng, sources=src)
    b = _scores(np.clip(p + 0.08, 0, 1), seeds=3, rng=rng, sources=src)
    result = compare_tables(a, b, B=4000, seed=2)
    low, high = _reference(a, b, sources, 2000, 9)
    assert result["ci_low"] == pytest.approx(low, abs=0.015)
    assert result["ci_high"] == pytest.approx(high, abs=0.015)
    assert result["n_seeds_a"] == 3 and result["n_tasks"] == 24
    strata = {row["data_source"]: row for row in result["strata"]}
    assert strata["easy"]["n_tasks"] == 8 and strata["easy"]["weight"] == pytest.approx(1 / 3)
    weighted = sum(row["weight"] * row["delta"] for row in result["strata"])
    assert weighted == pytest.approx(result["delta"])


def test_identical_tables_are_clean_zero():
    rng = np.random.default_rng(0)
    a = _scores(rng.random(10), rng=rng)
    result = compare_tables(a, a, B=500)
    assert result["delta"] == 0.0 and result["ci_low"] == 0.0 and result["ci_high"] == 0.0
    assert result["p_wilcoxon"] == 1.0 and result["p_bootstrap"] == 1.0


def test_result_is_plain_seeded_and_deterministic():
    rng = np.random.default_rng(1)
    a, b = _scores(rng.random(15), rng=rng), _scores(rng.random(15), rng=rng)
    first = compare_tables(a, b, B=1000, seed=4)
    assert first == compare_tables(a, b, B=1000, seed=4)
    assert first != compare_tables(a, b, B=1000, seed=5)
    assert json.loads(json.dumps(first)) == first


def test_disjoint_tasks_and_missing_columns_are_errors(tmp_path):
    rng = np.random.default_rng(1)
    a = _scores([0.5], rng=rng)
    b = a.set_column(1, "task_id", pa.array(["other"] * a.num_rows))
    with pytest.raises(EvoError, match="share no task_id"):
        compare_tables(a, b)
    bad = tmp_path / "s.csv"
    bad.write_text("seed,task_id,correct\n0,t,1\n")
    with pytest.raises(EvoError, match="missing column"):
        read_scores(bad)


def test_compare_cli_reads_csv_and_run_folders(tmp_path):
    rng = np.random.default_rng(2)
    p = rng.random(20)
    (tmp_path / "run").mkdir()
    pacsv.write_csv(_scores(p, rng=rng), tmp_path / "a.csv")
    pacsv.write_csv(_scores(np.clip(p + 0.3, 0, 1), rng=rng), tmp_path / "run" / "scores.csv")
    app = typer.Typer()
    app.callback()(lambda: None)
    compare_cmd.register(app)
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "compare",
            str(tmp_path / "a.csv"),
            str(tmp_path / "run"),
            "--json",
            "--resamples",
            "2000",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["delta"] > 0
    table = runner.invoke(app, ["compare", str(tmp_path / "a.csv"), str(tmp_path / "run")])
    assert table.exit_code == 0 and "pass@4" in table.output


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1.5", "-0.1"])
def test_a_correctness_outside_0_1_is_refused_with_its_line(tmp_path, cli, value):
    rng = np.random.default_rng(3)
    good = tmp_path / "a.csv"
    pacsv.write_csv(_scores([0.5, 0.7], rng=rng), good)
    lines = good.read_text().splitlines()
    lines[3] = lines[3].rsplit(",", 1)[0] + f",{value}"  # the third record, line 4
    bad = tmp_path / "b.csv"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(EvoError) as caught:
        read_scores(bad)
    assert caught.value.where == f"{bad}:4" and caught.value.field == "correct"
    shown = cli("compare", str(good), str(bad), "--json", "--resamples", "100")
    assert shown.code == 1 and "Traceback" not in shown.output
    assert f"{bad}:4" in shown.output and "not a score in [0, 1]" in shown.output
    assert "Infinity" not in shown.out and "NaN" not in shown.out


def test_tables_from_memory_are_checked_too():
    rng = np.random.default_rng(4)
    a = _scores([0.5], rng=rng)
    b = a.set_column(4, "correct", pa.array([1.0, float("inf"), 0.0, 1.0]))
    with pytest.raises(EvoError, match=r"score table B: correct = inf \(row 2\)"):
        compare_tables(a, b)


def test_compare_json_is_strict_json(tmp_path, cli):
    # Identical tables: every difference is zero, the edge where statistics go NaN.
    rng = np.random.default_rng(5)
    path = tmp_path / "a.csv"
    pacsv.write_csv(_scores([0.0, 1.0, 0.5], rng=rng), path)
    shown = cli("compare", str(path), str(path), "--json", "--resamples", "100")
    assert shown.code == 0, shown.output
    result = json.loads(shown.out, parse_constant=lambda name: pytest.fail(name))
    assert result["delta"] == 0.0
