"""Run untrusted Python programs (model-written solutions) with limits, and say what happened.

`LocalSandbox` needs no daemon. What it enforces depends on the privileges it has:

* Always: no new privileges (PR_SET_NO_NEW_PRIVS: no setuid binary or file capability
  raises what the program or anything it starts may do); a new session (process group)
  killed as a whole at the end; RLIMIT_CPU (whole
  seconds, per process), RLIMIT_AS (memory, per process), RLIMIT_FSIZE (file size),
  RLIMIT_NOFILE, no core dumps; a wall-clock deadline; stdout and stderr capped while they
  are read (the program is killed as soon as it writes past the cap, so a 1 GB print never
  reaches the parent's memory); a minimal environment; `python -I -S` (no site-packages, no
  user site, PYTHON* variables ignored).
* As root (`isolation` contains "uid", "netns", "mountns"): the program is pid 1 of its own
  pid namespace, so when it exits or is killed the kernel kills every process it started,
  including ones that left the process group with setsid; its own IPC namespace means no
  System V or POSIX shared memory outlives it. It runs as a fresh unprivileged
  uid/gid that no other process uses, so RLIMIT_NPROC really bounds its process count (a
  fork bomb hits the limit; as root the limit would be ignored). It has its own network
  namespace (a downed loopback only: no network at all) and its own mount namespace, where
  every top-level directory except the system ones (/usr, /etc and the /bin, /lib symlinks)
  is covered by an empty tmpfs, the interpreter's prefix (and any directory the caller
  exposes: a test environment) is bind-mounted back read-only, /proc
  is the namespace's own (no other process is visible), /dev is a minimal one (null, zero,
  full, random, urandom, the fd links and a private /dev/shm tmpfs of `file_bytes`), and /tmp
  is a fresh tmpfs of `file_bytes`, owned by the sandbox uid, holding the program and serving
  as its working directory. Nothing of it survives the run: the host's /dev/shm and /tmp
  never see a byte. Still readable: world-readable files
  under /usr, /etc and the interpreter prefix.
* Root without the namespaces (a container without CAP_SYS_ADMIN, or `privileged=False`):
  root never runs the program. It drops to a fresh uid first (`isolation` has "uid"; no
  uid switch, no run), so it cannot read root's files, write system ones or signal this
  process, RLIMIT_NPROC bounds it, and after the run every process of that uid is killed
  (setsid or not) and every file it left in /dev/shm and the temp dirs is removed.
* Not root, `confine=True`, and the kernel allows unprivileged user namespaces (`isolation`
  has "userns", "netns", "mountns"): the program gets its own user, mount, pid, network and
  IPC namespaces, set up as in the root mode (host hidden, own /proc, /dev, /tmp, interpreter
  bound back read-only) and the system directories made read-only too. It runs as the
  caller's uid mapped into its namespace, with no capabilities left after exec, so it cannot
  undo a mount: what the caller can read is out of its reach because it is not there, not
  because of file modes. `hide` paths (a workspace, a home) are covered even where they lie
  under a directory that stays visible (the interpreter and exposed directories are bound
  back even under one). RLIMIT_NPROC is not set (it would count all the
  caller's processes); the pid namespace kills whatever it started when it ends.
  `separated` is True in this mode and in both root modes: the program can read neither the
  caller's 0600 files nor its environment.
* Not root otherwise (`isolation` lacks "uid"): the program runs as the caller in a scratch
  directory under the system temp dir; a network namespace is tried through an unprivileged user
  namespace ("netns" when it worked); RLIMIT_NPROC is not set (it would count all the
  caller's processes), so only the process-group kill and the CPU/memory/wall limits contain
  a fork bomb, and a child that calls setsid can outlive the run. Files the caller can read
  stay readable, and so does the caller's environment under /proc: `separated` is False, and
  a caller with untrusted programs (unreviewed harness analyzers) refuses to run them.

`DockerSandbox` runs the same programs in a container through the `docker` SDK when a daemon
is reachable (network disabled, no new privileges, memory, pids and CPU limits, output capped
by RLIMIT_FSIZE).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import itertools
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from typing import Protocol

from evotrainer.errors import EvoError

# The unprivileged uid and gid untrusted code runs as in a container (`nobody`).
NOBODY = 65534

_STDERR_KEEP = 4096  # tail of stderr kept in the result, enough for a traceback's last lines
_READ_CHUNK = 65536

# Linux constants (sched.h, mount.h); Python 3.11's os module has no unshare/mount.
_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWIPC = 0x08000000
_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOEXEC = 0x8
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_PR_SET_NO_NEW_PRIVS = 38  # prctl.h
# statvfs's ST_* flags and the MS_* flags a read-only remount must keep (a user namespace may
# add restrictions to a mount it did not make, never drop them).
_KEPT_MOUNT_FLAGS = {0x2: _MS_NOSUID, 0x4: _MS_NODEV, 0x8: _MS_NOEXEC, 0x400: 0x400,
                     0x800: 0x800, 0x1000: 1 << 21}
# Directories made read-only in the confined unprivileged mode: the caller may own some.
_READ_ONLY_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64")

# Top-level directories left visible inside the mount namespace: what a CPython program needs.
# /dev, /proc and /tmp are replaced by the sandbox's own.
_SYSTEM_DIRS = frozenset({"usr", "etc", "dev", "proc", "bin", "sbin", "lib", "lib32", "lib64"})
# The device nodes a program may use, bound from the host's /dev into the private one.
_DEVICES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
}
# World-writable places a dropped-uid program (root, no namespaces) may leave files in.
_SHARED_SCRATCH = ("/dev/shm", "/tmp", "/var/tmp")

# Sandbox uids: far above any real account, a block of 2**15 per parent pid (modulo 2**15),
# used round-robin, so concurrent runs practically never share a uid and its process count.
_UID_BASE = 1 << 30
_UID_BLOCK = 1 << 15


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Memory is address space (RLIMIT_AS), so leave room for the runtime;
    CPU time is enforced in whole seconds (rounded up)."""

    cpu_seconds: float = 2.0
    wall_seconds: float = 6.0
    memory_bytes: int = 512 * 2**20
    output_bytes: int = 2**20
    processes: int = 16
    file_bytes: int = 16 * 2**20


