"""h0 on small hand-made tables: every metric against a hand computation, every alert
planted once, a healthy table that fires nothing, nulls that never fire."""

import math

import numpy as np
import pytest

from evotrainer.diagnosis.diagnose import _Run, diagnose, diagnosis_document
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.gate.rules import gate_verdict

H0 = resolve_harness("h0")


def _tiny():
    # (step, group, reward, correct, turns, truncated, tokens, tool_calls)
    spec = [
        (1, "A", 1, 1, 2, False, 10, ["bash ls", "bash ls", "read f"]),
        (1, "A", 1, 1, 3, False, 20, ["reveal"]),
        (1, "A", 1, 1, 4, False, 30, ["bash git log -1"]),
        (1, "B", 0, 0, 70, True, 40, []),
        (1, "B", 0, 0, 70, True, 50, []),
        (1, "B", 0, 0, 2, False, 60, []),
        (1, "C", 1, 1, 5, False, 70, []),
        (1, "C", 0, 0, 6, False, 80, []),
        (1, "C", 0, 0, 7, False, 90, []),
        (2, "A", 1, 1, 3, False, 15, []),
        (2, "A", 0.5, 0, 3, False, 25, []),
        (2, "A", 0, 0, 3, False, 35, []),
        (2, "D", 1, 1, 10, False, 45, None),
    ]
    rows = [
        dict(
            step=s,
            task_id=g,
            group_id=g,
            sample_idx=i,
            reward=float(r),
            correct=float(c),
            turns=t,
            truncated=tr,
            response_tokens=tok,
            tool_calls=calls,
            mean_logprob=-0.2 - 0.01 * i,
        )
        for i, (s, g, r, c, t, tr, tok, calls) in enumerate(spec)
    ]
    val = [("A", 1), ("A", 0), ("B", 1), ("B", 1)]
    rows += [
        dict(split="val", step=10, task_id=t, group_id=t, sample_idx=i, correct=float(c))
        for i, (t, c) in enumerate(val)
    ]
    rows += [dict(split="val", step=5, task_id="A", group_id="A", correct=0.0)]
    return rows, spec


