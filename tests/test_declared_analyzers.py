"""Declared analyzers (diagnosis/declared.py): an analyzer written in the harness revision as
SQL or as one Python function run in the sandbox. Each kind is checked against a plain-Python
computation on a hand-made table; the contract checks and the attacks (an infinite loop, a
huge allocation, reading a file outside, os.system) run for real."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import pytest

from evotrainer.diagnosis.diagnose import columns_read, diagnose
from evotrainer.diagnosis.harness import parse_harness, parse_harness_text
from evotrainer.errors import EvoError
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.sandbox.process import default_sandbox

ROWS = [
    dict(step=step, seed=seed, group_id=f"g{g}", sample_idx=i, task_id=f"t{g}",
         response=("<think>x</think> 4" if (step + g + i) % 3 else "<think>x"),
         correct=float((step * 7 + g * 3 + i) % 4 == 0), reward=float(i % 2),
         turns=1 + (step + i) % 5)
    for seed in (0, 1) for step in (1, 2, 3) for g in range(3) for i in range(4)
] + [dict(split="val", step=3, task_id="t0", group_id="v", response="<think>", correct=1.0)]
TRAIN = [r for r in ROWS if r.get("split", "train") == "train"]

THINK_SHARE = """\
def think_share(rows, params):
    return [float("</think>" not in r) for r in rows["response"]]
"""


def revision(analyzer: dict, *, metric: dict | None = None) -> dict:
    return {
        "apiVersion": "evotrainer/v1", "kind": "HarnessRevision", "name": "h9",
        "metrics": [{"name": "m", "layer": "behavior", "split": "train", "series": True,
                     "analyzer": {"name": analyzer["name"]}, **(metric or {})}],
        "analyzers": [analyzer],
    }


def run(declared: dict, rows=ROWS, **metric) -> dict:
    return diagnose(rollout_table(rows), None, parse_harness(revision(declared, metric=metric)))


def by_step(pairs):
    steps = defaultdict(list)
    for step, value in pairs:
        steps[step].append(value)
    return np.mean([v for _, v in pairs]), {s: np.mean(v) for s, v in steps.items()}


def unclosed(r):
    return float("</think>" not in r["response"])


# ---- each kind, in SQL and in Python, against plain Python ----


def test_python_per_row_analyzer():
    d = run({"name": "think_share", "inputs": ["response"], "output": {"kind": "per_row"},
             "python": THINK_SHARE})
    value, steps = by_step([(r["step"], unclosed(r)) for r in TRAIN])
    assert d["metrics"]["m"] == pytest.approx(value)
    assert dict(d["series"]["m"]) == pytest.approx(steps)


def test_sql_per_row_analyzer_sees_only_its_where_rows():
    d = run({"name": "long_think", "inputs": ["response", "step", "turns"],
             "output": {"kind": "per_row"}, "rows": {"where": "turns >= 3"},
             "sql": "SELECT step, CASE WHEN contains(response, '</think>') THEN 0.0 ELSE 1.0 "
                    "END AS value FROM rollouts"})
    value, steps = by_step([(r["step"], unclosed(r)) for r in TRAIN if r["turns"] >= 3])
    assert d["metrics"]["m"] == pytest.approx(value)
    assert dict(d["series"]["m"]) == pytest.approx(steps)


def _group_success():
    groups = defaultdict(list)
    for r in TRAIN:
        groups[(r["seed"], r["step"], r["group_id"])].append(r["correct"])
    return by_step([(key[1], float(0 < np.mean(v) < 1)) for key, v in groups.items()])


def test_sql_per_group_analyzer():
    d = run({"name": "mixed", "inputs": ["seed", "step", "group_id", "correct"],
             "output": {"kind": "per_group"},
             "sql": "SELECT seed, step, group_id, CASE WHEN avg(correct) > 0 AND avg(correct) "
                    "< 1 THEN 1.0 ELSE 0.0 END AS value FROM rollouts "
                    "GROUP BY seed, step, group_id"})
    value, steps = _group_success()
    assert d["metrics"]["m"] == pytest.approx(value)
    assert dict(d["series"]["m"]) == pytest.approx(steps)


def test_python_per_group_analyzer():
    source = """\