@dataclass(frozen=True)
class RunResult:
    """What happened. `status`: "ok" (exit status 0; the caller judges the output),
    "runtime_error", "timeout" (wall clock), "cpu_limit", "memory_limit", "output_limit"
    (stdout/stderr over the cap, or a file over `file_bytes`) or "sandbox_error"."""

    status: str
    stdout: str
    stderr: str  # the tail only
    exit_code: int | None = None  # the exit status, or minus the signal number
    wall_seconds: float = 0.0
    isolation: tuple[str, ...] = ()  # what was enforced for this run, see the module doc
    detail: str = ""  # a one-line reason for a status other than "ok"


class Sandbox(Protocol):
    def run(self, source: str, stdin: str = "", limits: Limits | None = None) -> RunResult: ...


@dataclass
class _Capture:
    """Bytes read from the program's pipes, with the caps applied while reading."""

    limit: int
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    stderr_total: int = 0
    overflow: str = ""  # "stdout" or "stderr" once a cap was crossed

    def add(self, name: str, chunk: bytes) -> None:
        if name == "stdout":
            self.stdout += chunk
            if len(self.stdout) > self.limit:
                del self.stdout[self.limit :]
                self.overflow = "stdout"
        else:
            self.stderr_total += len(chunk)
            self.stderr = (self.stderr + chunk)[-_STDERR_KEEP:]
            if self.stderr_total > self.limit:
                self.overflow = "stderr"


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    return libc


# Loaded once in the parent: the child must not dlopen between fork and exec.
_LIBC = _libc()


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    assert _LIBC is not None
    _check(
        _LIBC.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() or None,
        ),
        f"mount {target}",
    )