def test_every_h0_metric_matches_a_hand_computation():
    rows, spec = _tiny()
    d = diagnose(rollout_table(rows), None, H0)
    m = d["metrics"]
    rewards = np.array([r for _, _, r, *_ in spec], dtype=float)
    tokens = np.array([t[6] for t in spec], dtype=float)
    assert m["avg_at_k"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["reward_mean"] == pytest.approx(6.5 / 13)
    assert m["correct_rate"] == pytest.approx(6 / 13)
    # Groups with >= 2 rows: A@1 (all 1), B@1 (all 0), C@1 (1,0,0), A@2 (1,.5,0).
    assert m["dead_group_ratio"] == pytest.approx(2 / 4)
    assert m["all_correct_group_ratio"] == pytest.approx(1 / 4)
    assert m["all_wrong_group_ratio"] == pytest.approx(1 / 4)
    assert m["reward_spread"] == pytest.approx((math.sqrt(2 / 9) + math.sqrt(0.5 / 3)) / 4)
    assert m["truncation_rate"] == pytest.approx(2 / 13)
    assert m["turns_mean"] == pytest.approx(188 / 13)
    assert m["turns_p90"] == pytest.approx(58.0)  # sorted[10] + 0.8 * (sorted[11] - sorted[10])
    assert m["turns_max"] == 70
    assert m["echo_trap_ratio"] == pytest.approx(2 / 13)
    assert m["tool_calls_mean"] == pytest.approx(5 / 12)  # the null-tool row is left out
    assert m["max_same_tool_streak_mean"] == pytest.approx((2 + 1 + 1) / 3)
    assert m["leak_ratio"] == pytest.approx(2 / 12)  # `reveal` and `bash git log -1`
    assert m["val_leak_ratio"] is None  # val rows carry no tool data
    assert m["tool_type_entropy"] == pytest.approx(-(0.6 * math.log2(0.6) + 0.4 * math.log2(0.2)))
    assert m["length_reward_corr"] == pytest.approx(np.corrcoef(tokens, rewards)[0, 1])
    assert m["response_tokens_mean"] == pytest.approx(tokens.mean())
    assert m["mean_logprob"] == pytest.approx(np.mean([-0.2 - 0.01 * i for i in range(13)]))
    assert d["series"]["dead_group_ratio"] == [[1, pytest.approx(2 / 3)], [2, 0.0]]
    assert d["trends"]["dead_group_ratio"] == pytest.approx(-2 / 3)
    assert d["series"]["leak_ratio"] == [[1, pytest.approx(2 / 9)], [2, 0.0]]
    gaps = {g["metric"]: g["reason"] for g in d["gaps"]}
    assert gaps["val_leak_ratio"] == "tool_calls not recorded in val rollouts"
    assert gaps["delta_avg_at_k"] == "no parent scores to compare with"


def _healthy(steps: int = 4, groups: int = 10, size: int = 4) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        for g in range(groups):
            for i in range(size):
                ok = float((i + g) % 2 == 0)
                rows.append(
                    dict(
                        step=s,
                        task_id=f"t{g}",
                        group_id=f"s{s}g{g}",
                        sample_idx=i,
                        reward=ok,
                        correct=ok,
                        turns=8 + (i * 3 + g) % 7,
                        truncated=False,
                        response_tokens=100 + (i * 7 + g * 13) % 50,
                        mean_logprob=-0.5,
                        tool_calls=["read a.py", "bash pytest"],
                    )
                )
    for g in range(groups):
        rows += [
            dict(
                split="val",
                step=steps,
                task_id=f"t{g}",
                group_id=f"v{g}",
                sample_idx=i,
                correct=float(i % 2),
                tool_calls=["read a.py"],
            )
            for i in range(4)
        ]
    return rows


def _fired(rows) -> dict[str, str]:
    return {a["name"]: a["severity"] for a in diagnose(rollout_table(rows), None, H0)["alerts"]}


def test_healthy_table_fires_no_alert():
    assert _fired(_healthy()) == {}


def _plant(fraction: float, change: dict, where=lambda r: r.get("split", "train") == "train"):
    rows = _healthy()
    train = [r for r in rows if where(r)]
    for r in train[: int(len(train) * fraction)]:
        r.update(change(r) if callable(change) else change)
    return rows


@pytest.mark.parametrize(
    ("rows", "alert", "severity"),
    [
        (lambda: _plant(0.4, {"reward": 1.0, "correct": 1.0}), "dead_groups", "warning"),
        (lambda: _plant(0.6, {"reward": 1.0, "correct": 1.0}), "dead_groups", "critical"),
        (
            lambda: _plant(1.0, lambda r: {"reward": 0.5 + 0.02 * r["reward"]}),
            "weak_signal",
            "warning",
        ),
        (lambda: _plant(0.2, {"truncated": True}), "truncation", "warning"),
        (lambda: _plant(0.1, {"turns": 70, "correct": 0.0}), "echo_trap", "warning"),
        (lambda: _plant(1.0, {"turns": 55}), "echo_trap", "warning"),
        (lambda: _plant(0.99, {"turns": 2}), "abandonment", "critical"),
        (
            lambda: _plant(0.01, {"tool_calls": [{"name": "reveal", "args": ""}]}),
            "leak",
            "critical",
        ),
        (
            lambda: _plant(0.01, {"tool_calls": [{"name": "bash", "args": "git show HEAD~1"}]}),
            "leak",
            "critical",
        ),
        (
            lambda: _plant(
                0.1,
                {"tool_calls": [{"name": "reveal", "args": ""}]},
                where=lambda r: r.get("split") == "val",
            ),
            "leak",
            "critical",
        ),
        (lambda: _plant(1.0, {"mean_logprob": -0.08}), "overconfidence", "warning"),
        (lambda: _plant(1.0, {"mean_logprob": -0.01}), "overconfidence", "critical"),
        (
            lambda: _plant(1.0, lambda r: {"response_tokens": 100 + int(500 * r["reward"])}),
            "length_gaming",
            "warning",
        ),
    ],
)
def test_planted_pathology_fires_its_alert(rows, alert, severity):
    assert _fired(rows()).get(alert) == severity


def test_alert_examples_are_rollout_ids_of_the_pathology():
    rows = _plant(0.01, {"tool_calls": [{"name": "reveal", "args": ""}]})
    d = diagnose(rollout_table(rows), None, H0)
    (leak,) = [a for a in d["alerts"] if a["name"] == "leak"]
    assert leak["examples"] == ["v0/0/train/1/s1g0/0"]
    assert leak["layer"] == "behavior" and leak["threshold"] == 0


def test_echo_trap_is_the_papers_long_failing_rollout_only():
    # The method's definition: more than 60 turns with correctness 0. A short failing rollout
    # that repeats one call is h1's echo_repeat_ratio, never h0's echo trap.
    loop = [{"name": "compare", "args": "31"}] * 5
    cases = [  # (turns, correct, tool calls, an h0 echo trap?)
        (61, 0.0, [], True),
        (60, 0.0, [], False),  # not more than 60
        (90, 1.0, [], False),  # it got there
        (90, None, [], False),  # unscored is not a failure
        (4, 0.0, loop, False),
        (None, 0.0, loop, None),  # turns unknown: left out
    ]
    rows = [
        dict(step=1, group_id="g", sample_idx=i, reward=0.0, correct=c, turns=t, tool_calls=k)
        for i, (t, c, k, _) in enumerate(cases)
    ]
    d = diagnose(rollout_table(rows), None, H0)
    known = [e for *_, e in cases if e is not None]
    assert d["metrics"]["echo_trap_ratio"] == pytest.approx(sum(known) / len(known))
    (echo,) = [a for a in d["alerts"] if a["name"] == "echo_trap"]
    assert echo["examples"] == ["v0/0/train/1/g/0"]
    assert "echo_repeat_ratio" not in d["metrics"]


def test_small_multi_turn_env_does_not_fire_abandonment():
    # A toolenv capped at 6 turns whose episodes end in ~3 turns is not abandoning.
    rows = _plant(1.0, lambda r: {"turns": 2 + r["sample_idx"] % 3 + (r["step"] == 1)})
    assert "abandonment" not in _fired(rows)


def test_null_metrics_never_fire_and_are_gaps():
    rows = [
        dict(
            step=1,
            group_id=f"g{i // 4}",
            sample_idx=i % 4,
            reward=float(i % 2),
            correct=float(i % 2),
        )
        for i in range(16)
    ]
    d = diagnose(rollout_table(rows), None, H0)
    assert d["alerts"] == []
    gaps = {g["metric"] for g in d["gaps"]}
    assert {"turns_mean", "truncation_rate", "mean_logprob", "leak_ratio", "avg_at_k"} <= gaps


def test_single_turn_data_has_null_turn_metrics():
    rows = [
        dict(step=1, group_id="g", sample_idx=i, reward=float(i % 2), turns=1) for i in range(4)
    ]
    m = diagnose(rollout_table(rows), None, H0)["metrics"]
    assert m["turns_mean"] is None and m["turns_p90"] is None


def test_eval_only_baseline_lists_train_gaps():
    rows = [r for r in _healthy() if r.get("split") == "val"]
    d = diagnose(rollout_table(rows), None, H0)
    assert d["metrics"]["avg_at_k"] == pytest.approx(0.5)
    assert d["metrics"]["dead_group_ratio"] is None
    assert {"metric": "dead_group_ratio", "reason": "no train rollouts"} in d["gaps"]
    assert d["alerts"] == []


def test_parent_scores_feed_version_metrics_and_gate():
    import pyarrow as pa

    rows = _healthy()
    for r in rows:
        if r.get("split") == "val":
            r["correct"] = 1.0
    parent = pa.table(
        {
            "seed": [0] * 40,
            "task_id": [f"t{g}" for g in range(10) for _ in range(4)],
            "data_source": ["synthetic"] * 40,
            "sample_idx": list(range(4)) * 10,
            "correct": [0.0] * 40,
        }
    )
    d = diagnose(rollout_table(rows), None, H0, parent_scores=parent)
    assert d["metrics"]["delta_avg_at_k"] == pytest.approx(1.0)
    assert gate_verdict(H0, d)["verdict"] == "promote"
    doc = diagnosis_document(d, "v3")
    assert doc["kind"] == "Diagnosis" and doc["metrics"]["delta_avg_at_k"]["layer"] == "version"
    assert doc["comparison"]["n_tasks"] == 10


def test_gate_rules_in_order():
    d = diagnose(rollout_table(_healthy()), None, H0)

    def verdict(**comparison):
        return gate_verdict(H0, d, comparison)["verdict"]

    assert verdict(ci_low=0.01, ci_high=0.2, delta=0.1) == "promote"
    assert verdict(ci_low=-0.3, ci_high=-0.01, delta=-0.1) == "prune"
    assert verdict(ci_low=-0.1, ci_high=0.1, delta=0.0) == "inconclusive"
    assert verdict() == "inconclusive"  # no comparison: the nulls decide nothing
    leaking = diagnose(
        rollout_table(_plant(0.01, {"tool_calls": [{"name": "reveal", "args": ""}]})), None, H0
    )
    result = gate_verdict(H0, leaking, {"ci_low": 0.1, "ci_high": 0.3, "delta": 0.2})
    assert (result["verdict"], result["rule"]) == ("block", "integrity_alert")
    assert result["variables"]["critical_behavior_alerts"] == 1
    # A clean child of a leaky parent replaces it unless it is significantly worse.
    clean = dict(d, metrics={**d["metrics"], "val_leak_ratio": 0.0})
    closed = gate_verdict(H0, clean, {"ci_low": -0.1, "ci_high": 0.1, "delta": 0.0},
                          {"val_leak_ratio": 0.2})
    assert (closed["verdict"], closed["rule"]) == ("promote", "leak_closed")
    worse = gate_verdict(H0, clean, {"ci_low": -0.3, "ci_high": -0.1, "delta": -0.2},
                         {"val_leak_ratio": 0.2})
    assert worse["verdict"] == "prune"
    # A critical *signal* alert (dead groups) names the next fix but does not veto a gain.
    dead = dict(d, alerts=[{"name": "dead_groups", "severity": "critical", "layer": "signal"}])
    assert (
        gate_verdict(H0, dead, {"ci_low": 0.1, "ci_high": 0.3, "delta": 0.2})["verdict"]
        == "promote"
    )


# ---- the vectorised analyzers, the example sampling and the digest against their definitions


def _streak_by_hand(calls):
    if not calls:
        return math.nan
    best = run = 1
    for prev, cur in zip(calls, calls[1:], strict=False):
        run = run + 1 if (cur["name"] or "") == (prev["name"] or "") else 1
        best = max(best, run)
    return float(best)


def _leak_by_hand(calls, tools, patterns):
    import re

    if calls is None:
        return math.nan
    return float(
        any(
            (c["name"] or "") in tools
            or any(re.search(p, f"{c['name'] or ''} {c['args'] or ''}") for p in patterns)
            for c in calls
        )
    )


def _edge_calls():
    b, r, g = ({"name": n, "args": a} for n, a in (("bash", "ls"), ("read", "f"), ("git", "x")))
    return [
        None,  # no tool data: NaN for both
        [],  # no calls: streak NaN, leak 0
        [b],  # one call
        [b, b, r, b, b, b],  # the longest run is not the first
        [b, r, b, r],  # alternating tools never streak
        [r, r],  # a run of the previous row must not continue into this one ...
        [r, r, r],  # ... nor this
        [{"name": None, "args": None}, {"name": "", "args": "git log"}],  # nulls are ""
        [{"name": "bash", "args": "git  log"}, {"name": "bashgit", "args": "log"}],  # no \b
        [{"name": "git", "args": "show HEAD"}],  # the match spans name and args
        [{"name": "reveal", "args": None}],
        [g, g, {"name": "bash", "args": "echo; git blame x"}],
    ]


def test_tool_call_analyzers_equal_the_per_row_definition():
    import pyarrow as pa

    from evotrainer.diagnosis.analyzers import leak, max_same_tool_streak
    from evotrainer.evidence.schema import TOOL_CALL

    rows = _edge_calls()
    params = {"leak_tools": ["reveal"], "leak_patterns": [r"\bgit (log|show|reflog|blame)\b"]}
    want_streak = [_streak_by_hand(c) for c in rows]
    want_leak = [_leak_by_hand(c, ["reveal"], params["leak_patterns"]) for c in rows]
    # One chunk, several chunks (as read from Parquet row groups), and the rows reversed.
    for cut in ([len(rows)], [3, 4, len(rows) - 7], [1] * len(rows)):
        chunks, at = [], 0
        for n in cut:
            chunks.append(pa.array(rows[at : at + n], pa.list_(TOOL_CALL)))
            at += n
        table = pa.table({"tool_calls": pa.chunked_array(chunks, pa.list_(TOOL_CALL))})
        np.testing.assert_array_equal(max_same_tool_streak(table, params), want_streak)
        np.testing.assert_array_equal(leak(table, params), want_leak)
    backwards = pa.table({"tool_calls": pa.array(rows[::-1], pa.list_(TOOL_CALL))})
    np.testing.assert_array_equal(max_same_tool_streak(backwards, params), want_streak[::-1])
    np.testing.assert_array_equal(leak(backwards, params), want_leak[::-1])


def test_tool_call_analyzers_skip_the_calls_behind_a_null_list():
    import pyarrow as pa

    from evotrainer.diagnosis.analyzers import leak, max_same_tool_streak
    from evotrainer.evidence.schema import TOOL_CALL

    # Arrow lets a null list own a non-empty slice of the values; those calls are not calls.
    values = pa.array(
        [{"name": n, "args": ""} for n in ("bash", "reveal", "reveal", "reveal", "bash")],
        TOOL_CALL,
    )
    calls = pa.ListArray.from_arrays(
        pa.array([0, 1, 4, 5], pa.int32()), values, mask=pa.array([False, True, False])
    )
    table = pa.table({"tool_calls": calls})
    params = {"leak_tools": ["reveal"], "leak_patterns": []}
    np.testing.assert_array_equal(max_same_tool_streak(table, params), [1.0, np.nan, 1.0])
    np.testing.assert_array_equal(leak(table, params), [0.0, np.nan, 0.0])


def test_split_views_and_series_of_the_analyzer_metrics():
    # Train and val rows interleaved, steps out of order: each split sees only its rows.
    calls = _edge_calls()
    rows = [
        dict(
            split="val" if i % 3 == 0 else "train",
            step=[5, 2, 9][i % 3],
            group_id=f"g{i}",
            tool_calls=[f"{c['name'] or ''} {c['args'] or ''}".strip() for c in c_]
            if c_ is not None
            else None,
        )
        for i, c_ in enumerate(calls)
    ]
    table = rollout_table(rows)
    params = {"leak_tools": ["reveal"], "leak_patterns": [r"\bgit (log|show|reflog|blame)\b"]}
    d = diagnose(table, None, H0)
    for name, split, fn in (
        ("max_same_tool_streak_mean", "train", lambda c: _streak_by_hand(c)),
        ("leak_ratio", "train", lambda c: _leak_by_hand(c, ["reveal"], params["leak_patterns"])),
        ("val_leak_ratio", "val", lambda c: _leak_by_hand(c, ["reveal"], params["leak_patterns"])),
    ):
        per_step: dict[int, list[float]] = {}
        for r in table.to_pylist():
            if r["split"] == split and not math.isnan(v := fn(r["tool_calls"])):
                per_step.setdefault(r["step"], []).append(v)
        values = [v for vs in per_step.values() for v in vs]
        assert d["metrics"][name] == pytest.approx(np.mean(values)), name
        if name in d["series"]:
            assert d["series"][name] == [
                [s, pytest.approx(np.mean(vs))] for s, vs in sorted(per_step.items())
            ]


def _examples_by_full_query(table, where, split, revision, limit=5):
    from evotrainer.diagnosis.diagnose import ROLLOUT_ID_SQL
    from evotrainer.diagnosis.sql import ReadOnlyQuery

    connection = ReadOnlyQuery(table, None, split)
    try:
        _, rows = connection.query(
            f"SELECT {ROLLOUT_ID_SQL} FROM rollouts WHERE ({where}) "
            f"ORDER BY step DESC, seed, group_id, sample_idx LIMIT {limit}",
            revision.params,
            field="test",
        )
    finally:
        connection.close()
    return [r[0] for r in rows]


@pytest.mark.parametrize("harness", ["h0", "h1"])
@pytest.mark.parametrize("leaky_steps", [range(1, 41), range(1, 4), range(38, 41), [20]])
def test_alert_examples_equal_the_full_query(leaky_steps, harness):
    # Examples are looked up in the latest steps first; wherever the matches are, the answer
    # must be the full query's.
    rows = []
    for step in range(1, 41):
        for g in range(4):
            for i in range(2):
                leaky = step in leaky_steps and (g + i) % 3 == 0
                rows.append(
                    dict(
                        step=step,
                        group_id=f"g{g}",
                        sample_idx=i,
                        reward=float(i),
                        tool_calls=["bash git log -2"] * 3 if leaky else ["bash ls"],
                        turns=70 if leaky else 3,
                        correct=0.0,
                        reward_components=[("tampered", float(leaky))],
                    )
                )
    table = rollout_table(rows)
    revision = resolve_harness(harness)
    run = _Run(table, None, revision, 60.0)
    try:
        for alert in revision.alerts:
            if alert.sample_where is None:
                continue
            metric = revision.metric(alert.metric)
            split = alert.sample_split or metric.split
            want = _examples_by_full_query(
                table, alert.sample_where, None if split == "all" else split, revision
            )
            assert run._examples(alert, metric) == want, alert.name
            if alert.name in ("leak", "echo_trap", "tampering"):
                assert want
    finally:
        run.close()


def test_table_digest_is_the_hash_of_the_ipc_stream_and_ignores_chunking():
    import hashlib

    import pyarrow as pa

    from evotrainer.evidence.io import table_digest

    table = rollout_table(_tiny()[0])

    def by_definition(*tables):
        outer = hashlib.sha256()
        for t in tables:
            if t is None:
                outer.update(b"none\n")
                continue
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, t.schema) as writer:
                writer.write_table(t.combine_chunks())
            outer.update(hashlib.sha256(sink.getvalue()).digest())
        return "sha256:" + outer.hexdigest()

    rechunked = pa.concat_tables([table.slice(0, 5), table.slice(5)])
    assert table_digest(table, None) == by_definition(table, None)
    assert table_digest(rechunked, None) == table_digest(table, None)
    assert table_digest(table.slice(0, 0)) == by_definition(table.slice(0, 0))
    assert table_digest(table.slice(1)) != table_digest(table)


