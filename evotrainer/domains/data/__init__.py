"""Datasets of the `math` and `code` domains: the small samples shipped here and the rows a user
points the recipe at (`domain.data.train` / `domain.data.val`, JSONL or Parquet).

A data path is resolved (every link followed) where the job reads it, and read only when it
stays inside the job's working directory (the version's worktree), the shipped samples or a
data root the launcher declares in $EVOTRAINER_DATA_ROOTS: a link committed on a version
branch cannot make the job read a file from anywhere else. A model named by `model.path` is
confined to the same folders (engine/model.py), every file inside it included."""

from __future__ import annotations

import hashlib
import json
import os
import random
from abc import abstractmethod
from importlib import resources
from pathlib import Path
from typing import Any

from evotrainer.domains.base import Domain, Score, Task
from evotrainer.errors import EvoError

DATA_KEYS = ("train", "val")
# Absolute folders (os.pathsep-separated) a job may read datasets from besides its worktree:
# the project's `data_roots`, resolved by the launcher.
DATA_ROOTS_ENV = "EVOTRAINER_DATA_ROOTS"


def sample_path(name: str) -> Path:
    """A dataset shipped in this package, e.g. `sample_path("math_sample.jsonl")`."""
    return Path(str(resources.files(__name__).joinpath(name)))


def data_roots() -> list[Path]:
    """The folders a dataset may resolve into: the working directory, the shipped samples and
    the declared data roots."""
    declared = os.environ.get(DATA_ROOTS_ENV, "").split(os.pathsep)
    return [
        Path.cwd().resolve(),
        sample_path("").resolve(),
        *(Path(root).resolve() for root in declared if root),
    ]


def resolve_data_path(value: str, field: str, what: str = "dataset") -> Path:
    """`value` with every link followed (relative to the working directory); EvoError naming
    `what` (a dataset, a model...) when it leaves every data root."""
    resolved = Path(value).resolve()
    if not any(resolved.is_relative_to(root) for root in data_roots()):
        raise EvoError(
            f"{what} {value} resolves to {resolved}, outside the job's workspace and every "
            "declared data root",
            field=field,
            hint="commit the file itself rather than a link to it, or declare its folder in "
            "the project's `data_roots`",
        )
    return resolved


def read_rows(path: Path, field: str) -> list[dict[str, Any]]:
    """Rows of a `.jsonl` or `.parquet` file; `field` names the recipe key for error messages."""
    if not path.is_file():
        raise EvoError(
            f"dataset {path} does not exist",
            field=field,
            hint="give a JSONL or Parquet file path (relative to the workspace)",
        )
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json"):
        raise EvoError(
            f"dataset {path} is neither .jsonl nor .parquet",
            field=field,
            hint="convert it to JSON Lines (one object per line) or Parquet",
        )
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvoError(
                f"not valid JSON ({exc.msg})",
                where=f"{path}:{number}",
                field=field,
                hint="each line must be one JSON object",
            ) from exc
        except RecursionError:
            # The decoder recurses once per nesting level: a line of `[[[[...` deeper than
            # the interpreter's stack is hostile (or broken) input, not a row.
            raise EvoError(
                "a value nested too deeply to read",
                where=f"{path}:{number}",
                field=field,
                hint="each line must be one JSON object of ordinary depth",
            ) from None
        if not isinstance(row, dict):
            raise EvoError(
                "a line is not a JSON object",
                where=f"{path}:{number}",
                field=field,
                hint="each line must be one JSON object",
            )
        rows.append(row)
    return rows


def stable_id(prefix: str, row: dict[str, Any], content: str) -> str:
    """The row's own `id` when it has one, else a digest of its content: stable either way."""
    if row.get("id") not in (None, ""):
        return f"{prefix}:{row['id']}"
    return f"{prefix}:{hashlib.sha256(content.encode()).hexdigest()[:12]}"


