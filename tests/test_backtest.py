"""Backtests replay stored rollouts: reward re-scoring rescues dead groups, filter replay
matches the engine's step-by-step use of the filter, and the CLI resolves a version's run."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sealing import controller_commit

from evotrainer.contract.filters import StdGroupFilter
from evotrainer.control.versions import new_version
from evotrainer.domains import make_domain
from evotrainer.errors import EvoError
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.skills.replay import (
    backtest_filter,
    backtest_reward,
    component_values,
    skill_filter,
    skill_reward,
)
from evotrainer.skills.skill import load_library
from evotrainer.store.recipe import BASE_RECIPE
from evotrainer.store.specs import dump

LIBRARY = load_library()


def row(group: str, reward: float, *, step: int = 1, seed: int = 0, split: str = "train",
        components: dict[str, float] | None = None, correct: float | None = None,
        task_id: str = "t", response: str = "") -> dict:
    return {"version": "v1", "seed": seed, "step": step, "split": split, "task_id": task_id,
            "data_source": "test", "group_id": group, "sample_idx": 0, "prompt": "",
            "response": response, "reward": reward,
            "reward_components": list((components or {}).items()),
            "correct": reward if correct is None else correct, "response_tokens": 1,
            "truncated": False, "finish_reason": "stop", "turns": 1, "tool_calls": [],
            "mean_logprob": -0.5, "extra": "{}"}


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def scored_groups() -> pa.Table:
    """Four groups of 4: all correct, all wrong with varying `partial` (rescuable), all wrong
    with equal `partial`, and one alive group."""
    rows = []
    layouts = {"solved": ([1.0] * 4, [1.0] * 4), "near": ([0.0] * 4, [0.2, 0.5, 0.9, 0.5]),
               "far": ([0.0] * 4, [0.0] * 4), "alive": ([1.0, 0.0, 1.0, 0.0], [1, 0.5, 1, 0.3])}
    for group, (rewards, partial) in layouts.items():
        rows += [row(group, r, components={"correctness": r, "partial": p})
                 for r, p in zip(rewards, partial, strict=True)]
    rows.append(row("far", 0.0, split="val"))  # other splits are left out
    return table(rows)


def test_reward_backtest_counts_rescued_dead_groups() -> None:
    report = backtest_reward(scored_groups(), "partial", 0.1)
    assert report["component_source"] == "recorded"
    assert (report["rollouts"], report["groups"]) == (16, 4)
    assert (report["dead_groups_before"], report["dead_groups_after"]) == (3, 2)
    assert report["dead_group_ratio_before"] == 0.75 and report["dead_group_ratio_after"] == 0.5
    assert report["rescued_groups"] == 1 and report["rescue_ratio"] == pytest.approx(1 / 3)
    assert report["killed_groups"] == 0
    assert report["reward_spread_after"] > report["reward_spread_before"]
    assert report["reward_mean_after"] == pytest.approx(report["reward_mean_before"] + 0.1 * (
        report["component_mean"]))
    assert -1 <= report["component_correct_corr"] <= 1
    assert all(isinstance(v, (int, float, str, type(None))) for v in report.values())
    json.dumps(report)  # embeddable as is


def test_reward_backtest_recomputes_unrecorded_components_with_the_domain() -> None:
    cfg = {**BASE_RECIPE["domain"], "train_size": 8, "val_size": 4}
    domain = make_domain(cfg)
    train, _ = domain.split(8, 4)
    rows = []  # rewards recorded as 0: partial (1 for the exact answer, 0 for "x") revives them
    for g, task in enumerate(train[:3]):
        for response in (task.answer, str(int(task.answer) + 1), "x"):
            rows.append(row(f"g{g}", 0.0, task_id=task.task_id, response=response, correct=0.0))
    rollouts = table(rows)
    values, source = component_values(rollouts, "partial", cfg)
    assert source == "recomputed"
    expected = [domain.score(t, r, []).components["partial"]
                for t in train[:3] for r in (t.answer, str(int(t.answer) + 1), "x")]
    assert values.tolist() == pytest.approx(expected)
    report = backtest_reward(rollouts, "partial", 0.1, cfg)
    assert report["dead_groups_before"] == 3 and report["rescued_groups"] == 3
    assert report["component_correct_corr"] is None  # correctness has no spread

    with pytest.raises(EvoError, match="no domain was named"):
        backtest_reward(rollouts, "partial", 0.1)
    with pytest.raises(EvoError, match="no reward component 'judge'"):
        backtest_reward(rollouts, "judge", 0.1, cfg)
    with pytest.raises(EvoError, match="not among the domain's tasks"):
        backtest_reward(table([row("g", 0.0, task_id="arith:1+1")] * 2), "partial", 0.1, cfg)


def test_reward_backtest_rejects_an_empty_split() -> None:
    with pytest.raises(EvoError, match="no 'val' rollouts"):
        backtest_reward(table([row("g", 1.0)] * 2), "partial", 0.1, split="val")


def random_run(seeds: int = 2, steps: int = 12, groups: int = 4) -> tuple[pa.Table, dict]:
    """Rows written in shuffled order; returns the table and each seed's batches in step order."""
    rng = random.Random(0)
    rows, batches = [], {}
    for seed in range(seeds):
        for step in range(1, steps + 1):
            batch = []
            for g in range(groups):
                rewards = [float(rng.random() < 0.5) * rng.choice([1.0, 0.5]) for _ in range(4)]
                batch.append(np.array(rewards))
                rows += [row(f"s{seed}-t{step}-g{g}", r, step=step, seed=seed) for r in rewards]
            batches.setdefault(seed, []).append(batch)
    # Groups stay in write order within a step; steps and seeds get interleaved.
    chunks = [rows[i:i + 4 * groups] for i in range(0, len(rows), 4 * groups)]
    rng.shuffle(chunks)
    return table([r for chunk in chunks for r in chunk]), batches