class LocalSandbox:
    """Runs programs as child processes of this one; see the module doc for what it enforces.

    `privileged=None` uses the root-only isolation when running as root and a trial run in it
    works (a container without CAP_SYS_ADMIN refuses the namespaces: then the unprivileged
    mode is used); `False` forces the unprivileged mode.
    """

    def __init__(
        self, python: str | None = None, privileged: bool | None = None,
        expose: tuple[str, ...] = (), *, confine: bool = False, hide: tuple[str, ...] = (),
    ) -> None:
        # The real interpreter, not a venv launcher: -I ignores the venv anyway, and the mount
        # namespace has to re-expose the directory it lives in. `expose`: more directories
        # the program may read (an environment its own children run tests in), read-only.
        self.python = os.path.realpath(python or sys.executable)
        self.prefixes = (
            os.path.dirname(os.path.dirname(self.python)),
            *(os.path.realpath(path) for path in expose),
        )
        # Covered inside the namespaced modes even where under a visible directory.
        self.hide = tuple(os.path.realpath(path) for path in hide)
        self._runs = itertools.count()
        self.user_netns = False
        self.confined = False  # the unprivileged namespaced mode (see the module doc)
        self.privileged = (
            privileged is not False
            and os.geteuid() == 0
            and _LIBC is not None
            and sys.platform.startswith("linux")
        )
        if self.privileged:
            trial = self._run("", "", Limits(), self._next_uid(), scratch=None)
            self.privileged = trial.status == "ok"
        if not self.privileged and confine and os.geteuid() != 0 and _LIBC is not None:
            self.confined = True
            trial = self._run("", "", Limits(), None, scratch=None)
            self.confined = trial.status == "ok"
        if not self.privileged and not self.confined:
            self.user_netns = _probe_user_netns()

    @property
    def separated(self) -> bool:
        """Whether a program run here cannot read the caller's own files (mode 0600) or its
        environment: it runs as another uid (root), or confined in namespaces that hide the
        host (not root, `confine=True`, user namespaces allowed)."""
        return self.privileged or self.confined or os.geteuid() == 0

    def _next_uid(self) -> int:
        block = _UID_BASE + (os.getpid() % _UID_BLOCK) * _UID_BLOCK
        return block + next(self._runs) % _UID_BLOCK

    def run(self, source: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
        limits = limits or Limits()
        if self.privileged:
            return self._run(source, stdin, limits, self._next_uid(), scratch=None)
        if self.confined:
            return self._run(source, stdin, limits, None, scratch=None)
        # Root without the namespaces: the program still never runs as root.
        uid = self._next_uid() if os.geteuid() == 0 else None
        scratch = tempfile.mkdtemp(prefix="evotrainer-sandbox-")
        try:
            with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
                f.write(source)
            if uid is not None:
                os.chown(scratch, uid, uid)
            return self._run(source, stdin, limits, uid, scratch=scratch)
        finally:
            if uid is not None:
                _sweep_uid(uid)
            shutil.rmtree(scratch, ignore_errors=True)

    def _run(
        self, source: str, stdin: str, limits: Limits, uid: int | None, scratch: str | None
    ) -> RunResult:
        """`scratch` None: a namespaced mode (root's as `uid`, the confined one without);
        else the program runs in that directory, as `uid` when one is given (root without
        namespaces), else as the caller."""
        namespaced = scratch is None
        isolation = ["rlimits", "process_group", "wall_clock", "output_cap"]
        if uid is not None:
            isolation.append("uid")
        elif namespaced:
            isolation.append("userns")
        if namespaced:
            isolation += ["netns", "mountns"]
        elif self.user_netns:
            isolation.append("netns")
        setup = _ChildSetup(
            limits, uid, source.encode(), self.prefixes, self.user_netns, namespaced, self.hide
        )
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": "/tmp" if namespaced else scratch,
        }
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", "-X", "utf8", "main.py"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=scratch,
                env=env,
                start_new_session=True,
                preexec_fn=setup,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            why = ""
            if uid is not None and not namespaced:
                why = (
                    f" (as root without namespaces the program runs as uid {uid}, which "
                    "must be able to run the interpreter: pass one outside /root)"
                )
            return RunResult(
                "sandbox_error",
                "",
                "",
                detail=f"could not start: {exc}{why}",
                isolation=tuple(isolation),
            )
        # Without a pid namespace, the run's own uid finds whatever left the process group.
        stray_uid = None if namespaced else uid
        try:
            capture, timed_out, cpu = _supervise(proc, stdin.encode(), limits, start, stray_uid)
        finally:
            _kill_all(proc.pid, stray_uid)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                pipe.close()  # type: ignore[union-attr]
        wall = time.monotonic() - start
        code = None if timed_out else proc.returncode
        return _classify(capture, timed_out, cpu, code, limits, wall, tuple(isolation))


