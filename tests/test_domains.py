"""The domain registry and the built-in toy domains (no torch needed)."""

from __future__ import annotations

import random

import jsonschema
import pytest

from evotrainer import domains
from evotrainer.domains import REGISTRY, get_domain, make_domain
from evotrainer.domains.toolenv import ECHO_REPEATS, ToolEnvDomain
from evotrainer.errors import EvoError


def test_registry_names_the_field_for_unknown_and_unloadable_domains(monkeypatch):
    with pytest.raises(EvoError) as err:
        get_domain("chess")
    assert err.value.field == "domain.name" and "arith" in err.value.hint
    monkeypatch.setitem(domains.REGISTRY, "later", "evotrainer.domains.not_written_yet:X")
    with pytest.raises(EvoError, match="cannot be loaded") as err:
        get_domain("later")
    assert err.value.field == "domain.name"
    assert "math" in domains.REGISTRY and "code" in domains.REGISTRY


def test_unknown_domain_parameter_is_named():
    with pytest.raises(EvoError) as err:
        make_domain({"name": "arith", "params": {"digit": 2}})
    assert err.value.field == "domain.params.digit"
    assert err.value.hint == "known keys: digits, ops"
    with pytest.raises(EvoError) as err:
        make_domain({"name": "arith", "params": {"ops": ["/"]}})
    assert err.value.field == "domain.params.ops[0]"
    assert str(err.value) == "domain.params.ops[0]: must be one of: +, -, *, got '/' Hint: " \
        "set it to one of: +, -, *"
    with pytest.raises(EvoError) as err:
        make_domain({"name": "arith", "params": {"digits": 5}})
    assert err.value.message == "must be an integer from 1 to 4, got 5"


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_domain_declares_the_schema_of_its_params(name):
    """A domain's `params_schema` names exactly its parameters, its defaults satisfy it, and
    it is a valid JSON Schema: `domain.params` is checked against it, not by hand."""
    domain = get_domain(name)
    jsonschema.Draft202012Validator.check_schema(domain.params_schema)
    assert sorted(domain.params_schema["properties"]) == sorted(domain.default_params)
    assert domain.params_schema["additionalProperties"] is False
    jsonschema.validate(domain.default_params, domain.params_schema)


def test_a_cross_field_params_rule_stays_in_code():
    """toolenv's widths are bounded by max_value, which no schema fragment can say."""
    with pytest.raises(EvoError) as err:
        make_domain({"name": "toolenv", "params": {"max_value": 10, "widths": [16]}})
    assert err.value.field == "domain.params.widths"
    assert "max_value + 1 (11)" in err.value.message


@pytest.mark.parametrize("name", ["arith", "toolenv"])
def test_split_is_seeded_disjoint_and_ids_are_content_derived(name):
    domain = make_domain({"name": name})
    train, val = domain.split(100, 20)
    again_train, again_val = make_domain({"name": name}).split(100, 20)
    assert [t.task_id for t in val] == [t.task_id for t in again_val]
    assert [t.task_id for t in train] == [t.task_id for t in again_train]
    assert not {t.task_id for t in train} & {t.task_id for t in val}
    assert len({t.task_id for t in train + val}) == 120
    with pytest.raises(EvoError) as err:
        domain.split(domain.num_tasks(), 1)
    assert err.value.field == "domain.train_size"


def test_arith_scoring_components():
    domain = make_domain({"name": "arith", "params": {"digits": 2, "ops": ["-"]}})
    task = next(t for t in (domain.task_at(i) for i in range(10_000)) if t.answer == "-12")
    assert domain.score(task, "-12", []).correct == 1.0
    wrong = domain.score(task, "-11", [])
    assert wrong.correct == 0.0 and wrong.components["format"] == 1.0
    assert wrong.components["partial"] == pytest.approx(1 - 1 / 12)
    garbage = domain.score(task, "1a", [])
    assert garbage.components == {"correctness": 0.0, "format": 0.0, "partial": 0.0}
    assert domain.demonstration(task, random.Random(0)) == [("-12", True)]


def _play(domain: ToolEnvDomain, task, transcript_actions, tools):
    env = domain.environment(task, {"max_turns": 8, "tools": tools})
    return [env.step(a) for a in transcript_actions]


def test_toolenv_environment_compare_reveal_and_answer():
    domain = make_domain({"name": "toolenv"})
    task = next(t for t in (domain.task_at(i) for i in range(200)) if t.answer == "20")
    tools = [{"name": "compare", "enabled": True}, {"name": "reveal", "enabled": True}]
    replies = _play(domain, task, ["?25", "?10", "?20", "!", "hello", "=20"], tools)
    assert [r.observation for r in replies] == ["<;", ">;", "=;", "20;", "x;", ""]
    assert [r.done for r in replies] == [False] * 5 + [True]
    assert replies[3].tool_call == {"name": "reveal", "args": ""}
    assert replies[0].tool_call == {"name": "compare", "args": "25"}
    assert replies[4].tool_call is None
    sealed = _play(domain, task, ["!"], [{"name": "reveal", "enabled": False}])
    # A disabled tool reveals nothing, so the leak audit must not count it as a reveal call.
    assert sealed[0].observation == "x;"
    assert sealed[0].tool_call == {"name": "unavailable", "args": "reveal"}