def test_filter_backtest_replays_like_the_engine() -> None:
    rollouts, batches = random_run()
    params = {"keep_ratio": 0.9, "ema_decay": 0.2}
    report = backtest_filter(rollouts, "std_group_filter", params)
    kept = 0
    thresholds = []
    for seed_batches in batches.values():  # one fresh filter per seed, steps in order
        f = StdGroupFilter(**params)
        kept += sum(int(f.keep(batch).sum()) for batch in seed_batches)
        thresholds.append(f.threshold())
    assert report["kept_groups"] == kept
    assert (report["runs"], report["steps"], report["groups"]) == (2, 24, 96)
    assert report["final_threshold"] == pytest.approx(float(np.mean(thresholds)))
    assert report["params"]["min_keep_ratio"] == 0.5  # defaults filled in
    assert report["dead_group_ratio_after"] == 0.0
    assert report["reward_spread_after"] > report["reward_spread_before"]
    assert 0 < report["keep_ratio_min_step"] <= report["keep_ratio"] <= 1


def test_zero_std_filter_keeps_exactly_the_live_groups() -> None:
    report = backtest_filter(scored_groups(), "zero_std")
    assert report["keep_ratio"] == pytest.approx(1 - report["dead_group_ratio_before"])
    assert report["final_threshold"] is None
    none = backtest_filter(scored_groups(), "none")
    assert none["keep_ratio"] == 1.0 and none["dead_group_ratio_after"] == 0.75


def test_filter_backtest_rejects_unknown_filters_and_parameters() -> None:
    with pytest.raises(EvoError, match="unknown group filter"):
        backtest_filter(scored_groups(), "magic")
    with pytest.raises(EvoError, match="no parameter 'keep'"):
        backtest_filter(scored_groups(), "std_group_filter", {"keep": 0.5})


def test_skills_name_their_backtest() -> None:
    assert skill_reward(LIBRARY["aux-continuous-reward"]) == ("partial", 0.1)
    name, params = skill_filter(LIBRARY["std-group-filter"])
    assert name == "std_group_filter" and params["keep_ratio"] == 0.9
    assert skill_filter(LIBRARY["zero-std-filter"]) == ("zero_std", {})
    with pytest.raises(EvoError, match="installs no group filter"):
        skill_filter(LIBRARY["kl-cap"])
    with pytest.raises(EvoError, match="no single reward component"):
        skill_reward(LIBRARY["kl-cap"])


# ------------------------------------------------------------------------------------- CLI




@pytest.fixture
def trained(workspace):
    """v1 with a run record whose artifact dir holds rollouts without a `partial` column."""
    new_version(workspace, "v1", "v0", rationale="first try")
    artifact_dir = ".evotrainer/artifacts/v1/evo-v1-a1-0123456789"
    cfg = workspace.resolved_recipe("v1")["domain"]
    train, _ = make_domain(cfg).split(cfg["train_size"], cfg["val_size"])
    rows = [row(f"g{g}", 0.0, task_id=t.task_id, response=str(int(t.answer) + d), correct=0.0,
                components={"correctness": 0.0})
            for g, t in enumerate(train[:4]) for d in (0, 1, 40, 41)]
    path = workspace.root / artifact_dir / "rollouts" / "train.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(table(rows), path)
    record = {"apiVersion": "evotrainer/v1", "kind": "Run", "version": "v1",
              "job_id": "evo-v1-a1-0123456789", "artifact_dir": artifact_dir}
    controller_commit(workspace, "v1", {"runs/v1/run.yaml": dump(record).encode()}, "run v1")
    return workspace