@dataclass
class _ChildSetup:
    """The preexec step: runs in the forked child, before exec, as the caller."""

    limits: Limits
    uid: int | None
    program: bytes
    prefixes: tuple[str, ...]
    user_netns: bool
    namespaced: bool
    hide: tuple[str, ...] = ()

    def __call__(self) -> None:
        if self.namespaced:
            self._isolate(self.uid)
        else:
            if self.uid is not None:
                # Before the user namespace: its new uid could not be switched from.
                _drop_to(self.uid)
            if self.user_netns:
                assert _LIBC is not None
                _check(_LIBC.unshare(_CLONE_NEWUSER | _CLONE_NEWNET), "unshare")
        if _LIBC is not None:
            # No exec may grant more privileges than the program has (setuid binaries, file
            # capabilities): inherited by everything it starts, and never undone.
            _check(_LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        # Last: the child is still a copy of the parent (possibly gigabytes of address space),
        # so RLIMIT_AS must not apply to the Python code above.
        lim = self.limits
        cpu = max(1, math.ceil(lim.cpu_seconds))
        # Pid 1 of a namespace ignores SIGXCPU, so as root the hard limit (SIGKILL) is the limit.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu if self.namespaced else cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.uid is not None:
            # Counted against the fresh uid alone, so it bounds exactly this program's processes.
            resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes, lim.processes))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))

    def _isolate(self, uid: int | None) -> None:
        """New pid, mount, network and IPC namespaces and a hidden host; as root the program
        then becomes the fresh `uid`; without root (`uid` None) a user namespace comes first,
        mapping the caller's own uid and gid only, and the program keeps that uid, whose
        capabilities in the namespace end at exec."""
        assert _LIBC is not None
        flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC
        if uid is None:
            own_uid, own_gid = os.getuid(), os.getgid()
            _check(_LIBC.unshare(_CLONE_NEWUSER | flags), "unshare")
            for name, text in (("setgroups", "deny"), ("uid_map", f"{own_uid} {own_uid} 1"),
                               ("gid_map", f"{own_gid} {own_gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        else:
            _check(_LIBC.unshare(flags), "unshare")
        # Private first: without it the mounts below would propagate to the host's namespace.
        _mount("none", "/", None, _MS_REC | _MS_PRIVATE)
        if os.fork() != 0:
            _mirror_child_and_exit()
        # Now pid 1 of the new pid namespace: when it exits, the kernel kills and reaps every
        # process it left behind, setsid or not.
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        kept = self._hide_host()
        if uid is None:
            self._read_only_system()
        self._private_dev()
        owner, group = (uid, uid) if uid is not None else (os.getuid(), os.getgid())
        scratch = f"size={self.limits.file_bytes},nr_inodes=4096,mode=700,uid={owner},gid={group}"
        _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, scratch)
        # A hidden path under a visible directory is covered too; before the interpreter and
        # the exposed directories are bound back, which stay reachable under a hidden one.
        for path in self.hide:
            _cover(path)
        # After /tmp: a directory exposed from the host's /tmp (a venv there) is bound too.
        self._expose(kept)
        with open("/tmp/main.py", "wb") as f:
            f.write(self.program)
        os.chown("/tmp/main.py", owner, group)
        os.chdir("/tmp")
        if uid is not None:
            _drop_to(uid)

    @staticmethod
    def _read_only_system() -> None:
        """Bind each system directory onto itself read-only, keeping the flags the host's
        mount has (the confined mode runs as the caller, who may own some of them)."""
        for name in _READ_ONLY_DIRS:
            path = "/" + name
            if os.path.islink(path) or not os.path.isdir(path):
                continue
            kept = os.statvfs(path).f_flag
            extra = sum(flag for st, flag in _KEPT_MOUNT_FLAGS.items() if kept & st)
            _mount(path, path, None, _MS_BIND | _MS_REC)
            _mount("none", path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | extra)

    def _private_dev(self) -> None:
        """Replace /dev with a minimal one: a few harmless devices bound from the host's, the
        fd links, and a private size-limited /dev/shm (the host's would keep what it gets)."""
        host_dev = os.open("/dev", os.O_PATH | os.O_DIRECTORY)
        _mount("tmpfs", "/dev", "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
        for name in _DEVICES:
            if os.path.exists(f"/proc/self/fd/{host_dev}/{name}"):
                open(f"/dev/{name}", "wb").close()  # the mount point
                _mount(f"/proc/self/fd/{host_dev}/{name}", f"/dev/{name}", None, _MS_BIND)
        os.close(host_dev)
        for name, target in _DEV_LINKS.items():
            os.symlink(target, f"/dev/{name}")
        os.mkdir("/dev/shm")
        shm = f"size={self.limits.file_bytes},nr_inodes=1024,mode=1777"
        _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, shm)

    def _hide_host(self) -> list[tuple[str, int]]:
        """Cover every non-system top-level entry. Returns the interpreter prefix and the
        exposed directories, each with a descriptor opened before the covering, for
        `_expose` to bind back once /tmp is the sandbox's own too."""
        kept = [(prefix, os.open(prefix, os.O_PATH | os.O_DIRECTORY)) for prefix in self.prefixes]
        for name in os.listdir("/"):
            path = "/" + name
            if name in _SYSTEM_DIRS or name == "tmp" or os.path.islink(path):
                continue
            if os.path.isdir(path):
                _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,mode=755")
            elif os.path.isfile(path):
                _mount("/dev/null", path, None, _MS_BIND)
        return kept

    @staticmethod
    def _expose(kept: list[tuple[str, int]]) -> None:
        """Bind each kept directory back where it was, read-only, where a covering hid it."""
        for prefix, fd in kept:
            if not os.path.isdir(prefix):
                # Its top-level directory was covered: recreate the path, then bind the original.
                os.makedirs(prefix)
                _mount(f"/proc/self/fd/{fd}", prefix, None, _MS_BIND | _MS_REC)
                _mount(
                    "none",
                    prefix,
                    None,
                    _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
                )
            os.close(fd)


def _cover(path: str) -> None:
    """Hide `path` inside the namespace: an empty tmpfs over a directory (where an exposed
    directory may be bound back), /dev/null over a file; nothing where it is absent."""
    if os.path.isdir(path):
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,mode=755")
    elif os.path.exists(path):
        _mount("/dev/null", path, None, _MS_BIND)


def _drop_to(uid: int) -> None:
    """Become `uid` (group too, no supplementary groups) for good; OSError if not allowed."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (this run's alone): kill(-1) sent as that uid signals
    exactly those."""
    child = os.fork()
    if child == 0:
        try:
            os.setresuid(uid, uid, uid)
            for _ in range(3):  # a forking process may add one during a sweep
                with contextlib.suppress(ProcessLookupError):
                    os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def _sweep_uid(uid: int) -> None:
    """After a dropped-uid run (no namespaces): kill what is left of it and remove the files it
    left in the shared scratch places."""
    _kill_uid(uid)
    for folder in {*_SHARED_SCRATCH, tempfile.gettempdir()}:
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)