from collections import defaultdict
def mixed(rows, params):
    groups = defaultdict(list)
    for key in zip(rows["seed"], rows["step"], rows["group_id"], rows["correct"]):
        groups[key[:3]].append(key[3])
    return [{"seed": s, "step": t, "group_id": g, "value": float(0 < sum(v) < len(v))}
            for (s, t, g), v in groups.items()]
"""
    d = run({"name": "mixed", "inputs": ["seed", "step", "group_id", "correct"],
             "output": {"kind": "per_group"}, "python": source})
    value, steps = _group_success()
    assert d["metrics"]["m"] == pytest.approx(value)
    assert dict(d["series"]["m"]) == pytest.approx(steps)


def test_scalar_and_series_analyzers_read_params():
    turns = [r["turns"] for r in TRAIN]
    scalar = run({"name": "long", "inputs": ["turns"], "output": {"kind": "scalar"},
                  "python": "def long(rows, params):\n"
                            "    t = rows['turns']\n"
                            "    return sum(x > params['cut'] for x in t) / len(t)\n"},
                 analyzer={"name": "long", "params": {"cut": 3}})
    assert scalar["metrics"]["m"] == pytest.approx(np.mean([t > 3 for t in turns]))
    series = run({"name": "p90", "inputs": ["step", "turns"], "output": {"kind": "series"},
                  "sql": "SELECT step, quantile_cont(turns, 0.9) AS value FROM rollouts "
                         "GROUP BY ROLLUP (step)"})
    assert series["metrics"]["m"] == pytest.approx(np.percentile(turns, 90))
    assert dict(series["series"]["m"]) == pytest.approx(
        {s: np.percentile([r["turns"] for r in TRAIN if r["step"] == s], 90) for s in (1, 2, 3)})
    python_series = run(
        {"name": "last", "inputs": ["step", "turns"], "output": {"kind": "series"},
         "python": "def last(rows, params):\n"
                   "    by = {}\n"
                   "    for s, t in zip(rows['step'], rows['turns']):\n"
                   "        by[s] = max(by.get(s, 0), t)\n"
                   "    return {'value': max(by.values()), 'series': by}\n"})
    assert python_series["metrics"]["m"] == max(turns)
    assert python_series["series"]["m"] == [
        [s, max(r["turns"] for r in TRAIN if r["step"] == s)] for s in (1, 2, 3)]


def test_rows_split_is_the_split_its_metric_reads():
    val_open = {"name": "val_open", "inputs": ["response"], "output": {"kind": "per_row"},
                "rows": {"split": "val"}, "python": THINK_SHARE}
    d = run(val_open, split="val")
    assert d["metrics"]["m"] == 1.0  # the one val row never closes its block
    with pytest.raises(EvoError, match="reads train rows, but analyzer 'val_open' declares "
                                       "rows.split val"):
        run(val_open)


def test_a_reviewer_reads_the_analyzer_in_the_revision_text():
    text = """\
apiVersion: evotrainer/v1
kind: HarnessRevision
name: h9
metrics:
  - {name: m, layer: behavior, split: train, analyzer: {name: think_share}}
analyzers:
  - name: think_share
    inputs: [response]
    output: {kind: per_row}
    python: |
      def think_share(rows, params):
          return [float("</think>" not in r) for r in rows["response"]]
