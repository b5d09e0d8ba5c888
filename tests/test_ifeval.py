"""The ifeval domain: IFEval's checkers (if-verifiable's) on hand-made responses, seeded and
deterministic prompts, train and validation never sharing a base task, IFBench's test set
with the checkers that need missing NLTK data left out, and a tiny end-to-end run."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("if_verifiable", reason="needs if-verifiable (the dev extra)")

from evotrainer.domains import Task, make_domain  # noqa: E402
from evotrainer.domains.ifeval import (  # noqa: E402
    NEEDS_PUNKT,
    IFEvalDomain,
    _ifeval_conflicts,
    base_tasks,
    ifbench_registry,
    ifbench_tasks,
    ifbench_unavailable,
    punkt_installed,
)
from evotrainer.errors import EvoError  # noqa: E402


def task(instructions: list[str], kwargs: list[dict], benchmark: str = "ifeval") -> Task:
    prompt = "Write a short note about gardening."
    answer = {"benchmark": benchmark, "prompt": prompt, "instructions": instructions,
              "kwargs": kwargs}
    return Task("t", prompt, json.dumps(answer), "ifeval/test")


@pytest.fixture(scope="module")
def domain() -> IFEvalDomain:
    return IFEvalDomain({"variants": 2})


LOWER_NO_COMMA = task(["punctuation:no_comma", "change_case:english_lowercase"], [{}, {}])


@pytest.mark.parametrize(
    ("response", "correct", "partial"),
    [
        ("gardening is a quiet joy and it teaches patience to everyone who tries it", 1.0, 1.0),
        ("gardening is a quiet joy, and it teaches patience to everyone who tries it", 0.0, 0.5),
        ("Gardening is a quiet joy, and it teaches patience to everyone who tries it", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_strict_prompt_and_instruction_level_scores(domain, response, correct, partial):
    score = domain.score(LOWER_NO_COMMA, response, [])
    assert score.components == {"correctness": correct, "partial": partial, "truncated": 0.0}
    assert score.correct == correct


def test_checkers_with_arguments_and_the_truncated_component(domain):
    ended = task(["startend:end_checker", "keywords:existence"],
                 [{"end_phrase": "Any other questions?"}, {"keywords": ["soil", "rain"]}])
    good = "Soil loves rain in spring. Any other questions?"
    assert domain.score(ended, good, []).components["correctness"] == 1.0
    # Strict: a word after the end phrase fails it; the keywords still pass.
    late = domain.score(ended, good + " Bye", [], truncated=True).components
    assert late == {"correctness": 0.0, "partial": 0.5, "truncated": 1.0}
    assert domain.verdicts(ended, good + " Bye") == {"startend:end_checker": False,
                                                     "keywords:existence": True}
    quoted = task(["startend:quotation"], [{}])
    assert domain.score(quoted, '"All wrapped."', []).correct == 1.0
    assert domain.score(quoted, 'Not "wrapped".', []).correct == 0.0


def test_prompts_are_seeded_deterministic_and_leave_random_alone(domain):
    state = random.getstate()
    first = [domain.task_at(i) for i in range(0, domain.num_tasks(), 97)]
    assert random.getstate() == state  # IFEval samples with the module's random: restored
    again = IFEvalDomain({"variants": 2})
    assert [again.task_at(i) for i in range(0, again.num_tasks(), 97)] == first
    other = IFEvalDomain({"variants": 2, "seed": 1})
    assert [other.task_at(i).prompt for i in range(0, 200, 97)] != [t.prompt for t in first[:3]]
    # The registry's own words follow the base task.
    sample = domain.task_at(1)  # base task 0, variant 1
    answer = json.loads(sample.answer)
    assert sample.prompt.startswith(base_tasks()[0][0]["text"])
    assert sample.data_source == "ifeval/" + answer["instructions"][0].split(":")[0]
    assert sample.task_id.startswith("ifeval:t00f00:")


def test_constraints_respect_counts_conflicts_and_the_length_budget():
    domain = IFEvalDomain({"variants": 4, "min_constraints": 2, "max_constraints": 3,
                           "max_words": 60})
    conflicts = _ifeval_conflicts()
    for index in range(0, domain.num_tasks(), 7):
        answer = json.loads(domain.task_at(index).answer)
        ids = answer["instructions"]
        assert 2 <= len(ids) <= 3
        for a in ids:
            assert not any(b in conflicts[a] for b in ids if b != a)
        for i, kwargs in zip(ids, answer["kwargs"], strict=True):
            if i == "length_constraints:number_words" and kwargs["relation"] == "at least":
                assert kwargs["num_words"] <= 60
            assert i not in NEEDS_PUNKT or punkt_installed()


def test_train_and_validation_never_share_a_base_task(domain):
    train, val = domain.split(300, 80)
    train_bases = {t.meta["base"] for t in train}
    val_bases = {t.meta["base"] for t in val}
    assert not train_bases & val_bases
    assert {t.meta["split"] for t in train} == {"train"}
    assert {t.meta["split"] for t in val} == {"heldout"}
    held_ids = {row["id"] for row in base_tasks()[1]}
    assert val_bases <= held_ids and not train_bases & held_ids
    # The held-out prompts the bench evaluates are the validation set's, whatever train_size.
    assert domain.heldout_tasks(80) == val == domain.split(10, 80)[1]
    with pytest.raises(EvoError) as caught:
        domain.split(0, 10_000)
    assert caught.value.field == "domain.val_size"
    with pytest.raises(EvoError) as caught:
        domain.split(10_000, 0)
    assert caught.value.field == "domain.train_size"


IFBENCH_ROWS = [
    {"key": "1", "prompt": "Describe rain. Use no commas.",
     "instruction_id_list": ["count:word_count_range"],
     "kwargs": [{"min_words": 3, "max_words": 20, "N": None}]},
    {"key": "2", "prompt": "Describe snow.", "instruction_id_list": ["words:start_verb"],
     "kwargs": [{}]},
    {"key": "3", "prompt": "Describe fog.", "instruction_id_list": ["no.such:instruction"],
     "kwargs": [{}]},
]


def test_ifbench_rows_with_missing_checkers_are_left_out_and_counted(tmp_path, domain):
    path = tmp_path / "IFBench_test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in IFBENCH_ROWS))
    tasks, left_out = ifbench_tasks(path)
    assert left_out["no.such:instruction"] == 1
    kept = {t.task_id for t in tasks}
    assert "ifbench:1" in kept and "ifbench:3" not in kept
    if "words:start_verb" in ifbench_unavailable():  # NLTK's tagger is not installed here
        assert "ifbench:2" not in kept and left_out["words:start_verb"] == 1
    one = next(t for t in tasks if t.task_id == "ifbench:1")
    assert one.data_source == "ifbench/count"
    assert domain.score(one, "Rain falls softly on the town today.", []).correct == 1.0
    assert domain.score(one, "Rain.", []).correct == 0.0


def test_a_checker_without_its_data_is_an_error_never_a_zero(domain):
    missing = sorted(ifbench_unavailable())
    if not missing:
        pytest.skip("every IFBench checker's NLTK data is installed here")
    with pytest.raises(EvoError) as caught:
        domain.score(task([missing[0]], [{}], "ifbench"), "Run home. Eat well today.", [])
    assert "NLTK data" in str(caught.value)


def test_ifbench_is_read_without_any_download(monkeypatch):
    import nltk

    def no_download(*_a, **_k):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(nltk, "download", no_download)
    monkeypatch.setattr(nltk.downloader, "download", no_download)
    # Imported afresh: if-verifiable's IFBench module asks for downloads when imported.
    for name in [m for m in sys.modules if m.startswith("if_verifiable.ifbench")]:
        monkeypatch.delitem(sys.modules, name)
    ifbench_registry.cache_clear()
    ifbench_unavailable.cache_clear()
    try:
        assert "count:word_count_range" in ifbench_registry()
        assert isinstance(ifbench_unavailable(), dict)
    finally:
        ifbench_registry.cache_clear()
        ifbench_unavailable.cache_clear()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"instructions": ["no:such"]}, "domain.params.instructions"),
        ({"min_constraints": 3, "max_constraints": 2}, "domain.params.min_constraints"),
        ({"max_constraints": 4}, "domain.params.max_constraints"),
        ({"val_source": "mmlu"}, "domain.params.val_source"),
    ],
)
def test_bad_params_name_the_field(params, field):
    with pytest.raises(EvoError) as caught:
        make_domain({"name": "ifeval", "params": params})
    assert caught.value.field == field


def test_punkt_constraints_are_left_out_without_punkt():
    if punkt_installed():
        pytest.skip("NLTK's punkt is installed here")
    assert not NEEDS_PUNKT & set(IFEvalDomain().params["instructions"])
    with pytest.raises(EvoError) as caught:
        IFEvalDomain({"instructions": ["length_constraints:number_sentences"]})
    assert caught.value.field == "domain.params.instructions" and "punkt" in str(caught.value)


def test_no_demonstrations_to_warm_start_on(domain):
    with pytest.raises(EvoError) as caught:
        domain.demonstration(domain.task_at(0), random.Random(0))
    assert caught.value.field == "model.warm_start.steps"


def test_a_tiny_chat_model_trains_on_ifeval(tmp_path: Path, monkeypatch):
    """The whole engine on the domain: a random Llama with a chat template, LoRA, int8
    rollouts, val on held-out base tasks; the records carry the constraint families."""
    pytest.importorskip("peft")
    import pyarrow.parquet as pq
    from real_checkpoint import save_hf

    from evotrainer.contract.recipe import check_recipe
    from evotrainer.engine import run_job
    from evotrainer.store.recipe import resolve

    monkeypatch.chdir(tmp_path)
    checkpoint = save_hf(tmp_path / "hf")
    recipe = resolve(
        {
            "model": {"path": str(checkpoint), "lora": {"r": 4, "alpha": 8}, "tiny": None,
                      "warm_start": {"steps": 0}, "chat_template": "auto"},
            "domain": {"name": "ifeval", "train_size": 8, "val_size": 3,
                       "params": {"variants": 1, "max_constraints": 2}},
            "grpo": {"group_size": 2, "prompts_per_step": 2, "steps": 1, "eval_every": 1,
                     "eval_k": 1, "max_response_tokens": 6, "lr": 1e-3},
            "reward": {"components": [{"name": "correctness", "weight": 1.0},
                                      {"name": "partial", "weight": 0.5}]},
            "rollout": {"quantization": "int8", "importance_cap": 2.0},
        },
        [],
    )
    check_recipe(recipe)
    result = run_job(recipe, tmp_path / "run", cache_dir=tmp_path / "cache")
    assert result["status"] == "ok"
    rows = []
    for split in ("train", "val"):
        rows += pq.read_table(next((tmp_path / "run").glob(f"**/rollouts/{split}.parquet"))
                              ).to_pylist()
    assert {r["split"] for r in rows} == {"train", "val"}
    assert all(r["data_source"].startswith("ifeval/") for r in rows)
    val_bases = {r["task_id"].split(":")[1] for r in rows if r["split"] == "val"}
    held = {row["id"] for row in base_tasks()[1]}
    assert val_bases <= held
    for r in rows:
        components = r["reward_components"]
        components = json.loads(components) if isinstance(components, str) else components
        assert set(dict(components)) >= {"correctness", "partial"}
