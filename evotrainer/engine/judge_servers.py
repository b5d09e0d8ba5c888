"""The servers a run starts for its `serve:` judges, and stops when it ends.

`served_judges(judges, ...)` is a context manager: for each distinct `serve` section of the
recipe's `reward.judges` it starts one server, waits until it answers, and yields
{judge name: ServedEndpoint} for `make_domain(..., endpoints=)`. Two kinds:

- `serve: {path | package}`: the built-in server (`python -m evotrainer.engine.serve`) over
  a checkpoint the engine can load; it reports its model's content digest, which the run
  records as the judge's identity.
- `serve: {command: [...]}`: a server the user has (vLLM, llama.cpp's llama-server, ...),
  started without a shell, `{port}` replaced by a free loopback port; ready when
  `GET /v1/models` answers, and its first model is the judge's unless the judge names one.

Servers run in their own process group, their output in a log file under `log_dir`; a
server that exits or does not answer within `startup_timeout_s` fails the run with the
log's last lines. Importing this module imports no torch.

A `command` server is a program the recipe names, so it is confined as a job is: its
environment is the caller's (a job's allow-listed one, or what `env` gives) without any
variable that is one of the controller's secrets or is named like a secret; as root it runs
as a fresh unprivileged uid (the sandbox's uid switch: no supplementary groups, no new
privileges), with a scratch HOME and TMPDIR of its own, so it can read neither the record
key (mode 0600) nor another process's environment, and when it stops every process of that
uid is killed and its files in the shared temp folders removed. Without root it runs as the
caller: the review that approved the recipe is then the boundary. The built-in server
(`path`/`package`) is the installed engine's own code and gets the same environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from evotrainer.domains import ServedEndpoint
from evotrainer.domains.data import DATA_ROOTS_ENV
from evotrainer.domains.judge import check_serve, controller_secret, named_like_secret
from evotrainer.errors import EvoError
from evotrainer.sandbox.process import _drop_to, _sweep_uid

POLL_S = 0.2
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 8
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_NO_NEW_PRIVS = 38
CACHE_DIR_ENV = "EVOTRAINER_CACHE_DIR"  # the engine's shared cache (warm starts, models)
# The uids command servers run as (root only): a range of their own, below the sandbox's
# (1 << 30 and up), so a sandbox sweeping its uid never reaches a server, nor the reverse.
_SERVER_UID_BASE = 1 << 29
_SERVER_UIDS = itertools.count()


def _die_with_parent() -> None:
    """In the server's process before it starts (Linux): SIGTERM when the process that
    started it dies, so a job killed outright (SIGKILL, OOM) leaves no server behind."""
    # Elsewhere (no prctl) the ExitStack's stop is all there is.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def server_environment(env: Mapping[str, str] | None = None,
                       keep: tuple[str, ...] = ()) -> dict[str, str]:
    """What a judge server is given: `env` (default: this process's environment, a job's
    allow-listed one inside a job) without the controller's secrets or any variable named
    like a secret. `keep`: the engine's own settings the built-in server reads (its data
    roots), which a command server never gets."""
    base = os.environ if env is None else env
    return {name: value for name, value in base.items()
            if (name in keep or not controller_secret(name))
            and not named_like_secret(name)}


def _server_uid() -> int | None:
    """A fresh unprivileged uid for a command server, or None where this process cannot
    switch uids (not root, or not Linux): the server then runs as the caller."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return None
    return _SERVER_UID_BASE + (os.getpid() % (1 << 20)) * 64 + next(_SERVER_UIDS) % 64


def _confined(uid: int) -> Callable[[], None]:
    """The preexec step of a command server run as `uid`."""
    def setup() -> None:
        _drop_to(uid)
        # After the switch: a change of credentials clears the parent-death signal.
        _die_with_parent()
        with contextlib.suppress(OSError, AttributeError):
            # No setuid binary or file capability gives the server back what it dropped.
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    return setup


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in lines[-LOG_TAIL_LINES:] if line.strip())


def _listed_model(url: str) -> str | None:
    """The first model id `GET {url}/models` lists, or None while the server is not up."""
    # A loopback server: no proxy from the environment stands between.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/models", timeout=2) as reply:
            data = json.loads(reply.read())
        return str(data["data"][0]["id"])
    except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError, TypeError):
        return None