"""
    harness = parse_harness_text(text, "harness_revisions/h9.yaml")
    assert harness.declared("think_share").python == THINK_SHARE
    # The diagnosis reads what it declares, and nothing else of the rows.
    assert set(columns_read(harness)) == {
        "version", "split", "seed", "step", "group_id", "sample_idx", "response"}


# ---- the declared contract ----


@pytest.mark.parametrize("change, message", [
    ({"inputs": ["response", "no_such_column"]}, "unknown rollout column(s) no_such_column"),
    ({"output": {"kind": "per_group"}}, "needs seed, step, group_id among its inputs"),
    ({"sql": "SELECT avg(turns) AS value FROM rollouts"}, "needs exactly one of sql, python"),
    ({"python": None, "sql": "SELECT avg(turns) AS value FROM rollouts"},
     "its sql reads turns, not among its inputs"),
    ({"python": "def a(r, p):\n    return 1\ndef b(r, p):\n    return 2\n"},
     "exactly one function, found 2"),
    ({"python": "x = 1\ndef a(r, p):\n    return x\n"}, "only imports and one function"),
    ({"name": "leak"}, "analyzer name 'leak' is taken"),
])
def test_contract_violations_are_refused_at_load(change, message):
    analyzer = {"name": "think_share", "inputs": ["response"], "output": {"kind": "per_row"},
                "python": THINK_SHARE, **change}
    analyzer = {k: v for k, v in analyzer.items() if v is not None}
    doc = revision(analyzer)
    with pytest.raises(EvoError) as err:
        parse_harness(doc, source="harness_revisions/h9.yaml")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_metric_naming_an_undeclared_analyzer_is_refused():
    doc = revision({"name": "think_share", "inputs": ["response"],
                    "output": {"kind": "per_row"}, "python": THINK_SHARE})
    doc["metrics"][0]["analyzer"]["name"] = "thinks_share"
    with pytest.raises(EvoError, match="unknown analyzer 'thinks_share'.*declared in this "
                                       "revision: think_share"):
        parse_harness(doc)


def test_the_checks_list_of_registered_analyzers_is_the_registry():
    # A revision is checked against the names alone (without importing the analyzers' code):
    # an analyzer added to or removed from the registry must be in that list too.
    from evotrainer.diagnosis.analyzer_names import REGISTERED
    from evotrainer.diagnosis.analyzers import ANALYZERS

    assert frozenset(ANALYZERS) == REGISTERED


@pytest.mark.parametrize("kind, source, message", [
    ("per_row", "def a(rows, params):\n    return [1.0]\n", "returned 1 values for 72 rows"),
    ("per_row", "def a(rows, params):\n    return ['x'] * len(rows['response'])\n",
     "value 0 is str, not a number"),
    ("scalar", "def a(rows, params):\n    return [1.0]\n", "the result is list, not a number"),
    ("series", "def a(rows, params):\n    return 3.0\n", '{"value": v, "series": {step: v}}'),
    ("scalar", "def a(rows, params):\n    print('{\"result\": 1}')\n    return None\n", None),
])
def test_output_shape_is_checked(kind, source, message):
    analyzer = {"name": "a", "inputs": ["response"], "output": {"kind": kind}, "python": source}
    if kind == "series":
        analyzer["inputs"] = ["response", "step"]
    if message is None:
        # Printing cannot forge the result: prints go to stderr, the result stays its own.
        assert run(analyzer)["metrics"]["m"] is None
        return
    with pytest.raises(EvoError) as err:
        run(analyzer)
    assert err.value.message.startswith("harness h9, analyzer a: ")
    assert message in err.value.message


# ---- the attacks, performed for real ----


def hostile(source: str, **limits) -> dict:
    return {"name": "evil", "inputs": ["response"], "output": {"kind": "scalar"},
            "python": source, **({"limits": limits} if limits else {})}


def test_an_infinite_loop_is_killed():
    with pytest.raises(EvoError) as err:
        run(hostile("def evil(rows, params):\n    while True:\n        pass\n",
                    cpu_seconds=1, wall_seconds=2))
    assert err.value.message.startswith("harness h9, analyzer evil: stopped in the sandbox (")
    assert "cpu_limit" in str(err.value) or "timeout" in str(err.value)


def test_a_huge_allocation_is_stopped():
    with pytest.raises(EvoError) as err:
        run(hostile("def evil(rows, params):\n    return len(bytearray(8 * 2**30))\n",
                    memory_mb=256))
    assert "harness h9, analyzer evil: stopped in the sandbox (memory_limit)" in str(err.value)


@pytest.mark.parametrize("source, refused", [
    ("import os\ndef evil(rows, params):\n    return os.system('touch /tmp/pwned')\n",
     "imports os"),
    ("def evil(rows, params):\n    return len(open('{secret}').read())\n", "uses open"),
    ("def evil(rows, params):\n    return __import__('os').system('id')\n", "uses __import__"),
    ("def evil(rows, params):\n    return ().__class__.__base__.__subclasses__()\n",
     "reads the attribute __subclasses__"),
    ("def evil(rows, params):\n    g = (x for x in [1])\n    return g.gi_frame.f_back\n",
     "reads the attribute f_back"),
    ("from subprocess import run\ndef evil(rows, params):\n    return run(['id'])\n",
     "imports subprocess"),
])
def test_reaching_outside_is_refused_before_it_runs(tmp_path, source, refused):
    secret = tmp_path / "secret.txt"
    secret.write_text("the answer key")
    with pytest.raises(EvoError) as err:
        parse_harness(revision(hostile(source.format(secret=secret))))
    assert "harness h9, analyzer evil: python line" in str(err.value)
    assert refused in str(err.value)


def test_the_runtime_builtins_are_narrower_than_the_load_check():
    """`type` passes the load check, but the runner hands the program safe builtins only."""
    with pytest.raises(EvoError) as err:
        run(hostile("def evil(rows, params):\n    return len(type(rows)())\n"))
    assert "harness h9, analyzer evil: stopped in the sandbox (runtime_error)" in str(err.value)
    assert "name 'type' is not defined" in str(err.value)


# From the analyzer's frame to the runner's globals, which hold the real builtins module.
ESCAPE = """\
def evil(rows, params):
    try:
        1 / 0
    except ZeroDivisionError as err:
        real = err.__traceback__.tb_frame.f_back.f_globals["builtins"]
    real.__import__("os").system("echo pwned > {marker}")
    return float(len(real.open("{secret}").read()))
