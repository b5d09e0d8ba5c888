"""Experiment trackers: per-step metrics where RL engineers already look.

A recipe lists its loggers with verl's names (`trainer.logger`):

```yaml
loggers: [console, file, tensorboard, mlflow, wandb]
```

Each version and seed is one tracker run, named `<version>/seed<N>` and tagged with its
lineage (version, parent, intervention, skills, harness, recipe digest, spec commit); the
gate's verdict, Δ, CI and alerts arrive later as the run's summary. Every default needs no
server and no network: TensorBoard event files and W&B offline runs under the run's artifact
dir, MLflow's SQLite store in the artifact root. Credentials, when a user points a tracker at
a server, come only from the tracker's own environment variables.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from evotrainer.errors import EvoError
from evotrainer.store.files import atomic_write

# verl's `trainer.logger` names we support, and the extra that installs each library.
LOGGERS = ("console", "file", "tensorboard", "mlflow", "wandb")
DEFAULT_LOGGERS = ("console", "file")
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
IDENTITY_FILE = "tracking.json"


@dataclass(frozen=True)
class RunIdentity:
    """Who a run is: the same for live logging, the gate's summary and a later export, so
    all three land in one tracker run."""

    project: str
    version: str
    job_id: str
    store_root: str  # absolute: where workspace-wide stores (MLflow's database) live
    tags: dict[str, str] = field(default_factory=dict)  # lineage, as strings

    def run_name(self, seed: int) -> str:
        return f"{self.version}/seed{seed}"

    def run_key(self, seed: int) -> str:
        """A stable id that every tracker accepts (W&B ids allow no '/' or ':')."""
        text = "\0".join([self.project, self.version, self.job_id, str(seed)])
        return "evo" + hashlib.sha256(text.encode()).hexdigest()[:20]

    def run_tags(self, seed: int) -> dict[str, str]:
        return {**self.tags, "seed": str(seed)}

    def tracker_run(self, run_dir: Path, seed: int, *, replace: bool = False) -> TrackerRun:
        return TrackerRun(
            name=self.run_name(seed), key=self.run_key(seed), tags=self.run_tags(seed),
            project=self.project, version=self.version, run_dir=run_dir,
            store_root=Path(self.store_root), replace=replace,
        )

    def write(self, run_dir: Path) -> Path:
        """Hand the identity to the training job (its artifact dir) as `tracking.json`."""
        path = run_dir / IDENTITY_FILE
        atomic_write(path, json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def read(cls, run_dir: Path, version: str) -> RunIdentity:
        """The identity the launcher left in `run_dir`, else a bare one (a job started by
        hand): named after the version, stores in the run dir itself."""
        path = run_dir / IDENTITY_FILE
        if not path.is_file():
            return cls(project="evotrainer", version=version, job_id=run_dir.name,
                       store_root=str(run_dir.resolve()), tags={"version": version})
        try:
            data = json.loads(path.read_text())
            return cls(project=str(data["project"]), version=str(data["version"]),
                       job_id=str(data["job_id"]), store_root=str(data["store_root"]),
                       tags={str(k): str(v) for k, v in (data.get("tags") or {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise EvoError(f"unreadable tracker identity: {err}", where=str(path),
                           hint="delete it to log under a bare identity") from err


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker opens: one version and seed."""

    name: str
    key: str
    tags: dict[str, str]
    project: str
    version: str
    run_dir: Path  # the run's artifact dir
    store_root: Path
    replace: bool = False  # an export: drop what this tracker holds for the run first


class Tracker(Protocol):
    """One tracker's run. `start` opens (or, with the same key, reopens) the run."""

    name: str

    def start(self, run: TrackerRun) -> None: ...

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def summary(self, step: int, values: Mapping[str, float], tags: Mapping[str, str]) -> None:
        """Values and tags that describe the whole run (the gate's); `step` places them on
        trackers that need one (TensorBoard, MLflow)."""

    def close(self) -> None: ...


class Trackers:
    """The recipe's trackers for one run, started; every call fans out to all of them."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers
        self.last_step = 0

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """One step's metrics; values that are not finite numbers are left out."""
        clean = {name: float(value) for name, value in metrics.items()
                 if isinstance(value, numbers.Real) and not isinstance(value, bool)
                 and math.isfinite(value)}
        if not clean:
            return
        self.last_step = max(self.last_step, step)
        for tracker in self.trackers:
            tracker.log(step, clean)

    def summary(
        self, values: Mapping[str, float], tags: Mapping[str, str], step: int | None = None
    ) -> None:
        """`step` defaults to the last step logged through these trackers."""
        at = self.last_step if step is None else step
        for tracker in self.trackers:
            tracker.summary(at, values, tags)

    def close(self) -> None:
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as err:  # close every tracker even when one fails
                errors.append(f"{tracker.name}: {err}")
        if errors:
            raise EvoError("closing trackers failed: " + "; ".join(errors))

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def logger_names(recipe: Mapping[str, Any], where: str | None = None) -> list[str]:
    """The recipe's `loggers`, checked: verl's names we support, each once."""
    names = recipe.get("loggers", list(DEFAULT_LOGGERS))
    if names is None:
        return list(DEFAULT_LOGGERS)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise EvoError("loggers must be a list of names", where=where, field="loggers",
                       hint=f"e.g. loggers: [{', '.join(DEFAULT_LOGGERS)}, tensorboard]")
    for name in names:
        if name not in LOGGERS:
            raise EvoError(f"unknown logger {name!r}", where=where, field="loggers",
                           hint=f"known loggers: {', '.join(LOGGERS)}")
    return list(dict.fromkeys(names))


def require(logger: str) -> Any:
    """The library behind `logger`, or one line naming the extra that installs it."""
    # Nothing phones home unless the user says so: MLflow's usage telemetry and W&B's error
    # reports are off by default (an explicit setting in the environment wins).
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    try:
        return importlib.import_module(logger)  # each package is named as verl's logger
    except ImportError as err:
        raise EvoError(
            f"the {logger} logger needs the {logger} package, which is not installed ({err})",
            field="loggers",
            hint=f"pip install 'evotrainer[{EXTRAS[logger]}]', or drop {logger} from loggers",
        ) from err


def _factories() -> dict[str, Callable[..., Tracker]]:
    # Imported on use: the tracker modules import TrackerRun from this one.
    from evotrainer.trackers.console import ConsoleTracker, FileTracker
    from evotrainer.trackers.mlflow_tracker import MlflowTracker
    from evotrainer.trackers.tensorboard_tracker import TensorBoardTracker
    from evotrainer.trackers.wandb_tracker import WandbTracker

    return {"console": ConsoleTracker, "file": FileTracker, "tensorboard": TensorBoardTracker,
            "mlflow": MlflowTracker, "wandb": WandbTracker}


def open_trackers(
    loggers: Iterable[str],
    run_dir: Path,
    identity: RunIdentity,
    *,
    seed: int,
    emit: Callable[[str], None] | None = None,
    replace: bool = False,
) -> Trackers:
    """Start one run per logger for (`identity`, `seed`). Every library is imported before
    any run starts, so a missing one fails before anything is written. `emit` prints the
    console logger's lines (default: stderr)."""
    names = logger_names({"loggers": list(loggers)})
    for name in names:
        if name in EXTRAS:
            require(name)
    factories = _factories()
    run = identity.tracker_run(run_dir, seed, replace=replace)
    started: list[Tracker] = []
    try:
        for name in names:
            tracker = factories[name](emit=emit) if name == "console" else factories[name]()
            tracker.start(run)
            started.append(tracker)
    except BaseException:
        Trackers(started).close()
        raise
    return Trackers(started)