class DataFiles:
    """Tasks from the rows of dataset files, for a domain class that lists this first.

    Without `data` the shipped sample is the pool and `split` draws train and val from it, as
    for the generated domains. With `data.train` alone that file is the pool. With `data.val`
    too, train tasks come from the train file and val tasks from the val file (each a seeded
    sample of the requested size), so a benchmark file can serve as the validation set."""

    sample_file = ""
    name: str

    def __init__(
        self, params: dict[str, Any] | None = None, data: dict[str, Any] | None = None
    ) -> None:
        self.data = {key: value for key, value in (data or {}).items() if value is not None}
        unknown = sorted(set(self.data) - set(DATA_KEYS))
        if unknown:
            raise EvoError(
                f"domain {self.name!r} has no data entry {unknown[0]!r}",
                field=f"domain.data.{unknown[0]}",
                hint="use train and/or val",
            )
        if "val" in self.data and "train" not in self.data:
            raise EvoError(
                "domain.data.val is set without domain.data.train",
                field="domain.data.train",
                hint="give the training file too",
            )
        # Loaded on first use: the verl reward workers build the domain only to score.
        self._pools: dict[str, list[Task]] = {}
        super().__init__(params)  # type: ignore[call-arg]  # the domain class's

    @abstractmethod
    def make_task(self, row: dict[str, Any], source: str, where: str, field: str) -> Task:
        """One task from one row; EvoError at `where` (file:row) naming `field` for bad rows."""

    def read_pool(self, key: str, path: Path, field: str) -> list[dict[str, Any]]:
        """The rows behind `domain.data.<key>` (`path`: that file, else the shipped sample),
        read where the path resolves to."""
        return read_rows(resolve_data_path(str(path), field), field)

    def pool(self, key: str) -> list[Task]:
        if key not in self._pools:
            field = f"domain.data.{key}"
            path = Path(self.data[key]) if key in self.data else sample_path(self.sample_file)
            # Named (source, errors) as the recipe names it.
            source = f"{self.name}/{path.stem}"
            tasks = [
                self.make_task(row, source, f"{path}:row {i + 1}", field)
                for i, row in enumerate(self.read_pool(key, path, field))
            ]
            ids = [t.task_id for t in tasks]
            if len(set(ids)) != len(ids):
                duplicate = next(i for i in ids if ids.count(i) > 1)
                raise EvoError(
                    f"task id {duplicate!r} occurs twice in {path}",
                    field=field,
                    hint="give every row a unique `id` (or remove duplicate rows)",
                )
            self._pools[key] = tasks
        return self._pools[key]

    def num_tasks(self) -> int:
        return len(self.pool("train"))

    def task_at(self, index: int) -> Task:
        return self.pool("train")[index]

    def split(
        self, train_size: int, val_size: int, split_seed: int = 0
    ) -> tuple[list[Task], list[Task]]:
        if "val" not in self.data:
            return super().split(train_size, val_size, split_seed)  # type: ignore[misc]
        picked = []
        for key, size in (("train", train_size), ("val", val_size)):
            pool = self.pool(key)
            if size > len(pool):
                raise EvoError(
                    f"{self.data[key]} holds {len(pool)} tasks, fewer than {key}_size = {size}",
                    field=f"domain.{key}_size",
                    hint=f"lower domain.{key}_size to at most {len(pool)}",
                )
            picked.append(random.Random(split_seed).sample(pool, size))
        return picked[0], picked[1]


class DatasetDomain(DataFiles, Domain):
    """A single-turn domain whose tasks are dataset rows, scored by `judge`."""

    @abstractmethod
    def judge(
        self, task: Task, response: str, truncated: bool | None = None
    ) -> tuple[Score, dict[str, Any]]:
        """The Score plus details for the rollout record's `extra` (e.g. the failure reason)."""

    def score(
        self,
        task: Task,
        response: str,
        tool_calls: list[dict[str, str]],
        truncated: bool | None = None,
    ) -> Score:
        return self.judge(task, response, truncated)[0]


def require_text(row: dict[str, Any], key: str, where: str, field: str) -> str:
    """A non-empty string field of a row (numbers are accepted and turned into text)."""
    value = row.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise EvoError(
            f"row has no {key!r} text",
            where=where,
            field=field,
            hint=f"every row needs a non-empty {key!r}",
        )
    return value
