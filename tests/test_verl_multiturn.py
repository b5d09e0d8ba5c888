"""Multi-turn domains on verl: toolenv and swe run as verl tools, the reward
scores the calls that really ran, and the Dual-Level filter's level 1 marks trajectories.

Real: the job's files as `prepare` writes them (data with tools_kwargs, tools.yaml, reward
config), verl 0.9.1's own tool loader (`initialize_tools_from_config`, which imports our tool
class by its dotted name and validates each schema with verl's pydantic models), our tool's
`execute`, our reward module as verl's naive reward manager calls it (extra_info updated with
the trajectory's extra_fields), the domains' environments and scoring (swe in the local
sandbox), and our ingest.
Stand-in: verl's AgentData, whose module imports `datasets` and PIL (not installed here): a
namespace with the two attributes verl's tool agent loop gives every trajectory
(`tools_kwargs` from the dataset row, `extra_fields`).
"""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from evotrainer.backends.base import JobSpec, job_id
from evotrainer.backends.verl import prepare
from evotrainer.backends.verl_episode import max_tool_reply
from evotrainer.backends.verl_render import JobFiles
from evotrainer.backends.verl_reward import compute_score
from evotrainer.evidence.verl import ingest_dump
from evotrainer.store.recipe import BASE_RECIPE, deep_merge, digest

registry = pytest.importorskip(
    "verl.tools.tool_registry", reason="needs `pip install --no-deps verl==0.9.1`"
)


def prepared(tmp_path: Path, overrides: dict) -> tuple[JobFiles, list[dict], list[dict]]:
    """The job's files for a verl recipe, and its train and val rows as verl's dataset reads
    them."""
    recipe = deep_merge(
        BASE_RECIPE,
        deep_merge(
            {
                "backend": "verl",
                "model": {"path": "/models/not-loaded"},
                "grpo": {"group_size": 2, "prompts_per_step": 2, "eval_k": 2},
            },
            overrides,
        ),
    )
    job = JobSpec(
        job_id=job_id("v1", 1, digest(recipe)),
        version="v1",
        recipe=recipe,
        workdir=tmp_path / "worktree",
        artifact_dir=tmp_path / "artifacts",
        env={},
    )
    prepare(job)
    files = JobFiles(job.artifact_dir)
    return (files, pq.read_table(files.train_file).to_pylist(),
            pq.read_table(files.val_file).to_pylist())


def load_tools(files: JobFiles) -> dict[str, Any]:
    loaded = registry.initialize_tools_from_config(str(files.tool_config))
    return {tool.name: tool for tool in loaded}


def trajectory(row: dict) -> types.SimpleNamespace:
    """What verl's tool agent loop hands a tool for one trajectory of this dataset row."""
    return types.SimpleNamespace(tools_kwargs=row["extra_info"]["tools_kwargs"], extra_fields={})


def run_calls(tools: dict[str, Any], agent_data: Any, calls: list[tuple[str, dict]]) -> list[str]:
    """Each call as verl's `_call_tool` makes it (create, execute with the agent data,
    release); the observations the model sees."""

    async def run() -> list[str]:
        replies = []
        for name, arguments in calls:
            tool = tools[name]
            instance, _ = await tool.create(create_kwargs={})
            response, reward, _ = await tool.execute(instance, arguments, agent_data=agent_data)
            await tool.release(instance)
            assert reward == 0.0
            replies.append(response.text)
        return replies

    return asyncio.run(run())


def score(files: JobFiles, row: dict, agent_data: Any, text: str = "", turns: int = 0) -> dict:
    """Our reward as verl's naive manager calls it: the row's extra_info updated with the
    trajectory's extra_fields, plus verl's num_turns (numpy)."""
    info = {**row["extra_info"], **agent_data.extra_fields, "num_turns": np.int64(turns)}
    return compute_score(row["data_source"], text, row["reward_model"]["ground_truth"],
                         extra_info=info, config_path=str(files.reward_config))