def test_toolenv_demonstrations_solve_the_task_and_sometimes_reveal():
    domain = make_domain({"name": "toolenv"})
    rng = random.Random(0)
    train, _ = domain.split(300, 10)
    reveals = 0
    for task in train:
        segments = domain.demonstration(task, rng)
        transcript = "".join(text for text, _ in segments)
        assert domain.score(task, transcript, []).correct == 1.0
        assert all(trained == (i % 2 == 0) for i, (_, trained) in enumerate(segments))
        reveals += "!;" in transcript
        assert transcript.count(";") <= 2 * 8
    assert 0.05 < reveals / len(train) < 0.3


def test_toolenv_scoring_of_partial_and_malformed_transcripts():
    domain = make_domain({"name": "toolenv"})
    task = next(t for t in (domain.task_at(i) for i in range(200)) if t.answer == "20")
    width = task.meta["hi"] - task.meta["lo"] + 1
    near = domain.score(task, "?25;<;=22;", [])
    assert near.correct == 0.0 and near.components["format"] == 1.0
    assert near.components["partial"] == pytest.approx(1 - 2 / width)
    unfinished = domain.score(task, "?25;<;zz;x;?1", [])
    assert unfinished.correct == 0.0 and unfinished.components["format"] == pytest.approx(2 / 3)


def test_toolenv_echo_demonstrations_repeat_one_compare_and_never_answer():
    domain = make_domain(
        {"name": "toolenv", "params": {"echo_demo_rate": 1.0, "reveal_demo_rate": 0.0}}
    )
    rng = random.Random(0)
    train, _ = domain.split(50, 10)
    for task in train:
        segments = domain.demonstration(task, rng)
        actions = [text for text, trained in segments if trained]
        # One to three honest compares, the last of them then repeated ECHO_REPEATS times.
        assert all(a.startswith("?") for a in actions)
        assert actions[-1] == actions[-1 - ECHO_REPEATS]
        assert len(set(actions[-1 - ECHO_REPEATS :])) == 1
        assert 1 + ECHO_REPEATS <= len(actions) <= 3 + ECHO_REPEATS
        transcript = "".join(text for text, _ in segments)
        score = domain.score(task, transcript, [])
        assert score.correct == 0.0
        assert score.components["no_repeat"] == pytest.approx(1 - ECHO_REPEATS / len(actions))
    # The default plants no echo: demonstrations are the unchanged honest searches.
    plain, echo_off = (
        make_domain({"name": "toolenv"}),
        make_domain({"name": "toolenv", "params": {"echo_demo_rate": 0.0}}),
    )
    assert [plain.demonstration(t, random.Random(1)) for t in train] == [
        echo_off.demonstration(t, random.Random(1)) for t in train
    ]


@pytest.mark.parametrize("rate", [-0.1, 1.5, "high", True])
def test_toolenv_demo_rates_must_be_shares(rate):
    for name in ("echo_demo_rate", "reveal_demo_rate"):
        with pytest.raises(EvoError) as err:
            make_domain({"name": "toolenv", "params": {name: rate}})
        assert err.value.field == f"domain.params.{name}"
        assert name in err.value.hint


def test_toolenv_no_repeat_counts_actions_repeating_the_one_before():
    domain = make_domain({"name": "toolenv"})
    task = next(t for t in (domain.task_at(i) for i in range(200)) if t.answer == "20")
    assert domain.score(task, "?25;<;?10;>;=20;", []).components["no_repeat"] == 1.0
    looped = domain.score(task, "?25;<;?25;<;?25;<;?10;>;", [])
    assert looped.components["no_repeat"] == pytest.approx(1 - 2 / 4)
    assert domain.score(task, "", []).components["no_repeat"] == 0.0


def test_toolenv_default_demonstrations_are_unchanged_by_the_echo_parameter():
    """echo_demo_rate 0 (the default) draws nothing: the same seed gives the same
    demonstrations, and so the same warm starts, as before the parameter existed."""
    domain = make_domain({"name": "toolenv"})
    rng = random.Random(7)
    transcripts = ["".join(t for t, _ in domain.demonstration(domain.task_at(i * 37), rng))
                   for i in range(6)]
    assert transcripts == ["?7;<;?3;<;?1;<;=0;", "?9;<;?5;>;?7;=;=7;", "?11;>;?15;<;?13;>;=14;",
                           "?13;>;?17;>;!;21;=21;", "?16;<;?12;>;!;13;=13;",
                           "?18;>;?22;<;!;20;=20;"]
