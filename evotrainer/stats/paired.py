"""Paired statistics over per-task score tables: Avg@k, pass@k, paired bootstrap over tasks
(stratified by data_source, seeds pooled hierarchically) and the Wilcoxon signed-rank test,
under a GateProcedure's settings (evotrainer/stats/__init__.py).

The unit is the task: each task's score is its mean `correct` (over samples, then seeds).
Delta = B - A (candidate minus parent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from evotrainer.errors import EvoError
from evotrainer.evidence.io import first_bad_correct
from evotrainer.stats import CI_METHODS, GateProcedure

_CHUNK = 1000  # bootstrap replicates per vectorized batch (bounds memory)


@dataclass
class _Version:
    """One side's scores: per task, the per-seed means packed left (NaN padded)."""

    tasks: list[str]
    sources: dict[str, str]
    seed_means: np.ndarray  # (tasks, max seeds)
    n_seeds: np.ndarray  # (tasks,)
    counts: dict[str, list[tuple[int, int]]]  # task -> [(samples, correct samples)] per seed
    seeds: int

    @property
    def task_means(self) -> np.ndarray:
        return np.nanmean(self.seed_means, axis=1)


def _version(table: pa.Table, label: str) -> _Version:
    missing = [
        c for c in ("seed", "task_id", "data_source", "correct") if c not in table.column_names
    ]
    if missing:
        raise EvoError(f"score table {label} lacks column(s) {', '.join(missing)}")
    bad = first_bad_correct(table)
    if bad is not None:
        raise EvoError(
            f"score table {label}: correct = {bad[1]} (row {bad[0] + 1}) is not a score in "
            "[0, 1]",
            hint="each sample's correctness is a number from 0 to 1, or null when unscored",
        )
    table = table.filter(pc.is_valid(table.column("correct")))
    if table.num_rows == 0:
        raise EvoError(f"score table {label} has no scored rows")
    hit = pc.cast(pc.greater_equal(table.column("correct"), 0.5), pa.int64())
    table = table.append_column("hit", hit)
    per_seed = (
        table.group_by(["task_id", "seed"])
        .aggregate(
            [("correct", "mean"), ("correct", "count"), ("hit", "sum"), ("data_source", "min")]
        )
        .sort_by([("task_id", "ascending"), ("seed", "ascending")])
    )
    task = per_seed.column("task_id").to_pylist()
    mean = per_seed.column("correct_mean").to_numpy()
    count = per_seed.column("correct_count").to_numpy()
    hits = per_seed.column("hit_sum").to_numpy()
    source = per_seed.column("data_source_min").to_pylist()
    tasks = list(dict.fromkeys(task))
    row_of = {t: i for i, t in enumerate(tasks)}
    n_seeds = np.bincount([row_of[t] for t in task], minlength=len(tasks))
    seed_means = np.full((len(tasks), int(n_seeds.max())), np.nan)
    counts: dict[str, list[tuple[int, int]]] = {t: [] for t in tasks}
    sources: dict[str, str] = {}
    for t, m, n, c, s in zip(task, mean, count, hits, source, strict=True):
        seed_means[row_of[t], len(counts[t])] = m
        counts[t].append((int(n), int(c)))
        sources.setdefault(t, s)
    seeds = len(set(per_seed.column("seed").to_pylist()))
    return _Version(tasks, sources, seed_means, n_seeds, counts, seeds)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (HumanEval): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _pass_mean(version: _Version, tasks: list[str], k: int) -> float:
    per_task = [np.mean([pass_at_k(n, c, k) for n, c in version.counts[t]]) for t in tasks]
    return float(np.mean(per_task))


def _replicates(
    rng: np.random.Generator, rows: np.ndarray, side: _Version, tasks: np.ndarray
) -> np.ndarray:
    """Per-task replicate means: the seeds of each drawn task resampled with replacement."""
    if side.seed_means.shape[1] == 1:
        return side.seed_means[tasks, 0]
    n = side.n_seeds[tasks]  # (b, m)
    width = side.seed_means.shape[1]
    pick = np.floor(rng.random((*tasks.shape, width)) * n[..., None]).astype(np.intp)
    values = side.seed_means[tasks[..., None], pick]
    valid = np.arange(width) < n[..., None]
    return np.where(valid, values, 0.0).sum(axis=2) / n


def import_tests() -> None:
    """Import the library the comparisons test with (scipy.stats; 0.6 s) now: a process
    about to fork children that compare lets them find it imported."""
    from scipy import stats  # noqa: F401


def _wilcoxon(diff: np.ndarray) -> tuple[float, float]:
    if not np.any(diff != 0):
        return 0.0, 1.0
    from scipy import stats as sps  # imported here: it costs 0.6 s of every CLI start

    result = sps.wilcoxon(diff, zero_method="wilcox")
    return float(result.statistic), float(result.pvalue)


def _bca_levels(
    reps: np.ndarray, point: float, jackknife: np.ndarray, alpha: float
) -> tuple[float, float]:
    """The BCa quantile levels for a two-sided 1 - alpha interval: bias correction z0 from
    the share of replicates below the estimate, acceleration from the jackknife skewness.
    Degenerate replicates (all on one side, or no jackknife spread) keep the percentile
    levels: there is nothing to correct."""
    normal = NormalDist()
    below = (np.count_nonzero(reps < point) + 0.5 * np.count_nonzero(reps == point)) / len(reps)
    if not 0.0 < below < 1.0:
        return alpha / 2, 1 - alpha / 2
    z0 = normal.inv_cdf(below)
    spread = jackknife.mean() - jackknife
    denominator = 6.0 * float(np.sum(spread**2)) ** 1.5
    acceleration = float(np.sum(spread**3)) / denominator if denominator > 0 else 0.0
    levels = []
    for tail in (alpha / 2, 1 - alpha / 2):
        z = z0 + normal.inv_cdf(tail)
        levels.append(normal.cdf(z0 + z / (1 - acceleration * z)))
    return levels[0], levels[1]