def test_toolenv_runs_as_verl_tools_and_the_leak_reaches_the_dump(tmp_path: Path):
    files, train, _ = prepared(tmp_path, {"domain": {"name": "toolenv", "train_size": 4,
                                                     "val_size": 2}})
    config = json.loads(files.tool_config.read_text())
    assert [t["tool_schema"]["function"]["name"] for t in config["tools"]] == [
        "compare", "reveal", "answer"]
    tools = load_tools(files)
    assert {type(t).__name__ for t in tools.values()} == {"EvoDomainTool"}
    assert tools["compare"].tool_schema.function.parameters.required == ["guess"]
    row = train[0]
    task = json.loads(row["extra_info"]["tools_kwargs"]["compare"]["create_kwargs"]["task"])
    hidden, lo, hi = int(task["answer"]), task["meta"]["lo"], task["meta"]["hi"]
    mid = (lo + hi) // 2
    reply = "<" if hidden < mid else ">" if hidden > mid else "="
    agent_data = trajectory(row)
    observed = run_calls(tools, agent_data, [("compare", {"guess": mid}), ("reveal", {}),
                                             ("answer", {"number": hidden}),
                                             ("compare", {"guess": 1})])
    assert observed == [f"{reply};", f"{hidden};", "", "The episode is over: answer without "
                        "calling a tool."]
    assert all(len(text) <= max_tool_reply({"name": "toolenv"}) for text in observed)
    record = agent_data.extra_fields["evo_episode"]
    # The transcript the embedded engine writes for the same actions, and its recorded calls.
    assert record["transcript"] == f"?{mid};{reply};!;{hidden};={hidden};"
    assert record["tool_calls"] == [{"name": "compare", "args": str(mid)},
                                    {"name": "reveal", "args": ""}]
    assert (record["turns"], record["done"]) == (3, True)
    extras = score(files, row, agent_data, text="decoded text the reward no longer parses", turns=7)
    assert extras["acc"] == 1.0 and extras["correctness"] == 1.0
    assert json.loads(extras["tool_calls"]) == record["tool_calls"]
    assert extras["num_turns"] == 7 and "evo_excluded" not in extras  # no dual_level here
    # As _dump_generations writes the line: the leak audit sees the reveal after ingest.
    folder = tmp_path / "dump"
    folder.mkdir()
    line = {"input": row["extra_info"]["question"], "output": "…", "gts": task["answer"],
            "score": extras["score"], "step": 1, **extras}
    (folder / "1.jsonl").write_text(json.dumps(line) + "\n")
    ingested = ingest_dump(folder, version="v", split="train", group_size=1).rollouts.to_pylist()
    assert ingested[0]["tool_calls"] == record["tool_calls"] and ingested[0]["turns"] == 7


def test_a_disabled_tool_is_answered_and_recorded_as_in_the_engine(tmp_path: Path):
    files, train, _ = prepared(tmp_path, {
        "domain": {"name": "toolenv", "train_size": 4, "val_size": 2},
        "environment": {"tools": [{"name": "reveal", "enabled": False}]},
    })
    agent_data = trajectory(train[1])
    assert run_calls(load_tools(files), agent_data, [("reveal", {})]) == ["x;"]
    record = agent_data.extra_fields["evo_episode"]
    assert record["tool_calls"] == [{"name": "unavailable", "args": "reveal"}]


def test_dual_level_marks_echo_traps_and_abandonment_on_train_rows_only(tmp_path: Path):
    files, train, val = prepared(tmp_path, {
        "domain": {"name": "toolenv", "train_size": 4, "val_size": 2},
        "group_filter": {"name": "dual_level", "params": {"echo_min_repeats": 4}},
        "reward": {"components": [{"name": "correctness"}, {"name": "no_repeat"}]},
    })
    # The job's sampler is the dual-level buffer, which drops the sessions marked here.
    dual = Path(__file__).parents[1] / "evotrainer" / "backends" / "verl_dual_sampler.py"
    assert files.sampler_module.read_text() == dual.read_text()
    tools = load_tools(files)
    row = train[0]
    task = json.loads(row["extra_info"]["tools_kwargs"]["answer"]["create_kwargs"]["task"])
    wrong = int(task["answer"]) + 1
    echo = trajectory(row)
    run_calls(tools, echo, [("compare", {"guess": 40})] * 4 + [("answer", {"number": wrong})])
    extras = score(files, row, echo)
    # Hand-computed: actions ?40 ×4, =wrong: 3 repeats of 5 actions, no_repeat 1 - 3/5.
    assert extras["no_repeat"] == pytest.approx(0.4) and extras["acc"] == 0.0
    assert (extras["evo_excluded"], extras["evo_exclusion"]) == (1.0, "echo_trap")
    # A guess that is no number is the domain's invalid action: no call is recorded, so one
    # turn with no action on the task is an abandonment.
    lost = trajectory(row)
    assert run_calls(tools, lost, [("compare", {"guess": "forty"})]) == ["x;"]
    extras = score(files, row, lost)
    assert (extras["evo_excluded"], extras["evo_exclusion"]) == (1.0, "abandonment")
    honest = trajectory(row)
    run_calls(tools, honest, [("compare", {"guess": 40}), ("answer", {"number": wrong})])
    assert score(files, row, honest)["evo_excluded"] == 0.0
    # Validation rows are scored, never filtered: no marks (their dumps keep verl's columns).
    val_row = val[0]
    extras = score(files, val_row, trajectory(val_row))
    assert "evo_excluded" not in extras and "evo_exclusion" not in extras


