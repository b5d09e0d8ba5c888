"""What verl lets our reward function see of a multi-turn episode reaches the score and the
dumps: the tool calls in the transcript (verl's `hermes` format, the default of its tool
agent loop) and verl's turn count, which used to be dropped (`tool_calls=[]`).

Real: our reward module as verl calls it, the dump line `_dump_generations` writes from its
returned keys, and our ingest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from evotrainer.backends.verl_reward import compute_score
from evotrainer.domains import Task, make_domain
from evotrainer.evidence.hermes import hermes_tool_calls
from evotrainer.evidence.verl import ingest_dump


def first_task(domain: str, tmp_path: Path) -> tuple[Task, Path]:
    """A train task of `domain` and the reward config our render writes for it."""
    domain_config = {"name": domain, "train_size": 2, "val_size": 1}
    config = tmp_path / "reward.json"
    config.write_text(json.dumps(
        {"domain": domain_config, "reward": {"components": [{"name": "correctness"}]}}))
    return make_domain(domain_config).split(2, 1)[0][0], config


def hermes(name: str, arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_hermes_calls_are_recorded_as_the_domains_record_theirs():
    transcript = (
        "I will compare first." + hermes("compare", {"guess": 37}) + "\n<\n"
        + hermes("shell", {"command": "git log -p"}) + "\nlog\n"
        + hermes("reveal", {}) + "\n31\n"
        + hermes("write", {"path": "a.py", "content": "x = 1\n"})
        + "<tool_call>{not json</tool_call>"
    )
    assert hermes_tool_calls(transcript) == [
        {"name": "compare", "args": "37"},
        {"name": "shell", "args": "git log -p"},
        {"name": "reveal", "args": ""},
        {"name": "write", "args": json.dumps({"content": "x = 1\n", "path": "a.py"},
                                              sort_keys=True)},
        {"name": "invalid", "args": "{not json"},
    ]
    assert hermes_tool_calls("no calls here, just an answer =31;") == []


def test_a_multi_turn_episode_carries_its_calls_and_turns_into_the_dump(tmp_path: Path):
    task, config = first_task("toolenv", tmp_path)
    transcript = hermes("compare", {"guess": 40}) + hermes("reveal", {}) + f"={task.answer};"
    # What verl's reward manager hands over: the row's extra_info, plus num_turns (numpy).
    extra_info = {"task_id": task.task_id, "question": task.prompt, "index": np.int64(0),
                  "meta": json.dumps(task.meta), "num_turns": np.int64(5)}
    extras = compute_score(task.data_source, transcript, task.answer, extra_info=extra_info,
                           config_path=str(config))
    assert json.loads(extras["tool_calls"]) == [{"name": "compare", "args": "40"},
                                                {"name": "reveal", "args": ""}]
    assert extras["num_turns"] == 5 and extras["index"] == "0"
    line = {"input": task.prompt, "output": transcript, "gts": task.answer,
            "score": extras["score"], "step": 1, **extras}  # as _dump_generations writes it
    folder = tmp_path / "dump"
    folder.mkdir()
    (folder / "1.jsonl").write_text(json.dumps(line) + "\n")
    row = ingest_dump(folder, version="v", split="val", group_size=1).rollouts.to_pylist()[0]
    assert row["tool_calls"] == [{"name": "compare", "args": "40"},
                                 {"name": "reveal", "args": ""}]  # the leak audit sees it
    assert row["turns"] == 5 and row["task_id"] == task.task_id


def test_a_single_turn_domain_adds_no_tool_keys(tmp_path: Path):
    task, config = first_task("arith", tmp_path)
    extras = compute_score(task.data_source, task.answer, task.answer, extra_info={
        "task_id": task.task_id, "question": task.prompt, "index": 3, "num_turns": 2,
    }, config_path=str(config))
    assert "tool_calls" not in extras and "num_turns" not in extras
    assert extras["acc"] == 1.0 and extras["index"] == "3"