def _mirror_child_and_exit() -> None:
    """In the process between Popen and the namespace's pid 1: wait for it, exit the same way.

    It closes every descriptor first, so Popen sees the exec succeed and the pipes reach EOF
    when the program's side closes; it never returns."""
    code = 255  # what the caller sees if anything below fails
    try:
        os.closerange(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        _, status = os.wait()
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
    finally:
        os._exit(code if code >= 0 else 128 - code)


def _probe_user_netns() -> bool:
    """Whether this (unprivileged) process may create a user + network namespace."""
    if _LIBC is None:
        return False
    child = os.fork()
    if child == 0:
        os._exit(0 if _LIBC.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0


def _supervise(
    proc: subprocess.Popen, stdin: bytes, limits: Limits, start: float, stray_uid: int | None
) -> tuple[_Capture, bool, float]:
    """Feed stdin, read both pipes under the cap, reap the program, stop at the deadline.

    Returns the capture, whether the deadline passed, and the CPU seconds the program used.
    When the program exits, whatever it left running is killed at once, so a background
    child holding the pipes open cannot stretch the run to the deadline."""
    assert proc.stdin and proc.stdout and proc.stderr
    capture = _Capture(limits.output_bytes)
    deadline = start + limits.wall_seconds
    pending = memoryview(stdin)
    cpu = 0.0
    pidfd = os.pidfd_open(proc.pid)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    else:
        proc.stdin.close()
    try:
        while sel.get_map() and not capture.overflow:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return capture, True, cpu
            for key, _ in sel.select(remaining):
                if key.data == "stdin" and proc.stdin.closed:
                    continue  # the exit, handled first in this same batch, closed it
                if key.data == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending[:_READ_CHUNK]) :]
                    except BrokenPipeError:  # the program closed its stdin: input not needed
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                elif key.data == "exit":
                    sel.unregister(pidfd)
                    _, status, usage = os.wait4(proc.pid, 0)
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    cpu = usage.ru_utime + usage.ru_stime
                    _kill_all(proc.pid, stray_uid)
                    if not proc.stdin.closed:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                elif chunk := os.read(key.fd, _READ_CHUNK):
                    capture.add(key.data, chunk)
                else:
                    sel.unregister(key.fileobj)
        return capture, False, cpu
    finally:
        sel.close()
        os.close(pidfd)