class JudgeServer:
    """One started server: its process, log and where it answers."""

    def __init__(self, serve: Mapping[str, Any], field: str, log_dir: Path,
                 cache_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.serve, self.field = dict(serve), field
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{os.getpid()}-{time.time_ns()}"
        self.log_path = log_dir / f"judge-server-{stamp}.log"
        self.ready_file = log_dir / f"judge-server-{stamp}.json"
        self.port: int | None = None
        self.uid: int | None = None
        self.scratch: str | None = None
        preexec = _die_with_parent if sys.platform == "linux" else None
        if serve.get("command"):
            environment = server_environment(env)
            self.port = _free_port()
            argv = [a.replace("{port}", str(self.port)) for a in serve["command"]]
            self.uid = _server_uid()
            if self.uid is not None:
                # Its own HOME and TMPDIR (caches, sockets): nothing of the caller's.
                self.scratch = tempfile.mkdtemp(prefix="evotrainer-judge-")
                os.chown(self.scratch, self.uid, self.uid)
                environment.update(HOME=self.scratch, TMPDIR=self.scratch)
                preexec = _confined(self.uid)
        else:
            source = ["--path", str(serve["path"])] if serve.get("path") else [
                "--package", str(serve["package"])]
            argv = [sys.executable, "-m", "evotrainer.engine.serve", *source,
                    "--ready-file", str(self.ready_file), "--cache-dir", str(cache_dir)]
            # serve.path resolves inside the job's folder and its declared data roots.
            environment = server_environment(env, keep=(DATA_ROOTS_ENV, CACHE_DIR_ENV))
        with self.log_path.open("wb") as log:
            try:
                self.process = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=environment,
                    start_new_session=True,  # its own group: stopping it stops its children
                    preexec_fn=preexec)
            except (OSError, subprocess.SubprocessError) as exc:
                self._clean()
                raise EvoError(f"the judge server cannot start ({exc})", field=field,
                               hint="check serve.command names an installed program"
                               + self._as_uid()) from None

    def wait_ready(self, timeout_s: float) -> ServedEndpoint:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._failed(f"exited with status {self.process.returncode}")
            endpoint = self._endpoint()
            if endpoint is not None:
                return endpoint
            time.sleep(POLL_S)
        raise self._failed(f"did not answer within startup_timeout_s={timeout_s:g}")

    def _endpoint(self) -> ServedEndpoint | None:
        if self.port is not None:
            url = f"http://127.0.0.1:{self.port}/v1"
            model = _listed_model(url)
            if model is None:
                return None
            return ServedEndpoint(url, {"command": list(self.serve["command"]), "model": model})
        if not self.ready_file.is_file():
            return None
        ready = json.loads(self.ready_file.read_text(encoding="utf-8"))
        source = {k: self.serve[k] for k in ("path", "package") if self.serve.get(k)}
        return ServedEndpoint(ready["url"], {**source, "model": ready["model"],
                                             "digest": ready["digest"]})

    def _as_uid(self) -> str:
        if self.uid is None:
            return ""
        return (f" (it runs as the unprivileged uid {self.uid}, without the caller's secrets: "
                "its program, model and working folder must be readable by others)")

    def _failed(self, what: str) -> EvoError:
        self.stop()
        return EvoError(f"the judge server {what}; its log ends: {_tail(self.log_path)}",
                        field=self.field, where=str(self.log_path),
                        hint="fix the serve section (a loadable model, an installed server) "
                        "or give the judge an endpoint" + self._as_uid())

    def _clean(self) -> None:
        """What a confined server leaves: every process of its uid (setsid or not) and its
        files in the shared temp folders, then its scratch folder."""
        if self.uid is not None:
            _sweep_uid(self.uid)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        self.ready_file.unlink(missing_ok=True)
        self._clean()


@contextmanager
def served_judges(
    judges: Sequence[Mapping[str, Any]] | None,
    log_dir: Path,
    cache_dir: Path,
    log: Callable[[str], None] = print,
    env: Mapping[str, str] | None = None,
) -> Iterator[dict[str, ServedEndpoint]]:
    """Start a server for each distinct `serve` section among `judges` (judges with the same
    section share one), yield {judge name: endpoint}, stop them all on the way out. `env`:
    the environment servers start from (default: this process's; see the module doc for
    what never passes). The caller runs only judges a reviewer approved: a version's as its
    approval binds them (`backtest reward` reads no unapproved branch), a job's (launched
    only once approved), or a file the user names."""
    endpoints: dict[str, ServedEndpoint] = {}
    with ExitStack() as stack:
        started: dict[str, ServedEndpoint] = {}
        for index, judge in enumerate(judges or []):
            serve = (judge or {}).get("serve")
            if serve is None:
                continue
            field = f"reward.judges[{index}].serve"
            check_serve(serve, field)
            key = json.dumps(serve, sort_keys=True)
            if key not in started:
                server = JudgeServer(serve, field, log_dir, cache_dir, env)
                stack.callback(server.stop)
                began = time.monotonic()
                started[key] = server.wait_ready(float(serve.get("startup_timeout_s", 600)))
                confined = f", as uid {server.uid}" if server.uid is not None else ""
                log(f"judge {judge['name']}: serving {started[key].served.get('model')} at "
                    f"{started[key].url} (ready in {time.monotonic() - began:.1f}s{confined})")
            endpoints[str(judge["name"])] = started[key]
        yield endpoints
