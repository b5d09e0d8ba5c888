"""Converters from the formats the paper's data comes in to the `math` and `code` domains' rows.

- `aime` → math: AIME / CNMO / MATH-style JSONL, one problem and its final answer per line
  (`problem` or `question`, `answer` or `expected_answer`, optional `id` and `solution`).
- `taco` → code: TACO / APPS rows, `question` and `input_output` ({"inputs", "outputs"},
  JSON text or an object), optional `difficulty` and `solutions` (JSON text of a list).
- `livecodebench` → code: LiveCodeBench rows, `question_content`, `question_id`, `platform`,
  `difficulty`, `public_test_cases` and `private_test_cases` (JSON text of
  [{input, output, testtype}]).
- `code_contests` → code: DeepMind CodeContests rows, `name`, `description`,
  `public_tests`/`private_tests` ({input: [...], output: [...]}), `difficulty`, `solutions`.
- `swe_rebench` → swe_rebench: SWE-rebench / SWE-bench instances, `instance_id`, `repo`
  (owner/name), `base_commit`, `problem_statement`, `test_patch`, `patch` (the reference fix,
  the warm-start target), `FAIL_TO_PASS` and `PASS_TO_PASS` (lists, or JSON text of lists),
  optional `docker_image` / `image_name`. Each row names a local mirror of its repository,
  found under `--repos DIR` as `owner__name.bundle`, `owner__name.git`, `owner__name` or
  `owner/name` (a clone, a bare repository or a git bundle): nothing is downloaded. Rows whose
  mirror is missing are skipped and counted.

Every output row is built into the domain's task before it is written (`make_task`), so a
converted file loads. `data_source` is the benchmark stratum the gate resamples within: the
`--data-source` given, else the row's own, else the file's name; code rows add the difficulty
(`livecodebench/atcoder/easy`), the paper's per-difficulty view. Rows whose tests are not
stdin/stdout (call-based: a `fn_name`, LiveCodeBench `functional`) are skipped and counted,
never half-converted. LiveCodeBench's later releases compress `private_test_cases` as a
pickle: it is not unpickled (unpickling runs code from the file), the row keeps its public
tests and the count says how many rows lost their private ones.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from evotrainer.domains import make_domain
from evotrainer.domains.data import read_rows
from evotrainer.errors import EvoError


class RowError(ValueError):
    """A malformed row: the converter stops there, naming it."""


class Skip(Exception):  # noqa: N818 - not an error: a row the target domain cannot hold
    """The row cannot be a task of the target domain; the message says why."""


@dataclass
class Converted:
    domain: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason → rows
    notes: Counter = field(default_factory=Counter)  # something lost from kept rows → rows


def _first(row: dict[str, Any], *keys: str) -> Any:
    return next((row[k] for k in keys if row.get(k) not in (None, "")), None)


def _text(value: Any, what: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"no {what}")
    return value


def _json(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise RowError(f"{what} is not JSON ({err.msg})") from err
        except RecursionError:  # `[[[[...` deeper than the decoder's stack
            raise RowError(f"{what} is JSON nested too deeply to read") from None
    return value


def _stdin(value: Any, what: str) -> str:
    """A test's input or output: text, or a list of lines (APPS writes some that way)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "".join(line if line.endswith("\n") else line + "\n" for line in value)
    raise RowError(f"a test {what} is neither text nor a list of lines")


def _pairs(inputs: Any, outputs: Any, what: str) -> list[dict[str, str]]:
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise RowError(f"{what} inputs and outputs must be lists")
    if len(inputs) != len(outputs):
        raise RowError(f"{what} has {len(inputs)} inputs and {len(outputs)} outputs")
    return [
        {"input": _stdin(i, "input"), "output": _stdin(o, "output")}
        for i, o in zip(inputs, outputs, strict=True)
    ]


def _stratum(source: str, difficulty: Any) -> str:
    return f"{source}/{str(difficulty).lower()}" if difficulty not in (None, "") else source


def aime(row: dict[str, Any], source: str, notes: Counter) -> dict[str, Any]:
    out = {
        "problem": _text(_first(row, "problem", "question", "Problem", "Question"), "problem"),
        "answer": _text(
            _first(row, "answer", "Answer", "expected_answer", "final_answer"), "answer"
        ).strip(),
        "data_source": str(_first(row, "data_source") or source),
    }
    ident = _first(row, "id", "ID", "problem_id", "unique_id", "idx")
    if ident is not None:
        out["id"] = str(ident)
    solution = _first(row, "solution", "Solution")
    if isinstance(solution, str):
        out["solution"] = solution
    return out