def _kill_all(pid: int, stray_uid: int | None = None) -> None:
    """SIGKILL the program's process group, and every process of `stray_uid` (the run's own uid
    when there is no pid namespace: it finds setsid escapees). In the namespaced mode the group
    holds the namespace's pid 1, whose death takes every other process of it along."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if stray_uid is not None:
        _kill_uid(stray_uid)


def _classify(
    capture: _Capture,
    timed_out: bool,
    cpu: float,
    code: int | None,
    limits: Limits,
    wall: float,
    isolation: tuple[str, ...],
) -> RunResult:
    """Name the outcome. `code` is the exit status, minus the signal number, or None."""
    stdout = capture.stdout.decode("utf-8", errors="replace")
    stderr = capture.stderr.decode("utf-8", errors="replace")

    def result(status: str, detail: str = "") -> RunResult:
        return RunResult(status, stdout, stderr, code, wall, isolation, detail)

    if capture.overflow:
        return result("output_limit", f"{capture.overflow} exceeded {limits.output_bytes} bytes")
    if timed_out:
        return result("timeout", f"still running after {limits.wall_seconds:g} s wall clock")
    # RLIMIT_CPU sends SIGXCPU at the soft limit and SIGKILL at the hard one. The kernel counts
    # exactly, but rusage is tick-sampled and reads up to ~15% low on a busy machine, hence the
    # wide margin (nothing else here sends SIGKILL short of the OOM killer).
    enforced_cpu = max(1, math.ceil(limits.cpu_seconds))
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= 0.5 * enforced_cpu):
        return result("cpu_limit", f"used {cpu:.2f} s of CPU (limit {limits.cpu_seconds:g} s)")
    # Python ignores SIGXFSZ, so a too-large file shows as EFBIG (or ENOSPC on the scratch fs).
    if code == -signal.SIGXFSZ or (
        code != 0 and ("[Errno 27]" in stderr or "[Errno 28]" in stderr)
    ):
        return result("output_limit", f"files exceeded {limits.file_bytes} bytes")
    if code != 0 and "MemoryError" in stderr:
        return result("memory_limit", f"MemoryError (limit {limits.memory_bytes} bytes)")
    if code == 0:
        return result("ok")
    last = (stderr.strip().splitlines() or [""])[-1][:200]
    how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
    return result("runtime_error", f"{how}: {last}" if last else how)


# Docker's spelling of PR_SET_NO_NEW_PRIVS for every process of a container.
NO_NEW_PRIVILEGES = "no-new-privileges"

# Built offline from Debian's packages by scripts/swe-docker-image.sh (python3, git, pytest);
# no image registry is reachable, so nothing defaults to an image that must be pulled.
OFFLINE_IMAGE = "evotrainer-swe:bookworm"


class DockerSandbox:
    """The same interface, one throw-away container per run (`docker` SDK, daemon required).

    Enforced by Docker: network disabled, no new privileges, memory (no swap), pids, one CPU,
    RLIMIT_CPU and RLIMIT_FSIZE ulimits (stdout goes to a file, so the file limit caps it), a
    non-root user, the wall deadline (the container is killed and removed)."""

    def __init__(self, image: str = OFFLINE_IMAGE, client: object | None = None) -> None:
        import docker  # optional dependency: only this class needs it

        self.image = image
        self.client = client or docker.from_env()

    @staticmethod
    def image_present(image: str = OFFLINE_IMAGE) -> bool:
        """True when the daemon holds `image` (nothing is ever pulled: no registry here)."""
        try:
            import docker

            docker.from_env(timeout=3).images.get(image)
            return True
        except Exception:  # no SDK, no daemon, no such image: all mean "not here"
            return False

    @staticmethod
    def available() -> bool:
        """True when the SDK is installed and a daemon answers a ping."""
        try:
            import docker

            return bool(docker.from_env(timeout=3).ping())
        except Exception:  # no SDK, no socket, daemon down: all mean "not available"
            return False

    def run(self, source: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
        from docker.types import Ulimit
        from requests.exceptions import RequestException  # a docker SDK dependency

        limits = limits or Limits()
        cpu = max(1, math.ceil(limits.cpu_seconds))
        start = time.monotonic()
        container = self.client.containers.create(
            self.image,
            ["sh", "-c", "python3 -I -S -X utf8 main.py <stdin.txt >stdout.txt 2>stderr.txt"],
            working_dir="/tmp",
            user=f"{NOBODY}:{NOBODY}",
            network_disabled=True,
            mem_limit=limits.memory_bytes,
            memswap_limit=limits.memory_bytes,
            pids_limit=limits.processes,
            nano_cpus=10**9,
            security_opt=[NO_NEW_PRIVILEGES],
            ulimits=[
                Ulimit(name="cpu", soft=cpu, hard=cpu + 1),
                Ulimit(name="fsize", soft=limits.output_bytes, hard=limits.output_bytes),
            ],
        )
        isolation = ("rlimits", "wall_clock", "output_cap", "uid", "netns", "mountns", "docker")

        def result(status: str, detail: str) -> RunResult:
            return RunResult(status, "", "", None, time.monotonic() - start, isolation, detail)

        try:
            container.put_archive("/tmp", tar_files({"main.py": source, "stdin.txt": stdin}))
            container.start()
            try:
                status = container.wait(timeout=limits.wall_seconds)["StatusCode"]
            except RequestException:  # the HTTP read timed out: the deadline passed
                container.kill()
                return result("timeout", f"still running after {limits.wall_seconds:g} s")
            container.reload()
            if container.attrs["State"].get("OOMKilled"):
                return result("memory_limit", f"OOM-killed (limit {limits.memory_bytes} bytes)")
            stdout = _untar(container, "/tmp/stdout.txt", limits.output_bytes)
            stderr = _untar(container, "/tmp/stderr.txt", limits.output_bytes)[-_STDERR_KEEP:]
        finally:
            container.remove(force=True)
        capture = _Capture(limits.output_bytes, bytearray(stdout), bytearray(stderr))
        # sh reports a python killed by signal N as exit status 128 + N.
        code = -(status - 128) if status > 128 else status
        cpu_used = float(cpu) if code in (-signal.SIGXCPU, -signal.SIGKILL) else 0.0
        return _classify(
            capture, False, cpu_used, code, limits, time.monotonic() - start, isolation
        )


def check_executor(executor: str, image: str) -> None:
    """EvoError naming `domain.params.executor` when it is `docker` without the SDK, a daemon
    that answers or `image` present (nothing is ever pulled). Its allowed values are the
    domain's params schema."""
    if executor == "docker" and not DockerSandbox.image_present(image):
        raise EvoError(
            f"executor docker needs the docker SDK, a reachable daemon and the image {image!r}",
            field="domain.params.executor",
            hint="pip install docker, start dockerd, run scripts/swe-docker-image.sh; "
            "or use executor: local",
        )


_SANDBOXES: dict[str, Sandbox] = {}


def default_sandbox(
    executor: str = "local", image: str = OFFLINE_IMAGE, expose: tuple[str, ...] = ()
) -> Sandbox:
    """One sandbox per executor, image and exposed directories, and process (a Docker client
    is worth reusing)."""
    key = f"{executor}:{image}:{expose}"
    if key not in _SANDBOXES:
        _SANDBOXES[key] = (
            DockerSandbox(image) if executor == "docker" else LocalSandbox(expose=expose)
        )
    return _SANDBOXES[key]


def tar_files(files: dict[str, str], owner: int = 0) -> bytes:
    """A tar of `files` (name → text) for `put_archive`, each 0o644 and owned by uid and
    gid `owner`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.uid, info.gid = len(data), 0o644, owner, owner
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _untar(container: object, path: str, limit: int) -> bytes:
    stream, _ = container.get_archive(path)  # type: ignore[attr-defined]
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as archive:
        member = archive.getmembers()[0]
        extracted = archive.extractfile(member)
        return extracted.read(limit) if extracted else b""
