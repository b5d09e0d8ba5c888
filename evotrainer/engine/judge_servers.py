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
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from evotrainer.domains import ServedEndpoint
from evotrainer.domains.judge import check_serve
from evotrainer.errors import EvoError

POLL_S = 0.2
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 8
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the server's process before it starts (Linux): SIGTERM when the process that
    started it dies, so a job killed outright (SIGKILL, OOM) leaves no server behind."""
    # Elsewhere (no prctl) the ExitStack's stop is all there is.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


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
                 cache_dir: Path) -> None:
        self.serve, self.field = dict(serve), field
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{os.getpid()}-{time.time_ns()}"
        self.log_path = log_dir / f"judge-server-{stamp}.log"
        self.ready_file = log_dir / f"judge-server-{stamp}.json"
        self.port: int | None = None
        if serve.get("command"):
            self.port = _free_port()
            argv = [a.replace("{port}", str(self.port)) for a in serve["command"]]
        else:
            source = ["--path", str(serve["path"])] if serve.get("path") else [
                "--package", str(serve["package"])]
            argv = [sys.executable, "-m", "evotrainer.engine.serve", *source,
                    "--ready-file", str(self.ready_file), "--cache-dir", str(cache_dir)]
        with self.log_path.open("wb") as log:
            try:
                self.process = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group: stopping it stops its children
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            except OSError as exc:
                raise EvoError(f"the judge server cannot start ({exc})", field=field,
                               hint="check serve.command names an installed program") from None

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

    def _failed(self, what: str) -> EvoError:
        self.stop()
        return EvoError(f"the judge server {what}; its log ends: {_tail(self.log_path)}",
                        field=self.field, where=str(self.log_path),
                        hint="fix the serve section (a loadable model, an installed server) "
                        "or give the judge an endpoint")

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
        self.ready_file.unlink(missing_ok=True)


@contextmanager
def served_judges(
    judges: Sequence[Mapping[str, Any]] | None,
    log_dir: Path,
    cache_dir: Path,
    log: Callable[[str], None] = print,
) -> Iterator[dict[str, ServedEndpoint]]:
    """Start a server for each distinct `serve` section among `judges` (judges with the same
    section share one), yield {judge name: endpoint}, stop them all on the way out."""
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
                server = JudgeServer(serve, field, log_dir, cache_dir)
                stack.callback(server.stop)
                began = time.monotonic()
                started[key] = server.wait_ready(float(serve.get("startup_timeout_s", 600)))
                log(f"judge {judge['name']}: serving {started[key].served.get('model')} at "
                    f"{started[key].url} (ready in {time.monotonic() - began:.1f}s)")
            endpoints[str(judge["name"])] = started[key]
        yield endpoints