def test_cli_backtest_a_version_with_a_skill(trained, cli) -> None:
    out = cli("backtest", "reward", "v1", "--skill", "aux-continuous-reward", "--json",
                  cwd=trained.root)
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["component_source"] == "recomputed"  # via the version's domain
    assert report["dead_groups_before"] == 4 and report["rescue_ratio"] == 1.0
    shown = cli("backtest", "reward", "v1", "--component", "partial", "--weight", "0.1")
    assert "dead_group_ratio" in shown.output and "1.0000" in shown.output

    filtered = cli("backtest", "filter", "v1", "--skill", "std-group-filter", "--json")
    assert json.loads(filtered.output)["kept_groups"] == 0  # every group is dead
    params = cli("backtest", "filter", "v1", "--filter", "std_group_filter", "--param",
                     "keep_ratio=0.8", "--param", "mode=absolute", "--json")
    assert json.loads(params.output)["params"]["keep_ratio"] == 0.8
    assert "keep_ratio" in cli("backtest", "filter", "v1", "--filter", "zero_std").output


def test_cli_backtest_a_rollout_file_and_bad_arguments(tmp_path, cli) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(scored_groups(), path)
    out = cli("backtest", "reward", str(path), "--component", "partial", "--weight", "0.1",
                  "--json", cwd=tmp_path)
    assert json.loads(out.output)["rescued_groups"] == 1
    for args, message in (
        (["reward", str(path)], "say what to add"),
        (["reward", str(path), "--skill", "aux-continuous-reward", "--weight", "1"], "--skill"),
        (["filter", str(path)], "say which filter"),
        (["filter", str(path), "--filter", "zero_std", "--param", "oops"], "KEY=VALUE"),
        (["reward", "v9", "--component", "partial", "--weight", "1"], "workspace"),
    ):
        result = cli("backtest", *args)
        assert result.code == 1, (args, result.output)
        assert message in result.err, (args, result.err)


def test_cli_backtest_a_version_without_a_run(workspace, cli) -> None:
    result = cli("backtest", "filter", "v0", "--filter", "zero_std", cwd=workspace.root)
    assert result.code == 1 and "no run record" in result.err


def test_a_run_record_pointing_elsewhere_cannot_feed_the_backtest(trained, cli, tmp_path):
    """A record edited on the branch to name another folder is refused, and the rollouts
    planted there are never read."""
    elsewhere = tmp_path / "planted" / "rollouts"
    elsewhere.mkdir(parents=True)
    artifacts = trained.root / ".evotrainer/artifacts/v1/evo-v1-a1-0123456789"
    shutil.copy(artifacts / "rollouts/train.parquet", elsewhere / "train.parquet")
    record = {"apiVersion": "evotrainer/v1", "kind": "Run", "version": "v1",
              "job_id": "evo-v1-a1-0123456789", "artifact_dir": str(elsewhere.parent)}
    trained.git.commit_files("evo/v1", {"runs/v1/run.yaml": dump(record).encode()}, "tamper")
    out = cli("backtest", "reward", "v1", "--component", "partial", "--weight", "0.1",
              cwd=trained.root)
    assert out.exit_code == 1
    assert "artifact_dir" in out.output and "Traceback" not in out.output


def test_dual_level_backtest_excludes_anomalous_trajectories_before_the_group_test() -> None:
    """The Dual-Level filter in the backtest, as the engine applies it: idle rollouts (no action on
    the task, wrong) leave their group first. Group `c` is alive only through its idle
    members; without them it is all correct, so dual_level drops it where the group test
    alone keeps it."""
    act = [{"name": "compare", "args": "5"}]

    def multi(group: str, reward: float, acted: bool) -> dict:
        return {**row(group, reward), "turns": 3 if acted else 1,
                "tool_calls": act if acted else []}

    rows = ([multi("a", 1.0, True), multi("a", 0.0, True), multi("a", 0.0, False),
             multi("a", 0.0, False)]
            + [multi("b", 0.0, True) for _ in range(4)]
            + [multi("c", 1.0, True), multi("c", 1.0, True), multi("c", 0.0, False),
               multi("c", 0.0, False)])
    dual = backtest_filter(table(rows), "dual_level")
    assert dual["kept_groups"] == 1  # a: [1, 0] after its idle members left; b dead; c [1, 1]
    assert sum(dual["excluded_trajectories"].values()) == 4
    alone = backtest_filter(table(rows), "std_group_filter")
    assert alone["kept_groups"] == 2 and alone["excluded_trajectories"] == {}
    # A single-turn table (no calls, one turn) has no actions to miss: nothing is excluded.
    single = backtest_filter(scored_groups(), "dual_level")
    assert single["excluded_trajectories"] == {}
