"""`swe_rebench`: resolve a real repository's issue, multi-turn, graded by its own pytest suite.

The tasks are SWE-rebench (or SWE-bench) instances converted by `evotrainer data convert
swe_rebench` (`domain.data.train` / `val`; without data, the two shipped instances of a small
repository): the issue text, a local mirror of the repository (a clone, a bare repository or a
git bundle: nothing is fetched), the base commit, the test patch and the fail-to-pass and
pass-to-pass test ids. The episode is the `swe` domain's: the same actions (`$ CMD`, `write`,
`patch`, `submit`), executors and records, on a clone of the mirror checked out at the base
commit. That clone keeps the mirror's other commits, the fix among them, as a real clone does
(the paper's Git leak: `git log --all`); `clear_git_log: true` gives one commit of the base
tree instead.

Score: the final repository is graded by `runner.do_pytest`. The test patch's files and every
file holding a graded test are written over whatever the episode left (as SWE-bench applies
the test patch), and every other file the episode added, changed or deleted in a test folder
(`test_dirs`) is the base's again; a conftest, `sitecustomize`/`usercustomize` or `.pth` file
of the episode's own is removed and recorded as tampering, pytest's configuration files
restored. pytest then runs the graded tests in a child (sandbox/graders/pytest_bootstrap.py) that
starts before any repository code, refuses introspection from an edited file (frames, `gc`,
`ctypes`, /proc, code compiled under another file's name) and import hooks of the code under
test through an audit hook, makes the graded files' `==`, `!=`, `in` and `not in` strict
against objects whose equality is the code under test's, checks pytest's, pluggy's and
importlib's functions and hooks after every test, and sends each verdict signed with a key
only it was given. What it cannot rule
out is an attack written against the grader itself through objects pytest leaves reachable
(docs/engine.md says which): the verdict is pytest's, in a process the code under test shares.
Components as `swe`: `f2p`, `p2p`, `partial`, `correctness`, `submitted`, `format`,
`truncated`, `tampered`.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from evotrainer.domains.base import Demonstration, Task
from evotrainer.domains.data import DataFiles, require_text, resolve_data_path, sample_path
from evotrainer.domains.swe import TOOLS, TURN_END, DockerRepo, LocalRepo, Memo, SweDomain
from evotrainer.domains.swe_repo import GIT_ENV, tar_repo
from evotrainer.errors import EvoError
from evotrainer.sandbox import runner
from evotrainer.sandbox.process import DockerSandbox, Limits, check_executor

DEFAULT_TEMPLATE = (
    "{problem}\n\nThe repository is checked out at the commit this issue was reported "
    "against. Fix the issue. End every action with a backtick. Actions: `$ CMD` runs a "
    "shell command, `write PATH` then a newline and the content writes a file, `patch` then "
    "a newline and a unified diff applies it, `submit` ends."
)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# The paths a unified diff writes (`+++ b/PATH`), or deletes (`+++ /dev/null` after `--- a/`).
_DIFF_TARGET = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
RAW_SAMPLE = "swe_rebench_sample.jsonl"
SAMPLE_REPOS = "swe_rebench_repos"


def _ids(row: dict[str, Any], key: str, where: str, field: str, empty: bool) -> list[str]:
    value = row.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or (
            not value and not empty):
        raise EvoError(f"row's {key!r} is not a {'' if empty else 'non-empty '}list of test ids",
                       where=where, field=field,
                       hint="convert the file with `evotrainer data convert swe_rebench`")
    return value


class SweRebenchDomain(DataFiles, SweDomain):
    name = "swe_rebench"
    sample_file = RAW_SAMPLE
    default_params: dict[str, Any] = {
        "prompt_template": DEFAULT_TEMPLATE,
        "clear_git_log": False,
        "executor": "local",
        "docker_image": SweDomain.default_params["docker_image"],
        "container_lifetime_s": 1800,
        "command_timeout_s": 30.0,
        "test_timeout_s": 300.0,
        "test_python": None,
        "max_observation_chars": 4000,
        "memory_mb": 2048,
        "memoize": True,
    }
    default_environment: dict[str, Any] = {
        "max_turns": 30,
        "tools": [{"name": tool, "enabled": True} for tool in TOOLS],
    }
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {
            **{key: SweDomain.params_schema["properties"][key] for key in (
                "clear_git_log", "executor", "docker_image", "container_lifetime_s",
                "command_timeout_s", "max_observation_chars", "memory_mb", "memoize")},
            "prompt_template": {"type": "string", "description": "it may use {problem}"},
            "test_timeout_s": {"type": "number", "exclusiveMinimum": 0},
            "test_python": {
                "type": ["string", "null"],
                "description": "the interpreter of the repositories' test environment (pytest "
                "and the repository's dependencies installed): an absolute path; null for "
                "this one (local) or python3 on the image's PATH (docker)",
            },
        },
        "additionalProperties": False,
    }

    def validate_params(self) -> None:
        p = self.params
        python = p["test_python"]
        if python is not None and not os.path.isabs(python):
            raise EvoError(f"test_python {python!r} is not an absolute path",
                           field="domain.params.test_python",
                           hint="give the interpreter's absolute path, or null")
        check_executor(p["executor"], p["docker_image"])
        if p["executor"] == "docker":
            self.python = python or "python3"
            self.expose: tuple[str, ...] = ()
        else:
            self.python = python or sys.executable
            # The environment's root (a venv's or the interpreter's prefix), readable in the
            # sandbox: pytest and the repository's dependencies live there.
            self.expose = (sys.prefix if python is None
                           else os.path.dirname(os.path.dirname(python)),)
        self.limits = self._limits(float(p["command_timeout_s"]))
        self.test_limits = self._limits(float(p["test_timeout_s"]))
        self._repos = Memo(64)
        self._steps = Memo()
        self._results = Memo()

    def _limits(self, seconds: float) -> Limits:
        return Limits(cpu_seconds=seconds * 2, wall_seconds=seconds + 20.0,
                      memory_bytes=int(self.params["memory_mb"] * 2**20),
                      output_bytes=64 * 2**20, processes=64, file_bytes=256 * 2**20)

    def read_pool(self, key: str, path: Path, field: str) -> list[dict[str, Any]]:
        if key in self.data:
            return super().read_pool(key, path, field)
        # The shipped sample is SWE-rebench's own format, converted here with its mirror.
        from evotrainer.domains.data.convert import convert_file

        return convert_file("swe_rebench", path, repos=sample_path(SAMPLE_REPOS)).rows

    def make_task(self, row: dict[str, Any], source: str, where: str, field: str) -> Task:
        ident = require_text(row, "id", where, field)
        base = require_text(row, "base_commit", where, field)
        if not _COMMIT.match(base):
            raise EvoError(f"base_commit {base!r} is not a 40-digit commit id", where=where,
                           field=field, hint="give the full commit id the instance is based on")
        f2p = _ids(row, "fail_to_pass", where, field, empty=False)
        p2p = _ids(row, "pass_to_pass", where, field, empty=True)
        meta = {
            "repo": require_text(row, "repo", where, field),
            "mirror": require_text(row, "mirror", where, field),
            "base_commit": base,
            "test_patch": require_text(row, "test_patch", where, field),
            "patch": row.get("patch") if isinstance(row.get("patch"), str) else "",
            "image": row.get("image") if isinstance(row.get("image"), str) else None,
        }
        return Task(
            task_id=f"swe_rebench:{ident}",
            prompt=self.params["prompt_template"].replace(
                "{problem}", require_text(row, "problem", where, field).strip()),
            answer=json.dumps({"f2p": f2p, "p2p": p2p}, sort_keys=True),
            data_source=str(row.get("data_source") or source),
            meta=meta,
        )

    def _prepared(self, task: Task) -> dict[str, Any]:
        """The task's repository snapshot, the files the grader writes back (`trusted`) and
        the base tree's digests, built once from the mirror."""
        prepared = self._repos.get(task.task_id)
        if prepared is None:
            prepared = prepare(task, self.params["clear_git_log"])
            self._repos.put(task.task_id, prepared)
        return prepared

    def initial(self, task: Task) -> bytes:
        return self._prepared(task)["snapshot"]

    def open_repo(self, task: Task, snapshot: bytes, grading: bool = False
                  ) -> LocalRepo | DockerRepo:
        limits = self.test_limits if grading else self.limits
        if self.params["executor"] == "docker":
            image = task.meta.get("image") or self.params["docker_image"]
            if not DockerSandbox.image_present(image):
                raise EvoError(f"the image {image!r} of {task.task_id} is not on this machine",
                               field="domain.params.executor",
                               hint="pull or build it first (nothing is pulled here), or "
                               "drop the row's docker_image to use domain.params.docker_image")
            return DockerRepo(snapshot, limits, image, int(self.params["container_lifetime_s"]))
        return LocalRepo(snapshot, limits, self.expose)

    def _request(self, tool: str, fields: dict[str, str]) -> dict[str, Any]:
        return {**super()._request(tool, fields), "python": self.python}

    def evaluation(self, task: Task) -> dict[str, Any]:
        """Grade with pytest and the task's own test files (`runner.do_pytest`)."""
        prepared, answer = self._prepared(task), json.loads(task.answer)
        return {"kind": "pytest", "trusted": prepared["trusted"], "base": prepared["base"],
                "test_dirs": prepared["test_dirs"], "originals": prepared["originals"],
                "tests": answer["f2p"] + answer["p2p"], "python": self.python,
                "timeout": float(self.params["test_timeout_s"]), "cap": 1 << 16}

    def demonstration(self, task: Task, rng: random.Random) -> Demonstration:
        """The instance's reference fix as one `patch` action, then `submit`."""
        if not task.meta["patch"]:
            raise EvoError(f"task {task.task_id} has no reference patch to demonstrate",
                           field="domain.data.train",
                           hint="keep the instances' `patch` field, or warm-start from "
                           "another domain")
        return [(f"patch\n{task.meta['patch']}{TURN_END}", True), ("\npatch applied\n", False),
                ("submit" + TURN_END, True)]