def taco(row: dict[str, Any], source: str, notes: Counter) -> dict[str, Any]:
    cases = _json(_first(row, "input_output"), "input_output")
    if not isinstance(cases, dict):
        raise RowError("no input_output object")
    if cases.get("fn_name"):
        raise Skip("call-based tests (fn_name), not stdin/stdout")
    tests = _pairs(cases.get("inputs"), cases.get("outputs"), "input_output")
    if not tests:
        raise Skip("no tests")
    difficulty = row.get("difficulty")
    out: dict[str, Any] = {
        "problem": _text(_first(row, "question", "problem"), "question"),
        "tests": tests,
        "data_source": _stratum(str(_first(row, "data_source") or source), difficulty),
    }
    if _first(row, "id", "problem_id") is not None:
        out["id"] = str(_first(row, "id", "problem_id"))
    if difficulty not in (None, ""):
        out["difficulty"] = str(difficulty).lower()
    solutions = _json(row.get("solutions") or "[]", "solutions")
    if isinstance(solutions, list) and solutions and isinstance(solutions[0], str):
        out["solution"] = solutions[0]
    return out


def livecodebench(row: dict[str, Any], source: str, notes: Counter) -> dict[str, Any]:
    cases = _json(row.get("public_test_cases") or "[]", "public_test_cases")
    private = row.get("private_test_cases") or "[]"
    if isinstance(private, str) and not private.lstrip().startswith("["):
        notes["private tests compressed as a pickle, not read: public tests only"] += 1
    else:
        cases = cases + _json(private, "private_test_cases")
    if not isinstance(cases, list):
        raise RowError("test cases are not a list")
    if any(isinstance(c, dict) and c.get("testtype") == "functional" for c in cases):
        raise Skip("functional (call-based) tests, not stdin/stdout")
    tests = _pairs([c.get("input") for c in cases], [c.get("output") for c in cases],
                   "test cases")
    if not tests:
        raise Skip("no tests")
    platform, difficulty = row.get("platform"), row.get("difficulty")
    stratum = str(_first(row, "data_source") or source)
    if platform:
        stratum = f"{stratum}/{str(platform).lower()}"
    out: dict[str, Any] = {
        "problem": _text(_first(row, "question_content", "problem"), "question_content"),
        "tests": tests,
        "data_source": _stratum(stratum, difficulty),
    }
    if row.get("question_id") not in (None, ""):
        out["id"] = str(row["question_id"])
    if difficulty not in (None, ""):
        out["difficulty"] = str(difficulty).lower()
    return out


# CodeContests' enums: `language` 3 is PYTHON3; `difficulty` 0-6 are named levels and from
# 7 on Codeforces' problem letters (7 = A).
_PYTHON3 = 3
_LEVELS = ("unknown", "easy", "medium", "hard", "harder", "hardest", "external")