def _jackknife(diff: np.ndarray) -> np.ndarray:
    """Leave-one-task-out means of the per-task differences (the point estimate's jackknife)."""
    if len(diff) < 2:
        return np.zeros(len(diff))
    return (diff.sum() - diff) / (len(diff) - 1)


def _interval(
    reps: np.ndarray, point: float, alpha: float, jackknife: np.ndarray | None = None
) -> dict[str, float]:
    levels = (alpha / 2, 1 - alpha / 2) if jackknife is None else _bca_levels(
        reps, point, jackknife, alpha)
    low, high = np.quantile(reps, levels)
    # Two-sided p under the shifted null: how often a replicate strays from the estimate by
    # at least the estimate's distance from zero.
    extreme = np.count_nonzero(np.abs(reps - point) >= abs(point) - 1e-12)
    return {
        "ci_low": float(low),
        "ci_high": float(high),
        "p_bootstrap": float((extreme + 1) / (len(reps) + 1)),
    }


def compare_tables(
    a: pa.Table,
    b: pa.Table,
    *,
    B: int = GateProcedure.resamples,
    seed: int = 0,
    alpha: float = GateProcedure.alpha,
    ci_method: str = GateProcedure.ci_method,
    stratified: bool = True,
) -> dict:
    """Compare per-task score tables A (parent) and B (candidate) over their common tasks.
    `ci_method` percentile (default) or bca; `stratified` False pools every data_source into
    one stratum (the bootstrap then resamples tasks across sources)."""
    if ci_method not in CI_METHODS:
        raise EvoError(f"unknown CI method {ci_method!r}", hint=f"one of {', '.join(CI_METHODS)}")
    if B < 1:
        raise EvoError(f"the number of bootstrap resamples must be >= 1, not {B}")
    va, vb = _version(a, "A"), _version(b, "B")
    common = sorted(set(va.tasks) & set(vb.tasks))
    if not common:
        raise EvoError(
            "the two score tables share no task_id", hint="compare runs on the same validation set"
        )
    row_a = {t: i for i, t in enumerate(va.tasks)}
    row_b = {t: i for i, t in enumerate(vb.tasks)}
    ia = np.array([row_a[t] for t in common])
    ib = np.array([row_b[t] for t in common])
    mean_a, mean_b = va.task_means[ia], vb.task_means[ib]
    diff = mean_b - mean_a
    sources = np.array([va.sources[t] for t in common] if stratified else ["all"] * len(common))
    strata = sorted(set(sources))
    members = [np.flatnonzero(sources == s) for s in strata]
    weights = np.array([len(m) / len(common) for m in members])

    rng = np.random.default_rng(seed)
    stratum_reps = np.empty((len(strata), B))
    for start in range(0, B, _CHUNK):
        b = min(_CHUNK, B - start)
        for j, rows in enumerate(members):
            drawn = rows[rng.integers(0, len(rows), (b, len(rows)))]
            delta = _replicates(rng, drawn, vb, ib[drawn]) - _replicates(rng, drawn, va, ia[drawn])
            stratum_reps[j, start : start + b] = delta.mean(axis=1)
    overall_reps = weights @ stratum_reps
    delta = float(diff.mean())
    statistic, p_wilcoxon = _wilcoxon(diff)
    bca = ci_method == "bca"

    rows = []
    for j, (name, idx) in enumerate(zip(strata, members, strict=True)):
        d = float(diff[idx].mean())
        _, p_w = _wilcoxon(diff[idx])
        rows.append(
            {
                "data_source": str(name),
                "n_tasks": int(len(idx)),
                "weight": float(weights[j]),
                "mean_a": float(mean_a[idx].mean()),
                "mean_b": float(mean_b[idx].mean()),
                "delta": d,
                **_interval(stratum_reps[j], d, alpha, _jackknife(diff[idx]) if bca else None),
                "p_wilcoxon": p_w,
            }
        )
    k_max = min(n for v in (va, vb) for t in common for n, _ in v.counts[t])
    pass_rows = [
        {"k": k, "a": _pass_mean(va, common, k), "b": _pass_mean(vb, common, k)}
        for k in sorted({1, k_max})
    ]
    for row in pass_rows:
        row["delta"] = row["b"] - row["a"]
    # Only what differs from the default procedure is added: a default comparison is
    # recorded exactly as before.
    procedure: dict[str, Any] = {}
    if bca:
        procedure["ci_method"] = "bca"
    if not stratified:
        procedure["stratified"] = False
    return {
        "n_tasks": len(common),
        "n_only_a": len(va.tasks) - len(common),
        "n_only_b": len(vb.tasks) - len(common),
        "n_seeds_a": va.seeds,
        "n_seeds_b": vb.seeds,
        "samples_per_task": int(k_max),
        "mean_a": float(mean_a.mean()),
        "mean_b": float(mean_b.mean()),
        "delta": delta,
        **_interval(overall_reps, delta, alpha, _jackknife(diff) if bca else None),
        "confidence": 1 - alpha,
        "p_wilcoxon": p_wilcoxon,
        "wilcoxon_statistic": statistic,
        "resamples": B,
        "bootstrap_seed": seed,
        "pass_at_k": pass_rows,
        "strata": rows,
        **procedure,
    }