def _git(repo: Path, *args: str, stdin: str | None = None) -> str:
    # No system or user configuration: a mirror's own config is all git reads.
    env = {**GIT_ENV, "HOME": str(repo), "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00",
           "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00"}
    # A mirror is data: no hook, fsmonitor or external driver of its configuration runs here.
    safe = ["-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false"]
    try:
        return subprocess.run(["git", *safe, *args], cwd=repo, env=env, input=stdin,
                              check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as err:
        raise EvoError(f"git {args[0]} failed: {err.stderr.strip()[:300]}",
                       field="domain.data.train",
                       hint="check the instance's mirror and base_commit") from None


def tests_files(test_ids: list[str]) -> set[str]:
    """The files that hold the graded tests (`path::name[params]` → path)."""
    return {test.split("::")[0] for test in test_ids if "::" in test}


def test_dirs(test_files: set[str]) -> list[str]:
    """The test folders of the graded and patched test files: for each, the outermost folder
    of its path named test* (`tests/unit/test_x.py` → `tests`, `pkg/io/tests/test_x.py` →
    `pkg/io/tests`). A test file in no such folder gives none: its folder holds the code
    under test, which the episode may change."""
    folders = set()
    for path in test_files:
        parts = path.split("/")[:-1]
        first = next((i for i, part in enumerate(parts) if part.startswith("test")), None)
        if first is not None:
            folders.add("/".join(parts[:first + 1]))
    return sorted(folders)


def prepare(task: Task, clear_history: bool) -> dict[str, Any]:
    """Clone the task's mirror at its base commit; compute what the grader needs."""
    meta = task.meta
    mirror = resolve_data_path(meta["mirror"], "domain.data.train", "repository mirror")
    if not mirror.exists():
        raise EvoError(f"the mirror {meta['mirror']} of {task.task_id} does not exist",
                       field="domain.data.train",
                       hint="convert with --repos naming the folder of local mirrors")
    answer = json.loads(task.answer)
    with tempfile.TemporaryDirectory(prefix="evotrainer-swe-rebench-") as tmp:
        repo = Path(tmp) / "repo"
        _git(Path(tmp), "clone", "-q", "--template=", "--no-checkout", "--no-hardlinks",
             str(mirror), "repo")
        _git(repo, "checkout", "-q", "--detach", meta["base_commit"])
        base = runner.tree_digests(str(repo))
        # The files the grader writes back: the test patch applied to the base tree (the
        # patch's deletions as None), every file holding a graded test, and every conftest,
        # startup hook and pytest configuration of the base tree.
        _git(repo, "apply", "--whitespace=nowarn", "-", stdin=meta["test_patch"])
        patched = {b for _, b in _DIFF_TARGET.findall(meta["test_patch"])}
        wanted = patched | tests_files(answer["f2p"] + answer["p2p"]) | {
            p for p in base if runner.guarded(p)}
        trusted: dict[str, str | None] = {}
        for path in sorted(wanted):
            file = repo / path
            if ".." in Path(path).parts or Path(path).is_absolute() or file.is_symlink():
                raise EvoError(f"{task.task_id} names the test file {path!r}, which is not a "
                               "file of its repository", field="domain.data.train",
                               hint="fix or drop the instance")
            trusted[path] = file.read_text(encoding="utf-8") if file.is_file() else None
        # The test folders: every file the episode adds or changes there is put back to the
        # base tree's (a package __init__.py of its own could install an import hook).
        folders = test_dirs({p for p in patched | tests_files(answer["f2p"] + answer["p2p"])
                             if not runner.guarded(p)})
        _git(repo, "checkout", "-q", "--", ".")
        originals = {path: base64.b64encode((repo / path).read_bytes()).decode("ascii")
                     for path in sorted(base) if runner.under(path, folders)
                     and path not in trusted and (repo / path).is_file()
                     and not (repo / path).is_symlink()}
        _git(repo, "clean", "-q", "-fdx")
        if clear_history:
            shutil.rmtree(repo / ".git")
            _git(repo, "init", "-q", "--template=", "-b", "main")
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-m", "Initial commit")
        else:
            # The remote named as upstream, not this machine's mirror path.
            _git(repo, "remote", "set-url", "origin", f"https://github.com/{meta['repo']}")
        return {"snapshot": tar_repo(repo), "trusted": trusted, "base": base,
                "test_dirs": folders, "originals": originals}


__all__ = ["SweRebenchDomain", "prepare"]
