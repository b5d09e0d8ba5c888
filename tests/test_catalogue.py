"""The metric catalogue (diagnosis/catalogue.py): every metric checked against a plain-Python
computation over one hand-made rollout table, every alert against its threshold, and every
entry valid on top of the built-in revision a planner extends."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from evotrainer.diagnosis.catalogue import GAPS, catalogue
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import parse_harness, resolve_harness
from evotrainer.errors import EvoError
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.store.recipe import BASE_RECIPE
from evotrainer.store.specs import load_yaml

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 100  # the table's length budget: truncated responses are exactly this long

RESPONSES = [
    "\\boxed{42}",
    "so the answer is 7",
    "<think>let me see 3 + 4",  # opens a block, never closes it
    "<think>3 + 4</think> 7",
    "<think>a</think> then <think>b",  # closes one, leaves the last open
    "x \\boxed{1} then \\boxed{2}",
    "no numbers here",
    "  padded text \n",
    "",
    "-3.5 or 12",
]
# Failed calls as the domains record them: unparsed, a disabled tool, a failed program.
TOOLS = [None, [], ["bash ls"], ["invalid ?", "bash pytest", "python_error 1/0"],
         ["unavailable reveal"]]
FINISH = [None, "stop", "length", "tool_limit", "error"]


def _rows() -> list[dict]:
    rng = random.Random(7)
    rows = []
    for seed in (0, 1):
        for step in (1, 2, 3):
            for g in range(5):
                size = 1 if g == 4 else 4  # a group of one: no group metric reads it
                for i in range(size):
                    tokens = rng.choice([None, BUDGET, *range(5, BUDGET)])
                    correct = rng.choice([0.0, 0.0, 1.0, 1.0, None] if g == 3 else [0.0, 1.0])
                    rows.append(dict(
                        seed=seed, step=step, group_id=f"g{g}", task_id=f"t{g}", sample_idx=i,
                        response=rng.choice(RESPONSES + [None]), correct=correct,
                        reward=correct or 0.0, response_tokens=tokens,
                        truncated=None if tokens is None else tokens == BUDGET,
                        turns=rng.randint(1, 8), tool_calls=rng.choice(TOOLS),
                        finish_reason=rng.choice(FINISH),
                    ))
    for i, correct in enumerate([1.0, 0.0, 0.0, 1.0, 0.0]):
        rows.append(dict(split="val", step=3, task_id=f"t{i}", group_id=f"v{i}",
                         correct=correct, reward=correct, response="v"))
    return rows


def _with_components(rows: list[dict]) -> list[dict]:
    """Reward components on the train rows, from their own random stream (the other columns
    stay as drawn): `efficiency` pays failing rows more, `partial` pays solved ones more,
    `constant` never moves (no correlation), `tampered` is a flag the audit leaves out; some
    rows record no components."""
    rng = random.Random(11)
    for r in rows:
        if r.get("split") == "val" or rng.random() < 0.1:
            continue
        solved = r["correct"] or 0.0
        r["reward_components"] = [
            ("correctness", solved),
            ("efficiency", 1.0 - 0.5 * solved + rng.random() * 0.6),
            ("partial", 0.5 * solved + rng.random() * 0.6),
            ("constant", 1.0),
            ("tampered", float(rng.random() < 0.2)),
        ]
    return rows


ROWS = _with_components(_rows())
TRAIN = [r for r in ROWS if r.get("split", "train") == "train"]


def _revision(entries=None, name: str = "catalogue") -> dict:
    entries = catalogue() if entries is None else entries
    return {
        "apiVersion": "evotrainer/v1", "kind": "HarnessRevision", "name": name,
        "metrics": [copy.deepcopy(e.metric) for e in entries],
        "alerts": [copy.deepcopy(e.alert) for e in entries if e.alert],
    }


@pytest.fixture(scope="module")
def diagnosis() -> dict:
    return diagnose(rollout_table(ROWS), None, parse_harness(_revision()))


# ---- the independent computations: plain Python over the rows, no SQL ----


def _by_step(rows, per_row):
    """(mean over rows, {step: mean}) of per_row(row), rows where it is None left out."""
    values = [(r["step"], v) for r in rows if (v := per_row(r)) is not None]
    steps = defaultdict(list)
    for step, v in values:
        steps[step].append(v)
    return np.mean([v for _, v in values]), {s: np.mean(vs) for s, vs in steps.items()}


def _groups(rows):
    groups = defaultdict(list)
    for r in rows:
        groups[(r["seed"], r["step"], r["group_id"])].append(r)
    return groups


def _by_group(rows, per_group):
    """(mean over groups of >= 2 rows, {step: mean}) of per_group(rows), None left out."""
    return _by_step(
        [{"step": key[1], "group": members} for key, members in _groups(rows).items()
         if len(members) >= 2],
        lambda g: per_group(g["group"]),
    )


def mid_band(group):
    if any(r["correct"] is None for r in group):
        return None
    acc = sum(r["correct"] for r in group) / len(group)
    return 1.0 if 0.2 <= acc <= 0.8 else 0.0


def final_answer(response):
    text = response or ""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1]
    numbers = re.findall(r"-?[0-9]+(?:\.[0-9]+)?", text)
    return numbers[-1] if numbers else text.strip(" \t\n\r")


def answer_diversity(group):
    return len({final_answer(r["response"]) for r in group}) / len(group)


def advantage_diversity(group):
    distinct = {round(r["reward"], 3) for r in group}
    return (len(distinct) - 1) / (len(group) - 1)


def distinct_responses(group):
    # SQL's count(DISTINCT response) leaves nulls out.
    return len({r["response"] for r in group if r["response"] is not None}) / len(group)


def unclosed(r):
    text = r["response"]
    if text is None:
        return None
    return float("<think>" in text and "</think>" not in text.split("<think>")[-1])


def idle(r):
    if r["tool_calls"] is None or r["correct"] is None:
        return None
    return float(len(r["tool_calls"]) == 0 and r["correct"] == 0)


def ends(reason):
    return lambda r: None if r["finish_reason"] is None else float(r["finish_reason"] == reason)


def percentile_budget(q):
    budget = max(r["response_tokens"] for r in TRAIN if r["truncated"])

    def per_step(rows):
        tokens = [r["response_tokens"] for r in rows if r["response_tokens"] is not None]
        return np.percentile(tokens, q) / budget  # linear, like quantile_cont

    steps = {s: per_step([r for r in TRAIN if r["step"] == s]) for s in (1, 2, 3)}
    return per_step(TRAIN), steps


def turn_rows():
    return [r for r in TRAIN if r["turns"] is not None and r["correct"] is not None]


def abandonment():
    long_horizon = max(r["turns"] for r in TRAIN) > 3
    assert long_horizon  # the table must exercise the rule
    return _by_step(turn_rows(), lambda r: float(r["turns"] <= 3 and r["correct"] == 0))


def inflation():
    def ratio(rows):
        failed = [r["turns"] for r in rows if r["correct"] == 0]
        return np.mean(failed) / np.mean([r["turns"] for r in rows])

    rows = turn_rows()
    return ratio(rows), {s: ratio([r for r in rows if r["step"] == s]) for s in (1, 2, 3)}


def train_val_gap():
    def rate(split):
        values = [r["correct"] for r in ROWS
                  if r.get("split", "train") == split and r["correct"] is not None]
        return np.mean(values)

    return rate("train") - rate("val"), None



def calls_any(row):
    return None if row["tool_calls"] is None else float(len(row["tool_calls"]) > 0)


def failed_calls():
    """Per call, not per rollout: the share of all calls (of a step) that failed."""
    names = [(r["step"], c.split(" ")[0]) for r in TRAIN for c in r["tool_calls"] or []]
    failed = [(step, float(n in ("invalid", "unavailable") or n.endswith("_error")))
              for step, n in names]
    return _by_step([{"step": s, "v": v} for s, v in failed], lambda r: r["v"])


def alignment_by_component() -> dict[str, float | None]:
    """Pearson r of each audited component with `correct`; None where either is constant."""
    pairs = defaultdict(list)
    for r in TRAIN:
        if r["correct"] is None or not r.get("reward_components"):
            continue
        for name, value in r["reward_components"]:
            if name not in ("correctness", "tampered", "truncated"):
                pairs[name].append((value, r["correct"]))
    out = {}
    for name, xy in pairs.items():
        x, y = np.array(xy).T
        out[name] = None if x.std() == 0 or y.std() == 0 else float(np.corrcoef(x, y)[0, 1])
    return out


def reward_alignment():
    return min(v for v in alignment_by_component().values() if v is not None), None


EXPECTED = {
    "distinct_response_ratio": lambda: _by_group(TRAIN, distinct_responses),
    "train_val_gap": train_val_gap,
    "mid_band_mass": lambda: _by_group(TRAIN, mid_band),
    "answer_diversity": lambda: _by_group(TRAIN, answer_diversity),
    "advantage_diversity": lambda: _by_group(TRAIN, advantage_diversity),
    "response_length_p50_budget": lambda: percentile_budget(50),
    "response_length_p90_budget": lambda: percentile_budget(90),
    "response_length_p99_budget": lambda: percentile_budget(99),
    "unclosed_think_ratio": lambda: _by_step(TRAIN, unclosed),
    "idle_failure_rate": lambda: _by_step(TRAIN, idle),
    "abandonment_ratio": abandonment,
    "failed_turns_inflation": inflation,
    "error_finish_ratio": lambda: _by_step(TRAIN, ends("error")),
    "tool_limit_ratio": lambda: _by_step(TRAIN, ends("tool_limit")),
    "tool_call_rate": lambda: _by_step(TRAIN, calls_any),
    "tool_failure_rate": failed_calls,
    "reward_alignment": reward_alignment,
}


def test_every_catalogue_metric_has_an_independent_check():
    assert {e.metric["name"] for e in catalogue()} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_metric_matches_a_plain_python_computation(diagnosis, name):
    value, steps = EXPECTED[name]()
    assert diagnosis["metrics"][name] == pytest.approx(value, rel=1e-9)
    if steps is not None:
        assert dict(diagnosis["series"][name]) == pytest.approx(steps, rel=1e-9)
        # The table has something on both sides of the metric: it is neither 0 nor 1 by
        # construction everywhere.
        assert len(set(np.round(list(steps.values()), 9))) > 1


def test_a_keyed_metric_records_each_key_and_is_their_minimum(diagnosis):
    by_key = diagnosis["keyed"]["reward_alignment"]
    expected = alignment_by_component()
    assert set(by_key) == set(expected) == {"efficiency", "partial", "constant"}
    assert by_key["constant"] is None  # a term that never moves says nothing
    for name in ("efficiency", "partial"):
        assert by_key[name] == pytest.approx(expected[name], rel=1e-9)
    assert by_key["efficiency"] < 0 < by_key["partial"]  # paying failures: anti-correlated
    assert diagnosis["metrics"]["reward_alignment"] == by_key["efficiency"]


def test_final_answers_as_the_description_says():
    assert [final_answer(r) for r in RESPONSES] == [
        "42", "7", "4", "7", "<think>a</think> then <think>b", "2", "no numbers here",
        "padded text", "", "12",
    ]


@pytest.mark.parametrize(
    "entry", [e for e in catalogue() if e.alert], ids=lambda e: e.alert["name"]
)
def test_alert_fires_exactly_past_its_threshold(diagnosis, entry):
    alert = entry.alert
    metric = alert["metric"]
    value = diagnosis["metrics"][metric]
    op = re.fullmatch(rf"{metric} ([<>]) (-?[0-9.]+)", alert["when"])
    assert op and float(op[2]) == alert["threshold"]
    crossed = value > alert["threshold"] if op[1] == ">" else value < alert["threshold"]
    fired = [a for a in diagnosis["alerts"] if a["name"] == alert["name"]]
    assert bool(fired) == crossed
    # The same rows, with the threshold moved to the value's other side, flip it.
    moved = copy.deepcopy(entry)
    flipped = value + 1 if (op[1] == ">") == crossed else value - 1
    moved.alert["when"] = f"{metric} {op[1]} {flipped!r}"
    moved.alert["threshold"] = flipped
    again = diagnose(rollout_table(ROWS), None, parse_harness(_revision([moved], "moved")))
    assert bool([a for a in again["alerts"] if a["name"] == alert["name"]]) != crossed


def test_the_budget_comes_from_the_recipe_when_the_planner_binds_it():
    entry = next(e for e in catalogue() if e.metric["name"] == "response_length_p90_budget")
    metric = entry.metric_for({"grpo": {"max_response_tokens": 400}, "backend": "verl"})
    assert metric["params"] == {"max_response_tokens": 400, "backend": "verl"}
    assert entry.metric["params"] == {"max_response_tokens": None, "backend": None}  # unchanged
    assert entry.metric_for({"grpo": {}}) == entry.metric  # no budget: the fallback
    d = diagnose(rollout_table(ROWS), None, parse_harness(
        _revision([dataclasses.replace(entry, metric=metric)], "budget")))
    tokens = [r["response_tokens"] for r in TRAIN if r["response_tokens"] is not None]
    assert d["metrics"]["response_length_p90_budget"] == pytest.approx(
        np.percentile(tokens, 90) / 400)


def test_the_embedded_engines_budget_is_per_turn():
    """The engine cuts each assistant turn at grpo.max_response_tokens, so a multi-turn
    episode's length against it is its tokens per turn (verl's budget covers all turns)."""
    entry = next(e for e in catalogue() if e.metric["name"] == "response_length_p90_budget")
    metric = entry.metric_for({"grpo": {"max_response_tokens": 40}, "backend": "local"})
    d = diagnose(rollout_table(ROWS), None, parse_harness(
        _revision([dataclasses.replace(entry, metric=metric)], "per-turn")))
    per_turn = [r["response_tokens"] / max(r["turns"] or 1, 1)
                for r in TRAIN if r["response_tokens"] is not None]
    assert max(r["turns"] or 1 for r in TRAIN) > 1  # the table has multi-turn episodes
    assert d["metrics"]["response_length_p90_budget"] == pytest.approx(
        np.percentile(per_turn, 90) / 40)


def test_no_budget_known_leaves_the_metric_null():
    rows = [dict(r, truncated=False) for r in TRAIN]
    d = diagnose(rollout_table(rows), None, parse_harness(_revision()))
    assert d["metrics"]["response_length_p50_budget"] is None
    assert any(g["metric"] == "response_length_p50_budget" for g in d["gaps"])


def test_entries_name_real_gaps_and_hypotheses():
    library = {p.stem for p in (ROOT / "skills").glob("*.yaml")}
    categories = {load_yaml((ROOT / "skills" / f"{s}.yaml").read_bytes(), s)["category"]
                  for s in library}
    names = [e.metric["name"] for e in catalogue()]
    assert len(names) == len(set(names))
    for entry in catalogue():
        assert entry.gaps and entry.gaps <= set(GAPS)
        assert entry.hypotheses and set(entry.hypotheses) <= library | categories
        if entry.alert:
            assert entry.alert["metric"] == entry.metric["name"]
        bound = entry.metric_for(BASE_RECIPE).get("params", {})
        for param in entry.recipe_params:
            assert param in entry.metric["params"]  # the default when no recipe binds it
            assert bound[param] is not None  # real recipe fields: a budget, the backend, ...


def test_every_entry_extends_the_builtin_revision():
    """A planner copies an entry into a new revision of h1: it must build there, and its
    metric must not shadow one h1 has."""
    h1 = resolve_harness("h1")
    base = load_yaml((ROOT / "harness_revisions" / "h1.yaml").read_bytes(), "h1.yaml")
    for entry in catalogue():
        assert entry.metric["name"] not in {m.name for m in h1.metrics}
        doc = copy.deepcopy(base)
        doc["name"], doc["parent"] = "h9", "h1"
        doc["metrics"].append(copy.deepcopy(entry.metric))
        doc["alerts"] += [copy.deepcopy(entry.alert)] if entry.alert else []
        revision = parse_harness(doc)
        assert revision.metric(entry.metric["name"]).sql


def test_catalogue_values_are_finite_on_the_table(diagnosis):
    for name in EXPECTED:
        assert math.isfinite(diagnosis["metrics"][name])


def test_a_metrics_own_params_are_checked_like_the_revisions():
    entry = next(e for e in catalogue() if e.metric["name"] == "response_length_p50_budget")
    doc = _revision([entry], "own")
    del doc["metrics"][0]["params"]  # the SQL reads $backend and $max_response_tokens: undefined
    with pytest.raises(EvoError, match=r"undefined param\(s\) \$backend, \$max_response_tokens"):
        parse_harness(doc)
    doc["params"] = {"max_response_tokens": 250, "backend": "local"}  # the revision's serve
    assert parse_harness(doc).metric("response_length_p50_budget").params == {}
    analyzer_metric = {"name": "x", "layer": "behavior", "analyzer": {"name": "leak"},
                       "params": {"leak_tools": []}}
    with pytest.raises(EvoError, match="a metric's own params are for its sql"):
        parse_harness({**doc, "metrics": [analyzer_metric], "alerts": []})