def _contest_difficulty(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return _LEVELS[value] if value < len(_LEVELS) else chr(ord("a") + value - len(_LEVELS))
    return value


def code_contests(row: dict[str, Any], source: str, notes: Counter) -> dict[str, Any]:
    tests = []
    for key in ("public_tests", "private_tests"):
        block = row.get(key) or {}
        if not isinstance(block, dict):
            raise RowError(f"{key} is not an object")
        tests += _pairs(block.get("input") or [], block.get("output") or [], key)
    if not tests:
        raise Skip("no tests")
    difficulty = _contest_difficulty(row.get("difficulty"))
    out: dict[str, Any] = {
        "problem": _text(_first(row, "description", "problem"), "description"),
        "tests": tests,
        "data_source": _stratum(str(_first(row, "data_source") or source), difficulty),
    }
    if row.get("name") not in (None, ""):
        out["id"] = str(row["name"])
    if difficulty not in (None, ""):
        out["difficulty"] = str(difficulty).lower()
    solutions = row.get("solutions") or {}
    if isinstance(solutions, dict):
        python = [s for lang, s in zip(solutions.get("language") or [],
                                       solutions.get("solution") or [], strict=False)
                  if lang == _PYTHON3]
        if python:
            out["solution"] = python[0]
    return out


def _test_ids(value: Any, what: str) -> list[str]:
    ids = _json(value if value not in (None, "") else "[]", what)
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise RowError(f"{what} is not a list of test ids")
    return ids


# GitHub's owner/name: the mirror's path is built from it, so nothing else may pass (`..`,
# `.`, an absolute path, a backslash, a third part would name a folder outside `--repos`).
_OWNER_NAME = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+")


def mirror_of(repo: str, repos: Path) -> Path | None:
    """The local mirror of `repo` (owner/name) under `repos`, if there is one."""
    owner, _, name = repo.partition("/")
    flat = f"{owner}__{name}"
    for candidate in (f"{flat}.bundle", f"{flat}.git", flat, f"{owner}/{name}",
                      f"{owner}/{name}.git"):
        if (repos / candidate).exists():
            return repos / candidate
    return None


def swe_rebench(row: dict[str, Any], source: str, notes: Counter, *,
                repos: Path) -> dict[str, Any]:
    repo = _text(row.get("repo"), "repo")
    if not _OWNER_NAME.fullmatch(repo) or any(part in (".", "..") for part in repo.split("/")):
        raise RowError(f"repo {repo!r} is not owner/name (letters, digits, '-', '_', '.'; "
                       "neither part '.' or '..')")
    f2p = _test_ids(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS")
    if not f2p:
        raise Skip("no fail-to-pass tests")
    mirror = mirror_of(repo, repos)
    if mirror is None:
        raise Skip(f"no local mirror under {repos} (owner__name.bundle, .git or a folder)")
    out: dict[str, Any] = {
        "id": _text(row.get("instance_id"), "instance_id"),
        "repo": repo,
        "mirror": str(mirror),
        "base_commit": _text(row.get("base_commit"), "base_commit").strip(),
        "problem": _text(row.get("problem_statement"), "problem_statement"),
        "test_patch": _text(row.get("test_patch"), "test_patch"),
        "fail_to_pass": f2p,
        "pass_to_pass": _test_ids(row.get("PASS_TO_PASS"), "PASS_TO_PASS"),
        "data_source": str(_first(row, "data_source") or source),
    }
    if isinstance(row.get("patch"), str) and row["patch"].strip():
        out["patch"] = row["patch"]
    else:
        notes["no reference patch: no warm-start demonstration"] += 1
    image = _first(row, "docker_image", "image_name")
    if isinstance(image, str):
        out["image"] = image
    return out


Converter = Callable[[dict[str, Any], str, Counter], dict[str, Any]]
FORMATS: dict[str, tuple[str, Converter]] = {
    "aime": ("math", aime),
    "taco": ("code", taco),
    "livecodebench": ("code", livecodebench),
    "code_contests": ("code", code_contests),
    "swe_rebench": ("swe_rebench", swe_rebench),
}
# Formats whose rows name a local mirror of a repository (`convert_file`'s `repos`).
NEEDS_REPOS = frozenset({"swe_rebench"})


def convert_file(fmt: str, src: Path, *, data_source: str | None = None,
                 repos: Path | None = None) -> Converted:
    """The rows of `src` (JSONL or Parquet) in format `fmt` as the target domain's rows,
    each checked by building its task. EvoError at the row for a row that is malformed or
    whose id repeats. `repos`: the folder of local repository mirrors (swe_rebench)."""
    if fmt not in FORMATS:
        raise EvoError(f"unknown format {fmt!r}", field="format",
                       hint=f"one of: {', '.join(FORMATS)}")
    domain_name, convert = FORMATS[fmt]
    if fmt in NEEDS_REPOS:
        if repos is None or not repos.is_dir():
            raise EvoError(f"{fmt} rows need local mirrors of their repositories",
                           field="--repos", hint="give --repos DIR, a folder holding "
                           "owner__name.bundle (or .git, or a clone) for each repository")
        convert = partial(convert, repos=repos)
    domain = make_domain({"name": domain_name})
    source = data_source or src.stem
    result = Converted(domain_name)
    seen: dict[str, int] = {}
    for number, row in enumerate(read_rows(src, "source"), start=1):
        where = f"{src}:row {number}"
        try:
            out = convert(row, source, result.notes)
        except Skip as skip:
            result.skipped[str(skip)] += 1
            continue
        except RowError as err:
            raise EvoError(f"cannot convert this {fmt} row: {err}", where=where, field="source",
                           hint=f"is the file in the {fmt} format? (see `evotrainer data "
                           "convert --help`)") from None
        task = domain.make_task(out, source, where, "source")
        if task.task_id in seen:
            raise EvoError(
                f"task id {task.task_id!r} repeats row {seen[task.task_id]}",
                where=where,
                field="source",
                hint="remove the duplicate rows (the domain refuses a file with repeated ids)",
            )
        seen[task.task_id] = number
        result.rows.append(out)
    return result


def write_rows(rows: list[dict[str, Any]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                   encoding="utf-8")