def test_swe_leak_runs_in_the_sandbox_through_verl_tools(tmp_path: Path):
    """The paper's Git leak on verl: `git show HEAD~1` restores the reverted fix, the tests
    pass, and the shell command reaches the dump for the leak audit; with clear_git_log the
    history is gone and the same calls fail."""
    params = {"max_solution_lines": 1, "max_observation_chars": 200}
    calls = [("shell", {"command": "git show HEAD~1:solution.py>solution.py"}), ("submit", {})]
    outcomes = {}
    for clear in (False, True):
        files, train, _ = prepared(tmp_path / str(clear), {
            "domain": {"name": "swe", "train_size": 2, "val_size": 1,
                       "params": {**params, "clear_git_log": clear}},
        })
        assert [t["tool_schema"]["function"]["name"]
                for t in json.loads(files.tool_config.read_text())["tools"]] == [
            "shell", "write", "patch", "submit"]
        agent_data = trajectory(train[0])
        run_calls(load_tools(files), agent_data, calls)
        record = agent_data.extra_fields["evo_episode"]
        assert record["tool_calls"][0] == {"name": "shell",
                                           "args": "git show HEAD~1:solution.py>solution.py"}
        assert record["transcript"].startswith("$ git show HEAD~1:solution.py>solution.py`")
        extras = score(files, train[0], agent_data)
        assert extras["submitted"] == 1.0
        outcomes[clear] = extras["acc"]
    assert outcomes == {False: 1.0, True: 0.0}


def test_v1_train_dumps_give_calls_from_the_text_and_marks_stay_out_of_the_reward(
    tmp_path: Path,
):
    """A V1 train dump keeps no reward extra: the calls come from the hermes markup verl
    leaves in `output`. A legacy or validation dump's level-1 marks go to `extra`."""
    folder = tmp_path / "train"
    folder.mkdir()
    call = '<tool_call>\n{"name": "compare", "arguments": {"guess": 40}}\n</tool_call>'
    lines = [
        {"input": "0-31:", "output": f"{call}\nuser\n<;\nassistant\n", "gts": "3", "score": 0.0,
         "step": 1, "uid": "abc_0_0"},
        {"input": "0-31:", "output": "31", "gts": "3", "score": 0.0, "step": 1,
         "uid": "abc_1_0"},
    ]
    (folder / "1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows = ingest_dump(folder, version="v", split="train").rollouts.to_pylist()
    assert rows[0]["tool_calls"] == [{"name": "compare", "args": "40"}]
    assert rows[1]["tool_calls"] is None  # no markup: unknown, not "no calls"
    marked = tmp_path / "val"
    marked.mkdir()
    line = {"input": "q", "output": "a", "gts": "1", "score": 1.0, "step": 1, "acc": 1.0,
            "correctness": 1.0, "evo_excluded": 1.0, "evo_exclusion": "idle", "index": "0"}
    (marked / "1.jsonl").write_text(json.dumps(line) + "\n")
    row = ingest_dump(marked, version="v", split="val").rollouts.to_pylist()[0]
    assert dict(row["reward_components"]) == {"correctness": 1.0}
    assert json.loads(row["extra"])["evo_exclusion"] == "idle"
    assert json.loads(row["extra"])["evo_excluded"] == 1.0