def test_tool_call_analyzers_equal_the_definition_on_hostile_calls():
    import pyarrow as pa

    from evotrainer.diagnosis.analyzers import leak, max_same_tool_streak
    from evotrainer.evidence.schema import TOOL_CALL

    huge = "x" * 1_000_000 + " git log"
    rows = [
        [{"name": "bash", "args": huge}, {"name": "bash", "args": huge}],  # 1 MB args, a leak
        [{"name": "выполнить", "args": "git show ✓"}, {"name": "выполнить", "args": None}],
        [{"name": None, "args": "git reflog"}, {"name": "", "args": "gitreflog"}],
        None,
        [],
        [{"name": "reveal", "args": "🙂"}] * 3,
        [{"name": "bash", "args": "ls"}, {"name": "выполнить", "args": "ls"}],
    ]
    params = {"leak_tools": ["reveal"], "leak_patterns": [r"\bgit (log|show|reflog|blame)\b"]}
    want_streak = [_streak_by_hand(c) for c in rows]
    want_leak = [_leak_by_hand(c, ["reveal"], params["leak_patterns"]) for c in rows]
    # Chunks whose dictionaries list the same names in other orders must decode alike.
    for cut in ([len(rows)], [1, 2, 4], [3, 4], [1] * len(rows)):
        chunks, order, at = [], [], 0
        for n in cut:
            segment = list(range(at, at + n))[::-1]  # each chunk reversed
            chunks.append(pa.array([rows[i] for i in segment], pa.list_(TOOL_CALL)))
            order += segment
            at += n
        table = pa.table({"tool_calls": pa.chunked_array(chunks, pa.list_(TOOL_CALL))})
        np.testing.assert_array_equal(
            max_same_tool_streak(table, params), [want_streak[i] for i in order]
        )
        np.testing.assert_array_equal(leak(table, params), [want_leak[i] for i in order])
