"""The `local` backend: the embedded engine in a detached subprocess.

The job's artifact dir is its whole state: `job.json` (pid, start time, command) is written
when the process starts, the engine writes `result.json` when it ends. A later reconcile
pass — even from another process — reads the state back from those files, so a launch is
never repeated while its process lives. The process also carries its job id in its
environment (`EVOTRAINER_JOB_ID`), so a reconcile that died between spawning it and writing
`job.json` is repaired by adopting the process, or its result, instead of launching again.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from evotrainer.backends.base import (
    Collected,
    JobSpec,
    JobStatus,
    LiveEvidence,
    job_environment,
)
from evotrainer.engine import engine_threads
from evotrainer.errors import EvoError
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.store.checkpoints import CHECKPOINT
from evotrainer.store.clock import now_iso
from evotrainer.store.files import atomic_write, read_json
from evotrainer.store.records import JobState
from evotrainer.store.seal import KEY_ENV, keys_dir

if TYPE_CHECKING:
    from evotrainer.engine.outputs import JobProgress

# The evidence readers (pyarrow) are imported where a job's outputs are read: `validate` and
# `plan` use this backend to check recipes and look at jobs that are not running.

JOB_FILE = "job.json"
STDIO_FILE = "process.log"
# Set in every spawned job, so it is found without job.json. Job ids are deterministic, so
# two workspaces made from the same example share them: the artifact dir tells them apart.
JOB_ID_ENV = "EVOTRAINER_JOB_ID"
JOB_DIR_ENV = "EVOTRAINER_JOB_DIR"


class LocalBackend:
    name = "local"
    # Run as `python -I -m MODULE RECIPE_JSON OUT_DIR VERSION`; it writes the engine's
    # outputs. The working directory is the version's worktree (datasets resolve there), so
    # the interpreter runs isolated (-I): PYTHON* variables and the user's site-packages are
    # ignored and neither the working directory nor a script's folder is on sys.path — a
    # branch that commits `evotrainer/engine/__main__.py` or `sitecustomize.py` is data.
    engine_module = "evotrainer.engine"
    python_flags: tuple[str, ...] = ("-I",)
    weight_folders: tuple[str, ...] = ()  # the engine writes only the recorded checkpoints

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir  # shared warm-start cache under the artifact root

    def check(self, recipe: dict) -> None:
        from evotrainer.contract.recipe import check_recipe

        check_recipe(recipe)

    def submit(self, job: JobSpec) -> None:
        if self.status(job).state is not JobState.UNKNOWN:
            return  # already launched (or finished): adopt it, never launch twice
        job.artifact_dir.mkdir(parents=True, exist_ok=True)
        recipe_file = job.artifact_dir / "recipe.json"
        recipe_file.write_text(json.dumps(job.recipe, indent=2, sort_keys=True))
        command = [
            sys.executable,
            *self.python_flags,
            "-m",
            self.engine_module,
            str(recipe_file),
            str(job.artifact_dir),
            job.version,
        ]
        record = spawn_detached(
            command, job, self.environment(job), job.artifact_dir / STDIO_FILE
        )
        atomic_write(job.artifact_dir / JOB_FILE, json.dumps(record, indent=2))

    def environment(self, job: JobSpec) -> dict[str, str]:
        """The job's environment: allow-listed, so no secret of the controller reaches it."""
        env = {**job.env, "OMP_NUM_THREADS": str(engine_threads(job.recipe.get("threads")))}
        if self.cache_dir is not None:
            env["EVOTRAINER_CACHE_DIR"] = str(self.cache_dir)
        return job_environment(env)

    def status(self, job: JobSpec) -> JobStatus:
        result = read_json(RunArtifacts(job.artifact_dir).result)
        record = read_json(job.artifact_dir / JOB_FILE) or adopt_orphan(job)
        if record is None and result is not None:
            record = {"job_id": job.job_id, "pid": None}  # it ran and ended unrecorded
        if record is None or record.get("job_id") != job.job_id:
            return JobStatus(JobState.UNKNOWN, "no such job")
        process = live_process(record)
        if process is not None:
            return running_status(job, record)
        if result is not None and result.get("status") == "ok":
            return JobStatus(JobState.SUCCEEDED, "finished", 1.0, 0)
        if result is not None:
            return JobStatus(JobState.FAILED, str(result.get("error", "job failed")), None, 1)
        return JobStatus(
            JobState.FAILED,
            f"process {record['pid']} disappeared without a "
            "result (killed, or the machine restarted)",
        )

    def cancel(self, job: JobSpec) -> None:
        """SIGTERM to the job's process group (the engine and anything it started)."""
        record = read_json(job.artifact_dir / JOB_FILE) or adopt_orphan(job)
        process = live_process(record) if record else None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
                os.killpg(process.pid, signal.SIGTERM)

    def logs(self, job: JobSpec, tail: int = 50) -> str:
        lines: list[str] = []
        for path in (RunArtifacts(job.artifact_dir).log, job.artifact_dir / STDIO_FILE):
            if path.is_file():
                lines += path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    def collect(self, job: JobSpec) -> Collected:
        out = job.artifact_dir
        files = RunArtifacts(out)
        if not files.scores.is_file():
            raise EvoError(
                "the job finished but wrote no scores.csv",
                where=str(out),
                hint="see the job log: evotrainer logs " + job.version,
            )

        def present(path: Path) -> Path | None:
            return path if path.is_file() else None

        policy = out / CHECKPOINT
        return Collected(
            train_rollouts=present(files.rollouts("train")),
            val_rollouts=present(files.rollouts("val")),
            steps=present(files.steps),
            scores=files.scores,
            result=read_json(files.result) or {},
            checkpoint=policy if policy.is_dir() and not policy.is_symlink() else None,
        )

    def resources(self, recipe: dict) -> dict[str, int]:
        return {"nodes": 1, "gpus_per_node": 0, "gpus": 0}  # the engine runs on the CPU

    def progress(self, job: JobSpec) -> JobProgress | None:
        from evotrainer.engine.outputs import read_progress

        return read_progress(job.artifact_dir)

    def live_evidence(self, job: JobSpec, cache: Path, read: dict, force: bool) -> LiveEvidence:
        """The engine rewrites its rollout and step files whole at each evaluation
        (atomically): they are read whole when their size or mtime changed."""
        layout = RunArtifacts(job.artifact_dir)
        files = [layout.rollouts(split) for split in ("train", "val")]
        signature = {
            str(p.relative_to(job.artifact_dir)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in (*files, layout.steps)
            if p.is_file()
        }
        changed = signature != read
        digest = "live:" + json.dumps(signature, sort_keys=True)
        started = (read_json(job.artifact_dir / JOB_FILE) or {}).get("started_at")
        present = [p for p in files if p.is_file()]
        if not (changed or force) or not present:
            return LiveEvidence(None, None, changed, signature, digest, started)
        import pyarrow as pa

        from evotrainer.evidence.io import read_rollouts, read_steps

        try:
            tables = [read_rollouts(p) for p in present]
            steps = read_steps(layout.steps) if layout.steps.is_file() else None
        except (pa.ArrowException, OSError, EvoError):
            # A file replaced between the listing and the read: the next look reads it.
            return LiveEvidence(None, None, True, {}, digest, started)
        return LiveEvidence(pa.concat_tables(tables), steps, True, signature, digest, started)




def running_status(job: JobSpec, record: dict) -> JobStatus:
    """A running job, with its progress from the engine's progress record: training steps
    finished over all of the recipe's seeds, and the time left at the steps' own pace
    (start-up and warm start excluded). No record yet, or a torn one: no estimate."""
    from evotrainer.engine.outputs import read_progress

    status = JobStatus(JobState.RUNNING, f"pid {record['pid']}")
    grpo, seeds = job.recipe.get("grpo") or {}, job.recipe.get("seeds") or [0]
    total = int(grpo.get("steps") or 0) * len(seeds)
    progress = read_progress(job.artifact_dir)
    if not total or progress is None:
        return status
    done = min(progress.steps_done, total)
    status.steps_done, status.steps_total, status.progress = done, total, done / total
    if progress.seconds_per_step is not None:
        status.seconds_left = progress.seconds_per_step * (total - done)
    return status


def spawn_detached(command: list[str], job: JobSpec, env: dict, log: Path) -> dict:
    """Start `command` in its own session (it outlives reconcile), output appended to `log`;
    return the job record that lets any later process find it again (pid + start time).
    The job id and dir go into its environment: `find_job_process` finds it without the record.
    Where this user keeps record keys, the job never sees them (`KeyHider`)."""
    hider = KeyHider.for_jobs()
    try:
        with log.open("ab") as out:
            process = subprocess.Popen(
                command,
                cwd=job.workdir,
                env={**env, JOB_ID_ENV: job.job_id, JOB_DIR_ENV: str(job.artifact_dir.resolve())},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=hider,
            )
    except subprocess.SubprocessError as exc:  # the namespace could not be made after all
        raise EvoError(f"the job could not be started apart from the record key: {exc}",
                       where=str(log), hint=KEY_HINT) from None
    return job_record(job, psutil.Process(process.pid), command)


# Linux constants (sched.h, mount.h): Python 3.11's os module has no unshare or mount.
_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
KEY_HINT = (f"set {KEY_ENV} in the controller's environment instead of keeping a key file "
            "(a job never inherits it), or run reconcile where Linux user and mount "
            "namespaces are allowed")


class KeyHider:
    """Run in a job's child process before exec (`preexec_fn`): the folder of record keys
    (store/seal.keys_dir) becomes an empty read-only tmpfs in a mount namespace of the
    job's own, so a job — and whatever a branch's `serve:` command starts in it — cannot
    read any key, whatever the permissions. As root the mount is made first and the job then
    enters a user namespace of its own (every uid mapped as is): the mount is locked there,
    and the job holds no capability outside it (no `umount`, no reading the controller's
    /proc files). Not root: a user namespace mapping only the caller's uid. None when there
    is no key folder to hide."""

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder).encode()

    @classmethod
    def for_jobs(cls) -> KeyHider | None:
        """The hider for this user's key folder (None: none exists, nothing to hide);
        EvoError when keys exist and this machine cannot keep a job from them."""
        folder = keys_dir()
        if not folder.is_dir():
            return None
        if not namespaces_work(str(folder)):
            raise EvoError(
                "a job here could read the record keys: this machine allows no user and "
                "mount namespaces to hide them from it, so no job is started",
                where=str(folder), hint=KEY_HINT)
        return cls(folder)

    def __call__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if os.geteuid() == 0:
            _ok(libc.unshare(_CLONE_NEWNS), "unshare")
            self._mount(libc)
            _enter_user_namespace(libc, whole=True)
            _ok(libc.unshare(_CLONE_NEWNS), "unshare")  # the tmpfs is locked from here on
        else:
            _enter_user_namespace(libc, whole=False, also=_CLONE_NEWNS)
            self._mount(libc)

    def _mount(self, libc: ctypes.CDLL) -> None:
        _ok(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount")
        _ok(libc.mount(b"tmpfs", self.folder, b"tmpfs",
                       _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                       b"size=4k,nr_inodes=1,mode=0"), "mount")


def _ok(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what} failed")


def _enter_user_namespace(libc: ctypes.CDLL, whole: bool, also: int = 0) -> None:
    """Enter a new user namespace: `whole` (root) maps every uid and gid as it is, written
    by a helper left outside it (only a process there may map more than its own id); else
    only the caller's own uid and gid."""
    uid, gid = os.geteuid(), os.getegid()
    if not whole:
        _ok(libc.unshare(_CLONE_NEWUSER | also), "unshare")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        return
    ready, done = os.pipe()
    me = os.getpid()
    helper = os.fork()
    if helper == 0:  # still outside: waits for the namespace, then maps it
        try:
            os.read(ready, 1)
            _write(f"/proc/{me}/uid_map", "0 0 4294967295")
            _write(f"/proc/{me}/gid_map", "0 0 4294967295")
            os._exit(0)
        except BaseException:  # noqa: BLE001 — a child that must never return
            os._exit(1)
    try:
        _ok(libc.unshare(_CLONE_NEWUSER | also), "unshare")
    finally:
        os.write(done, b"x")
    _, status = os.waitpid(helper, 0)
    if status != 0:
        raise OSError("the user namespace could not be mapped")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


def _write(path: str, text: str) -> None:
    with open(path, "w") as out:
        out.write(text)


_NAMESPACES_WORK: dict[str, bool] = {}


def namespaces_work(folder: str) -> bool:
    """Whether a child here can hide `folder` as a job's would be (tried once a process)."""
    if folder not in _NAMESPACES_WORK:
        try:
            probe = subprocess.run(["true"], preexec_fn=KeyHider(Path(folder)),
                                   check=False, capture_output=True)
            _NAMESPACES_WORK[folder] = probe.returncode == 0
        except (subprocess.SubprocessError, OSError):
            _NAMESPACES_WORK[folder] = False
    return _NAMESPACES_WORK[folder]


def job_record(job: JobSpec, process: psutil.Process, command: list[str]) -> dict:
    return {
        "job_id": job.job_id,
        "pid": process.pid,
        "host": socket.gethostname(),
        "create_time": process.create_time(),
        "started_at": now_iso(),
        "command": command,
    }


def find_job_process(job: JobSpec) -> psutil.Process | None:
    """The live process (the session leader) spawned for `job`, found by its environment:
    the job id and the artifact dir (another workspace may run a job of the same id)."""
    wanted = {JOB_ID_ENV: job.job_id, JOB_DIR_ENV: str(job.artifact_dir.resolve())}
    for process in psutil.process_iter(["pid"]):
        try:
            environ = process.environ()
            if any(environ.get(key) != value for key, value in wanted.items()):
                continue
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getsid(process.pid) == process.pid:  # children inherit the variable
                return process
        except (psutil.Error, OSError):
            continue
    return None


def adopt_orphan(job: JobSpec) -> dict | None:
    """A job spawned by a reconcile that died before writing `job.json`: write its record
    now (a later pass then sees it as any other job), or None when there is none."""
    if not job.artifact_dir.is_dir():
        return None
    process = find_job_process(job)
    if process is None:
        return None
    try:
        record = job_record(job, process, process.cmdline())
    except psutil.Error:
        return None
    record["adopted"] = True
    atomic_write(job.artifact_dir / JOB_FILE, json.dumps(record, indent=2))
    return record


def live_process(record: dict) -> psutil.Process | None:
    """The job's process if it still runs (same pid *and* start time: pids get reused)."""
    if record.get("host") != socket.gethostname():
        return None
    try:
        process = psutil.Process(record["pid"])
        if abs(process.create_time() - record["create_time"]) > 1.0:
            return None
        if process.status() == psutil.STATUS_ZOMBIE:
            process.wait(0)  # reap our own child so it is not seen as running
            return None
        return process
    except (psutil.NoSuchProcess, psutil.TimeoutExpired, KeyError):
        return None
