"""The backend protocol: how reconcile talks to whatever trains.

A job is rendered from a version's resolved recipe. Its id is deterministic
(`job_id(version, attempt, recipe_digest)`), so a reconcile that crashed after a launch
finds and adopts the running job instead of launching it twice.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from evotrainer.domains.judge import named_like_secret
from evotrainer.store.records import JobState

if TYPE_CHECKING:  # pyarrow is imported where evidence is counted, not by every command
    import pyarrow as pa

    from evotrainer.engine.outputs import JobProgress


@dataclass(frozen=True)
class JobSpec:
    """Everything a backend needs to run one training job."""

    job_id: str
    version: str
    recipe: dict
    workdir: Path  # the version's worktree: reward or filter code is read from here
    artifact_dir: Path  # where the job writes rollouts, steps, scores, checkpoint, log
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class JobStatus:
    state: JobState
    detail: str = ""
    progress: float | None = None  # 0..1 when the backend can tell
    exit_code: int | None = None
    # A running job's progress, as far as the backend can tell (plan shows it).
    steps_done: int | None = None
    steps_total: int | None = None
    seconds_left: float | None = None


@dataclass
class Collected:
    """Canonical evidence of a finished job, all inside its artifact dir."""

    train_rollouts: Path | None
    val_rollouts: Path | None
    steps: Path | None
    scores: Path
    result: dict
    checkpoint: Path | None = None  # the first seed's trained policy (a directory)


@dataclass
class LiveEvidence:
    """What a running job has written so far, as a live look reads it: its rollouts and step
    metrics (None when nothing changed since `read` and the look did not ask for them again),
    whether they changed, what was read (handed back at the next look), a digest naming the
    evidence, and when the job started."""

    rollouts: pa.Table | None
    steps: pa.Table | None
    changed: bool
    read: dict
    digest: str
    started_at: str | None = None

    @property
    def rows(self) -> tuple[int, int]:
        """(train, val) rollouts read."""
        if self.rollouts is None or not self.rollouts.num_rows:
            return 0, 0
        import pyarrow.compute as pc

        train = pc.sum(pc.equal(self.rollouts.column("split"), "train")).as_py() or 0
        return train, self.rollouts.num_rows - train


class Backend(Protocol):
    name: str
    # The folders of weights a job of this backend keeps in its artifact dir beside the
    # recorded checkpoints (`checkpoint`, `checkpoint-seed*`): paths relative to the artifact
    # dir, a part ending in `*` naming every folder of that prefix. What `evotrainer gc`
    # deletes with a dropped policy.
    weight_folders: tuple[str, ...]

    def check(self, recipe: dict) -> None:
        """Raise EvoError for a recipe this backend cannot run, before any compute."""

    def submit(self, job: JobSpec) -> None: ...

    def status(self, job: JobSpec) -> JobStatus: ...

    def cancel(self, job: JobSpec) -> None:
        """Stop the job (and everything it started); a finished job is left as it is."""

    def logs(self, job: JobSpec, tail: int = 50) -> str: ...

    def collect(self, job: JobSpec) -> Collected: ...

    def resources(self, recipe: dict) -> dict[str, int]:
        """What a job of `recipe` asks for: {nodes, gpus_per_node, gpus} (the GPU budget
        binds at launch on it)."""

    def progress(self, job: JobSpec) -> JobProgress | None:
        """The running job's own per-step record where it keeps one (steps done, seconds a
        step); None where only its evidence tells."""

    def live_evidence(self, job: JobSpec, cache: Path, read: dict, force: bool) -> LiveEvidence:
        """What the running job wrote since the look that returned `read`. `cache` is the
        look's own folder for what the backend keeps between looks; `force`: read the
        evidence even when it did not change (no diagnosis of it to reuse)."""


# What of the controller's environment a job inherits: the machine's locale, paths, thread
# and accelerator settings and the offline switches — never the controller's credentials
# (GITHUB_TOKEN, ANTHROPIC_API_KEY, the record key, tracker API keys). A job runs the
# recipe a branch wrote over data a model wrote; it gets what training needs and no more.
JOB_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "HF_HOME", "XDG_CACHE_HOME",
    "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "MLFLOW_TRACKING_URI",
})
JOB_ENV_PREFIXES = (
    "LC_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "CUDA_", "NVIDIA_", "ROCR_", "HIP_",
    "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_",
    "TORCH_", "PYTORCH_", "ATEN_", "ONEDNN_", "DNNL_", "VLLM_", "RAY_", "EVOTRAINER_",
)


def job_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A job's environment: the allow-listed part of ours (no name that reads like a
    secret, whatever its prefix) and `extra` (the job's own settings)."""
    inherited = {
        name: value for name, value in os.environ.items()
        if (name in JOB_ENV_NAMES or name.startswith(JOB_ENV_PREFIXES))
        and not named_like_secret(name)
    }
    return {**inherited, **(extra or {})}


def job_id(version: str, attempt: int, recipe_digest: str) -> str:
    short = hashlib.sha256(f"{version}\0{attempt}\0{recipe_digest}".encode()).hexdigest()[:10]
    return f"evo-{version}-a{attempt}-{short}"
