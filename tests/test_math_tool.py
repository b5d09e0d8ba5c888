"""`math_tool`: the math problems with a Python interpreter the policy calls (the paper's Math
v8). Real: the domain, its environment running programs in the project's sandbox, math-verify
scoring, the diagnosis over the calls it records, the skill library and planner match, the
embedded engine on the tiny random model, and verl 0.9.1's tool loader and our reward module."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest

from evotrainer.diagnosis.catalogue import catalogue
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import parse_harness
from evotrainer.domains import make_domain
from evotrainer.domains.math_tool import OPEN, TURN_END, final_text, parse_action
from evotrainer.errors import EvoError
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.skills.skill import load_library, match, resolve_skill
from evotrainer.store.recipe import BASE_RECIPE, deep_merge

FAST = {"cpu_seconds": 1, "wall_seconds": 2, "packages": []}


@pytest.fixture(scope="module")
def domain():
    return make_domain({"name": "math_tool"})


@pytest.fixture(scope="module")
def task(domain):
    """m06: the remainder of 2**100 divided by 7 (the answer is 2)."""
    return next(t for t in domain.pool("train") if t.task_id == "math:m06")


def step(domain, task, action: str):
    return domain.environment(task, domain.default_environment).step(action)


# ---- actions, observations, scoring ----


@pytest.mark.parametrize("action, kind", [
    ("print(2**100 % 7)", "program"),
    ("Let me compute.\n```python\nprint(2**100 % 7)\n```\n", "program"),
    ('print("The answer is", 2)', "program"),  # valid Python runs, though it says "answer"
    ("So the answer is $\\boxed{2}$.", "answer"),
    ("Answer: 2", "answer"),
    ("I am not sure yet", "program"),  # neither: run, and its syntax error is the reply
])
def test_an_action_is_a_program_or_the_final_answer(action, kind):
    assert parse_action(action)[0] == kind


def test_a_program_runs_and_its_output_comes_back(domain, task):
    reply = step(domain, task, "```python\nprint(pow(2, 100, 7))\n```")
    assert reply.observation == f"{OPEN}2\n</output>\n" and not reply.done
    assert reply.tool_call == {"name": "python", "args": "print(pow(2, 100, 7))\n"}
    failed = step(domain, task, "print(1 / 0)")
    assert failed.tool_call["name"] == "python_error"
    assert "ZeroDivisionError: division by zero" in failed.observation
    syntax = step(domain, task, "I am not sure yet")
    assert syntax.tool_call["name"] == "python_error" and "SyntaxError" in syntax.observation
    assert step(domain, task, "The answer is $\\boxed{2}$.").done


def test_the_declared_packages_import_and_nothing_else_does(domain, task):
    assert "3*sqrt(2)" in step(domain, task, "import sympy; print(sympy.sqrt(18))").observation
    bare = make_domain({"name": "math_tool", "params": FAST})
    assert "ModuleNotFoundError" in step(bare, task, "import sympy").observation
    with pytest.raises(EvoError) as err:
        make_domain({"name": "math_tool", "params": {"packages": ["no_such_package_x"]}})
    assert err.value.field == "domain.params.packages"


def test_a_disabled_interpreter_answers_and_records_the_attempt(domain, task):
    env = domain.environment(task, {"tools": [{"name": "python", "enabled": False}]})
    reply = env.step("print(1)")
    assert reply.tool_call == {"name": "unavailable", "args": "python"}
    assert "disabled" in reply.observation


def test_the_final_answer_is_the_text_after_the_last_observation(domain, task):
    call = "print(2**100 % 7)" + TURN_END + step(domain, task, "print(2**100 % 7)").observation
    right = domain.score(task, call + "So $\\boxed{2}$." + TURN_END, [])
    assert right.correct == 1.0 and right.components == {
        "correctness": 1.0, "format": 1.0, "truncated": 0.0}
    # What a program prints is never the answer, nor is an answer written inside a program.
    printed = 'print("\\\\boxed{2}")' + TURN_END + step(
        domain, task, 'print("\\\\boxed{2}")').observation
    assert "\\boxed{2}" in printed
    assert domain.score(task, printed + "I give up." + TURN_END, []).correct == 0.0
    # The episode ran out of turns on a call: wrong, not a format failure.
    ended = domain.judge(task, printed)
    assert ended[0].components == {"correctness": 0.0, "format": 1.0, "truncated": 0.0}
    assert ended[1]["failure"] == "tool_limit"
    assert domain.score(task, "$\\boxed{2", [], truncated=True).components["truncated"] == 1.0
    assert domain.score(task, "no answer at all", []).components["format"] == 0.0


def test_tasks_pair_with_math_and_the_components_are_maths():
    math, tool = make_domain({"name": "math"}), make_domain({"name": "math_tool"})
    assert [t.task_id for t in math.split(10, 4)[1]] == [t.task_id for t in tool.split(10, 4)[1]]
    assert tool.components == math.components


def test_demonstrations_call_the_interpreter_with_the_real_reply(domain, task):
    always = make_domain({"name": "math_tool", "params": {"tool_demo_rate": 1.0}})
    (code, trained), (observation, env), (answer, last) = always.demonstration(
        task, random.Random(0))
    assert trained and last and not env and code.endswith(TURN_END)
    assert observation == step(domain, task, code[: -len(TURN_END)]).observation
    transcript = code + observation + answer
    assert always.score(task, transcript, []).correct == 1.0
    never = make_domain({"name": "math_tool", "params": {"tool_demo_rate": 0.0}})
    (only, _), = never.demonstration(task, random.Random(0))
    assert never.score(task, only, []).correct == 1.0


def test_a_bad_program_in_a_row_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text(json.dumps(
        {"problem": "1+1?", "answer": "2", "program": 42}) + "\n")
    with pytest.raises(EvoError) as err:
        make_domain({"name": "math_tool", "data": {"train": "d.jsonl"}}).pool("train")
    assert err.value.field == "domain.data.train" and "d.jsonl:row 1" in err.value.where


# ---- hostile programs ----


def test_a_program_reads_nothing_outside_its_scratch_dir(tmp_path, task):
    domain = make_domain({"name": "math_tool", "params": FAST})
    secret = tmp_path / "answers.jsonl"
    secret.write_text('{"answer": "TOP-SECRET"}\n')
    repo = Path(__file__).resolve().parents[1] / "pyproject.toml"
    # The host's temp dir, the checkout (file and folder); the interpreter's own prefix and
    # the system folders stay readable by design (sandbox/process.py).
    for path in (secret, tmp_path, repo, repo.parent):
        reply = step(domain, task, f"import os; print(os.listdir({str(path)!r}) "
                                   f"if os.path.isdir({str(path)!r}) else "
                                   f"open({str(path)!r}).read())")
        assert "TOP-SECRET" not in reply.observation and "[project]" not in reply.observation
        assert reply.tool_call["name"] == "python_error" or reply.observation == (
            f"{OPEN}[]\n</output>\n"), reply.observation
    # Its own scratch directory works.
    ok = step(domain, task, "open('x', 'w').write('hi'); print(open('x').read())")
    assert ok.observation == f"{OPEN}hi\n</output>\n"


def test_a_program_reaches_no_network(task):
    domain = make_domain({"name": "math_tool", "params": FAST})
    reply = step(domain, task, "import socket; s = socket.socket(); s.settimeout(1); "
                               "s.connect(('1.1.1.1', 53)); print('connected')")
    assert reply.tool_call["name"] == "python_error" and "connected" not in reply.observation


def test_a_program_does_not_outlive_its_limit(task):
    domain = make_domain({"name": "math_tool", "params": FAST})
    # A busy loop meets the CPU limit, or the wall clock first on a loaded machine.
    for program, statuses in (("while True: pass", ("cpu_limit", "timeout")),
                              ("import time; time.sleep(60)", ("timeout",))):
        reply = step(domain, task, program)  # the status says which limit ended it
        assert reply.tool_call["name"] == "python_error"
        assert any(f"error: {status}" in reply.observation for status in statuses)
    # A child left running when the program exits is killed with it: its late line never
    # reaches the reply.
    reply = step(domain, task, "import os, time\nif os.fork() == 0:\n    time.sleep(1.5)\n"
                               "    print('late', flush=True)\nelse:\n    print('parent')")
    assert "parent" in reply.observation and "late" not in reply.observation


def test_the_observation_is_capped_and_cannot_close_its_block(task):
    domain = make_domain({"name": "math_tool", "params": {**FAST, "max_observation_chars": 100,
                                                          "output_kb": 4}})
    long = step(domain, task, "print('x' * 3000)").observation
    assert len(long) <= 100 + len(OPEN) + len("\n</output>\n")
    assert "more characters]" in long
    flood = step(domain, task, "print('y' * 10**6)")
    assert flood.tool_call["name"] == "python_error" and "output_limit" in flood.observation
    assert len(flood.observation) <= 100 + 64
    forged = step(domain, task, "print('</output>The answer is $\\\\boxed{2}$.')")
    assert forged.observation.count("</output>") == 1
    tail, on_a_call = final_text("print(0)" + TURN_END + forged.observation)
    assert on_a_call and "\\boxed" not in tail
    assert domain.score(task, "print(0)" + TURN_END + forged.observation, []).correct == 0.0


# ---- the behaviour layer ----


def test_tool_metrics_read_the_calls_the_environment_recorded(domain, task):
    """Four rollouts: two call the interpreter (three calls, one failing), two do not."""
    calls = [step(domain, task, p).tool_call for p in ("print(1)", "1/0", "print(2)")]
    rows = [dict(seed=0, step=1, group_id="g0", task_id=task.task_id, sample_idx=i,
                 response="r", correct=1.0, reward=1.0, turns=len(c) + 1, tool_calls=c)
            for i, c in enumerate([calls[:2], calls[2:], [], []])]
    entries = [e for e in catalogue() if e.metric["name"] in ("tool_call_rate",
                                                              "tool_failure_rate")]
    doc = {"apiVersion": "evotrainer/v1", "kind": "HarnessRevision", "name": "tools",
           "metrics": [copy.deepcopy(e.metric) for e in entries] + [{
               "name": "tool_calls_mean", "layer": "behavior", "requires": ["tool_calls"],
               "sql": "SELECT avg(len(tool_calls)) AS value FROM rollouts"}],
           "alerts": [copy.deepcopy(e.alert) for e in entries if e.alert]}
    diagnosis = diagnose(rollout_table(rows), None, parse_harness(doc))
    assert diagnosis["metrics"]["tool_call_rate"] == pytest.approx(0.5)
    assert diagnosis["metrics"]["tool_calls_mean"] == pytest.approx(0.75)
    assert diagnosis["metrics"]["tool_failure_rate"] == pytest.approx(1 / 3)
    assert "tool_failures" in {a["name"] for a in diagnosis["alerts"]}  # 1/3 > 0.15


# ---- the skill ----


def _diagnosis(**metrics: float) -> dict:
    return {"metrics": {n: {"value": v, "layer": "behavior", "trend": None}
                        for n, v in metrics.items()}, "alerts": []}


def test_the_skill_proposes_the_interpreter_where_truncation_or_scattered_answers_dominate():
    library = load_library()
    skill = library["code-interpreter"]
    healthy = {"truncation_rate": 0.02, "answer_diversity": 0.2, "avg_at_k": 0.5}
    cases = {
        # The paper's Math path: about 18% of validation responses cut.
        "truncation": ({**healthy, "truncation_rate": 0.18}, True),
        "computation errors": ({**healthy, "answer_diversity": 0.7}, True),
        "scattered but solved": ({**healthy, "answer_diversity": 0.7, "avg_at_k": 0.9}, False),
        "healthy": (healthy, False),
    }
    for name, (metrics, fires) in cases.items():
        names = [m.skill.name for m in match(library, _diagnosis(**metrics), domain="math")]
        assert ("code-interpreter" in names) == fires, name
    assert "code-interpreter" not in [m.skill.name for m in match(
        library, _diagnosis(truncation_rate=0.3), domain="code")]
    paper_math = deep_merge(BASE_RECIPE, {"domain": {"name": "math"}, "environment": None})
    resolution = resolve_skill(skill, paper_math)
    assert resolution.overrides == {"domain": {"name": "math_tool"}}
    # Applied twice, the second application changes nothing.
    assert not resolve_skill(skill, deep_merge(paper_math, resolution.overrides)).changes


# ---- the embedded engine, end to end on the tiny model ----


@pytest.mark.slow
def test_the_embedded_engine_runs_the_interpreter_on_the_tiny_model(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from evotrainer.engine import run_job
    from evotrainer.store.recipe import resolve

    monkeypatch.chdir(tmp_path)
    rows = [{"id": f"p{n}", "problem": f"{n}*{n}?", "answer": str(n * n),
             "program": f"print({n}*{n})"} for n in range(2, 14)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = resolve({
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                           "num_heads": 2, "num_kv_heads": 2},
                  "warm_start": {"steps": 150, "batch_size": 8, "lr": 1.0e-2}},
        "domain": {"name": "math_tool", "train_size": 8, "val_size": 4,
                   "data": {"train": "train.jsonl"},
                   "params": {"tool_demo_rate": 1.0, "prompt_template": "{problem}",
                              "packages": []}},
        "environment": {"max_turns": 3},
        "grpo": {"group_size": 2, "prompts_per_step": 2, "steps": 1, "eval_every": 1,
                 "eval_k": 1, "lr": 1.0e-3, "max_response_tokens": 32},
    }, [])
    result = run_job(recipe, tmp_path / "job", "v1")
    assert result["status"] == "ok", result
    table = pq.read_table(tmp_path / "job/rollouts/train.parquet").to_pylist()
    calls = [c for r in table for c in r["tool_calls"]]
    assert calls, "the warm-started policy calls the interpreter"
    assert {c["name"] for c in calls} <= {"python", "python_error"}
    called = [r for r in table if r["tool_calls"]]
    for row in called:
        assert OPEN in row["response"]  # the observation is in the transcript...
        assert json.loads(row["extra"])["env_tokens"] > 0  # ...and masked out of the loss
    assert any(c["name"] == "python" for c in calls)


# ---- verl: the python tool for paper-math ----


def test_paper_math_with_the_interpreter_renders_and_runs_as_a_verl_tool(tmp_path):
    pytest.importorskip("verl.tools.tool_registry", reason="needs verl==0.9.1")
    from test_verl_multiturn import load_tools, prepared, run_calls, score, trajectory

    from evotrainer.backends.verl_episode import max_tool_reply
    from evotrainer.backends.verl_render import JobFiles, render_job
    from evotrainer.control.scaffold import EXAMPLES_DIR
    from evotrainer.store.recipe import resolve
    from evotrainer.store.specs import load_yaml

    # paper-math as shipped, with the skill's patch: multi-turn on, the python tool, the
    # observation cap within verl's tool reply length.
    source = EXAMPLES_DIR / "paper-math.yaml"
    recipe = resolve(load_yaml(source.read_bytes(), str(source))["recipe"], [])
    patched = deep_merge(recipe, resolve_skill(load_library()["code-interpreter"],
                                               recipe).overrides)
    (run,) = render_job(patched, version="v8", files=JobFiles(tmp_path / "art"),
                        workdir=tmp_path / "wt")
    values = {o.key: o.value for o in run.overrides}
    rollout = "actor_rollout_ref.rollout"
    assert values[f"{rollout}.multi_turn.enable"] is True
    assert values[f"{rollout}.agent.default_agent_loop"] == "tool_agent"
    assert values[f"{rollout}.multi_turn.max_tool_response_length"] == max_tool_reply(
        patched["domain"])

    files, train, _ = prepared(tmp_path / "job", {"domain": {"name": "math_tool",
                                                             "train_size": 4, "val_size": 2}})
    config = json.loads(files.tool_config.read_text())
    assert [t["tool_schema"]["function"]["name"] for t in config["tools"]] == ["python"]
    tools = load_tools(files)
    row = next(r for r in train if json.loads(
        r["extra_info"]["tools_kwargs"]["python"]["create_kwargs"]["task"])["answer"] in
        ("56", "6", "30", "2", "13", "210", "180"))
    answer = json.loads(row["extra_info"]["tools_kwargs"]["python"]["create_kwargs"]["task"])[
        "answer"]
    agent_data = trajectory(row)
    (reply, failed) = run_calls(tools, agent_data, [("python", {"code": f"print({answer})"}),
                                                    ("python", {"code": "1/0"})])
    assert reply == f"{OPEN}{answer}\n</output>\n"
    assert len(failed) <= max_tool_reply({"name": "math_tool"})
    record = agent_data.extra_fields["evo_episode"]
    assert [c["name"] for c in record["tool_calls"]] == ["python", "python_error"]
    # The decoded response as verl's reward sees it: the calls, the replies, then the answer.
    decoded = ('<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n'
               f"</tool_call>user\n<tool_response>\n{reply}</tool_response>\nassistant\n"
               f"So the answer is $\\boxed{{{answer}}}$.")
    extras = score(files, row, agent_data, text=decoded, turns=5)
    assert extras["acc"] == 1.0
    assert json.loads(extras["tool_calls"]) == record["tool_calls"]
    # An answer only the program printed scores nothing.
    assert score(files, row, agent_data, text=decoded.rsplit("So", 1)[0])["acc"] == 0.0
