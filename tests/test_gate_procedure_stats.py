"""The gate procedure's statistics (stats.GateProcedure): BCa intervals against scipy's,
unstratified pooling, family-wise p-value corrections against their textbook definitions,
and the default procedure recording exactly what it always did."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats as sps

from evotrainer.errors import EvoError
from evotrainer.stats import GateProcedure, adjust_p
from evotrainer.stats.paired import compare_tables


def _scores(p, *, rng, sources=None, k=4) -> pa.Table:
    rows = {"seed": [], "task_id": [], "data_source": [], "sample_idx": [], "correct": []}
    for t, prob in enumerate(p):
        for i in range(k):
            rows["seed"].append(0)
            rows["task_id"].append(f"t{t}")
            rows["data_source"].append(sources[t] if sources else "all")
            rows["sample_idx"].append(i)
            rows["correct"].append(float(rng.random() < prob))
    return pa.table(rows)


def _diff(a: pa.Table, b: pa.Table) -> np.ndarray:
    def means(table):
        out: dict[str, list[float]] = {}
        for row in table.to_pylist():
            out.setdefault(row["task_id"], []).append(row["correct"])
        return {t: float(np.mean(v)) for t, v in out.items()}

    ma, mb = means(a), means(b)
    return np.array([mb[t] - ma[t] for t in sorted(ma)])


def test_bca_interval_agrees_with_scipy_bca():
    """Right-skewed per-task gains (a few tasks gain much): BCa shifts the interval right of
    the percentile one, and matches scipy's BCa, not its percentile interval."""
    n = 25
    gains = np.clip(np.random.default_rng(2).lognormal(-3, 1.0, n), 0, 1)

    def table(values) -> pa.Table:
        return pa.table({"seed": [0] * n, "task_id": [f"t{i}" for i in range(n)],
                         "data_source": ["all"] * n, "sample_idx": [0] * n,
                         "correct": [float(v) for v in values]})

    a, b = table([0.0] * n), table(gains)
    bca = compare_tables(a, b, B=50_000, seed=2, ci_method="bca")
    percentile = compare_tables(a, b, B=50_000, seed=2)
    reference = sps.bootstrap((gains,), np.mean, n_resamples=50_000, method="BCa",
                              random_state=np.random.default_rng(9)).confidence_interval
    assert bca["ci_low"] == pytest.approx(reference.low, abs=0.001)
    assert bca["ci_high"] == pytest.approx(reference.high, abs=0.001)
    assert reference.high - percentile["ci_high"] > 0.005  # what BCa corrects
    assert bca["ci_method"] == "bca" and "ci_method" not in percentile
    # Same replicates, other quantile levels: the point estimate and the test are unchanged.
    assert bca["delta"] == percentile["delta"] and bca["p_bootstrap"] == percentile["p_bootstrap"]


def test_unstratified_pools_every_source_into_one_stratum():
    rng = np.random.default_rng(4)
    p = rng.random(40)
    sources = ["aime"] * 10 + ["cnmo"] * 30
    a = _scores(p, rng=rng, sources=sources)
    b = _scores(np.clip(p + 0.1, 0, 1), rng=rng, sources=sources)
    stratified = compare_tables(a, b, B=4000, seed=0)
    pooled = compare_tables(a, b, B=4000, seed=0, stratified=False)
    assert [s["data_source"] for s in stratified["strata"]] == ["aime", "cnmo"]
    assert [s["data_source"] for s in pooled["strata"]] == ["all"]
    assert pooled["stratified"] is False and "stratified" not in stratified
    assert pooled["delta"] == pytest.approx(stratified["delta"])
    # The pooled bootstrap is a plain resample of the 40 task differences.
    diff = _diff(a, b)
    reps = np.random.default_rng(0)
    manual = [diff[reps.integers(0, 40, 40)].mean() for _ in range(4000)]
    assert pooled["ci_low"] == pytest.approx(np.quantile(manual, 0.025), abs=0.01)


def test_default_procedure_records_exactly_the_old_comparison():
    rng = np.random.default_rng(5)
    p = rng.random(30)
    a, b = _scores(p, rng=rng), _scores(p, rng=rng)
    assert GateProcedure().compare(a, b) == compare_tables(a, b)
    assert GateProcedure.from_gate({"alpha": 0.05, "min_delta": 0.0, "rules": []}) == \
        GateProcedure()


def test_procedure_fields_are_read_from_the_gate_section():
    procedure = GateProcedure.from_gate({"alpha": 0.1, "ci_method": "bca", "resamples": 2000,
                                         "strata": "none", "compare_with": ["frontier", "root"],
                                         "correction": "bonferroni"})
    assert procedure == GateProcedure(alpha=0.1, ci_method="bca", resamples=2000,
                                      strata="none", compare_with=("parent", "frontier", "root"),
                                      correction="bonferroni")
    assert not procedure.stratified


def test_holm_and_bonferroni_adjustments_match_their_definitions():
    p = [0.01, 0.04, 0.03]
    assert adjust_p(p, "bonferroni") == pytest.approx([0.03, 0.12, 0.09])
    # Holm: sorted 0.01, 0.03, 0.04 times 3, 2, 1 → 0.03, 0.06, 0.04 → monotone 0.06.
    assert adjust_p(p, "holm") == pytest.approx([0.03, 0.06, 0.06])
    assert adjust_p([0.6, 0.5], "bonferroni") == [1.0, 1.0]
    assert adjust_p([0.02], "holm") == [0.02]  # a family of one is not corrected
    with pytest.raises(EvoError, match="unknown correction"):
        adjust_p(p, "sidak")


def test_an_unknown_ci_method_is_one_clear_error():
    rng = np.random.default_rng(0)
    table = _scores([0.5] * 5, rng=rng)
    with pytest.raises(EvoError, match="unknown CI method 'studentized'"):
        compare_tables(table, table, ci_method="studentized")


def test_the_gate_schema_states_the_procedures_own_defaults_and_choices():
    """The schema documents the defaults GateProcedure applies and the choices compare_tables
    accepts; each is written once in the code, and this holds the schema to it."""
    import dataclasses
    import json

    from evotrainer import stats
    from evotrainer.store.builtin import builtin_dir

    schema = json.loads((builtin_dir("spec/schemas") / "gate.schema.json").read_text())
    props = schema["properties"]
    default = stats.GateProcedure()
    for name in ("ci_method", "resamples", "strata", "correction"):
        assert props[name]["default"] == getattr(default, name), name
    assert tuple(props["compare_with"]["default"]) == default.compare_with
    assert tuple(props["ci_method"]["enum"]) == stats.CI_METHODS
    assert tuple(props["correction"]["enum"]) == stats.CORRECTIONS
    assert {f.name for f in dataclasses.fields(stats.GateProcedure)} <= {*props, "alpha"}


def test_the_interval_label_reads_the_recorded_confidence():
    from evotrainer.stats import confidence_label

    assert confidence_label({"confidence": 0.95}) == "95% CI"
    assert confidence_label({"confidence": 1 - 0.05 / 2}) == "97.5% CI"
    assert confidence_label({}) == "CI"