"""


@pytest.mark.skipif(not getattr(default_sandbox(), "privileged", False),
                    reason="only the namespaced sandbox (root) hides the host's files")
def test_an_escape_past_both_checks_meets_the_os_sandbox(tmp_path):
    """Suppose the load check and the runner's builtins were both bypassed: the program walks
    from a tuple to os's globals, runs a shell command and opens a file outside. The
    sandbox's own /tmp and mount namespace keep both away from the host."""
    secret, marker = tmp_path / "secret.txt", tmp_path / "pwned"
    secret.write_text("the answer key")
    analyzer = {"name": "evil", "inputs": ["response"], "output": {"kind": "scalar"},
                "python": "def evil(rows, params):\n    return 1.0\n"}
    harness = parse_harness(revision(analyzer))
    escaping = dataclasses.replace(
        harness.declared("evil"), python=ESCAPE.format(marker=marker, secret=secret))
    harness = dataclasses.replace(harness, analyzers=(escaping,))
    try:
        d = diagnose(rollout_table(ROWS), None, harness)
    except EvoError as err:
        assert "No such file or directory" in str(err) or "stopped in the sandbox" in str(err)
    else:
        pytest.fail(f"the escape read the file: {d['metrics']}")
    assert not marker.exists()


def test_python_sees_calls_maps_and_nulls_as_plain_json():
    rows = [dict(step=1 + i % 2, group_id=f"g{i}", tool_calls=calls, correct=0.0,
                 reward_components=comps, mean_logprob=logprob)
            for i, (calls, comps, logprob) in enumerate([
                (["bash ls", "edit a.py"], [("tampered", 1.0)], -0.5),
                (None, [], None),
                ([], [("format", 0.5), ("tampered", 0.0)], float("nan")),
                (["bash pytest"], [], -0.25),
            ])]
    source = """\
import math
def shape(rows, params):
    out = []
    for calls, comps, lp in zip(rows["tool_calls"], rows["reward_components"],
                                rows["mean_logprob"]):
        if calls is None:
            out.append(None)
            continue
        bonus = 0.0 if lp is None or math.isnan(lp) else lp
        out.append(len(calls) + comps.get("tampered", 0.0) + bonus
                   + sum(c["name"] == "bash" for c in calls))
    return out
"""
    d = run({"name": "shape", "inputs": ["tool_calls", "reward_components", "mean_logprob"],
             "output": {"kind": "per_row"}, "python": source}, rows=rows)
    expected = [(1, 2 + 1.0 - 0.5 + 1), (1, 0 + 0.0 + 0.0 + 0), (2, 1 + 0.0 - 0.25 + 1)]
    value, steps = by_step(expected)
    assert d["metrics"]["m"] == pytest.approx(value)
    assert dict(d["series"]["m"]) == pytest.approx(steps)


def test_an_analyzer_whose_rows_are_empty_gives_a_null_metric():
    d = run({"name": "think_share", "inputs": ["response"], "output": {"kind": "per_row"},
             "rows": {"where": "turns > 1000"}, "python": THINK_SHARE})
    assert d["metrics"]["m"] is None
    assert d["series"]["m"] == []
