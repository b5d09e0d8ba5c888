"""The trusted program that runs wherever executed code is scored: inside the local sandbox or
a container, one request per run. It serves a `swe` episode's actions and verdicts, a
`swe_rebench` evaluation and a `humaneval` check. Standalone: the standard library only, no
evotrainer import, because this file's text, with the programs it starts in a child
(graders/) written into `PROGRAMS`, is what the executor runs (`SOURCE`:
`python -I -S runner.py [REQUEST.json]`, else the request on stdin).

The request is JSON: `kind` (shell | write | patch | evaluate | check | pytest), the action's
fields, `repo` (where the repository is), optionally `snapshot` (base64 tar of `repo/...` to
unpack first: the local executor carries the repository between runs this way),
`return_snapshot` and `nonce`. The reply, on stdout, is JSON: `output` (what the agent
sees), `exit_code`, for `evaluate` and `pytest` `results` ({test id: "pass" | "fail"}), for
`check` the verdicts, for all three `tampered` (what the code under test tried), and
`snapshot` when asked for. With a `nonce` the reply is one line, the nonce, a space and the
JSON (`read_report` checks it on the host).

Why the verdicts cannot be forged: the code under test never runs in this process. It runs in
a child (graders/call_server.py) that gets literal arguments and answers with literal values;
the tests run here, against those values, with a type-strict equality (`strict_equal`), and every
verdict is decided here. Before that child starts, this process makes itself non-dumpable
(prctl PR_SET_DUMPABLE 0), so a process of the same uid can neither trace it nor open its
/proc/<pid>/mem or /proc/<pid>/fd; the child's descriptors are two pipes to this process and
/dev/null, never this process's stdout; the nonce reaches this process on stdin (or in a
request file deleted once read) before anything untrusted starts, so a report that does not
carry it was written by someone else. An exit, a signal, a malformed reply or a closed channel
in the child is recorded in `tampered`; a missing report is the host's to count.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import hashlib
import hmac
import io
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path

# Identity and paths for the agent's commands: git commits work, `python3` is this interpreter.
AGENT_ENV = {
    "LANG": "C.UTF-8",
    "GIT_AUTHOR_NAME": "agent",
    "GIT_AUTHOR_EMAIL": "agent@localhost",
    "GIT_COMMITTER_NAME": "agent",
    "GIT_COMMITTER_EMAIL": "agent@localhost",
    "GIT_PAGER": "cat",
    "PAGER": "cat",
}


def command_env(scratch: str, python: str | None = None) -> dict[str, str]:
    """The environment of a command: `python` (the repository's test environment, when the
    request names one) first on the PATH, else this interpreter."""
    first = os.path.dirname(python if python and os.path.isabs(python) else sys.executable)
    path = os.pathsep.join([first, "/usr/local/bin", "/usr/bin", "/bin"])
    return {**AGENT_ENV, "PATH": path, "HOME": scratch, "TMPDIR": scratch}


def run_process(argv: list[str], repo: str, timeout: float, cap: int, stdin: str = "",
                python: str | None = None) -> dict:
    """Run `argv` in `repo`, stdout and stderr together into a file (the file-size limit of the
    executor bounds it), killing its whole process group at the deadline; the first `cap`
    bytes of output come back."""
    scratch = tempfile.mkdtemp(prefix="swe-")
    out_path = os.path.join(scratch, "output")
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=repo,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=command_env(scratch, python),
            start_new_session=True,
        )
        timed_out = False
        try:
            proc.communicate(stdin.encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(out_path, "rb") as out:
        data = out.read(cap + 1)
    text = data[:cap].decode("utf-8", errors="replace")
    if len(data) > cap:
        text += "\n[output truncated]"
    if timed_out:
        text += f"\n[timed out after {timeout:g} s]"
    return {"output": text, "exit_code": None if timed_out else proc.returncode}


def inside(repo: str, path: str) -> str | None:
    """The absolute path of `path` when it is a relative path that stays inside `repo`."""
    if not path or os.path.isabs(path):
        return None
    full = os.path.realpath(os.path.join(repo, path))
    root = os.path.realpath(repo)
    return full if full.startswith(root + os.sep) else None


def do_shell(repo: str, request: dict) -> dict:
    return run_process(["/bin/sh", "-c", request["command"]], repo, request["timeout"],
                       request["cap"], python=request.get("python"))


def do_write(repo: str, request: dict) -> dict:
    target = inside(repo, request["path"])
    if target is None or target.startswith(os.path.join(os.path.realpath(repo), ".git") + os.sep):
        return {
            "output": f"error: {request['path']!r} is not a file path inside the repository",
            "exit_code": 1,
        }
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w", encoding="utf-8") as f:
        f.write(request["content"])
    return {
        "output": f"wrote {len(request['content'].encode())} bytes to {request['path']}",
        "exit_code": 0,
    }


def do_patch(repo: str, request: dict) -> dict:
    argv = ["git", "apply", "--recount", "--whitespace=nowarn", "-"]
    result = run_process(argv, repo, request["timeout"], request["cap"], request["diff"])
    if result["exit_code"] == 0 and not result["output"]:
        result["output"] = "patch applied"
    return result


def protect_from_children() -> None:
    """Make this process non-dumpable (prctl PR_SET_DUMPABLE = 4, value 0): a same-uid process
    then needs CAP_SYS_PTRACE to trace it or to open its /proc/<pid>/mem, fd or environ, so
    the code under test cannot rewrite a verdict in memory or write to this process's stdout.
    OSError when the kernel refuses: then nothing untrusted may run."""
    import ctypes  # here, not at the top: only the scoring requests need it

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_DUMPABLE, 0): {os.strerror(errno)}")


# The programs this runner starts in a child (graders/call_server.py, the side of the code
# under test; graders/pytest_bootstrap.py, a `pytest` evaluation's test process), by name:
# their text. Where this file runs alone (the executor's copy, `SOURCE`) they are written
# into this line; imported, they are read from the modules beside it.
PROGRAMS: dict[str, str] = {}


def program(name: str) -> str:
    """The text of the program `name` (a module of evotrainer/sandbox/graders)."""
    if name not in PROGRAMS:
        folder = Path(__file__).resolve().parent / "graders"
        PROGRAMS[name] = (folder / f"{name}.py").read_text(encoding="utf-8")
    return PROGRAMS[name]


CALL_LIMIT_S = 3.0  # per call, as run_tests.py's per-test limit
# The longest reply line read: a larger value is no answer (and parsing it would spend the
# checker's own CPU limit).
REPLY_LIMIT = 1 << 22
# Signals that end a process without its asking: limits (SIGKILL: the CPU hard limit or the
# OOM killer; SIGXCPU; SIGXFSZ) and faults (a crash is a runtime error, not an attack).
UNASKED_SIGNALS = frozenset({signal.SIGKILL, signal.SIGXCPU, signal.SIGXFSZ, signal.SIGSEGV,
                             signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL})


class CallFailed(Exception):
    """The code under test raised, hung, crashed, exited, or returned a non-literal value.
    `verdict` names the outcome for a check (runtime_error, wrong_answer, timeout, cpu_limit,
    memory_limit)."""

    def __init__(self, message: str, verdict: str = "runtime_error") -> None:
        super().__init__(message)
        self.verdict = verdict


class RepoCalls:
    """Calls into the modules of `repo` through one child process (restarted after a failure):
    arguments and results cross as Python literals only. `tampered` lists what the child did
    that no honest code does: exit or die of a signal while a call was pending, raise
    SystemExit, write a malformed reply, close its channel."""

    def __init__(self, repo: str, scratch: str) -> None:
        self.repo, self.scratch, self.child = repo, scratch, None
        self.pending = b""
        self.tampered: list[str] = []

    def call(self, module: str, name: str, args: tuple, limit: float = CALL_LIMIT_S) -> object:
        text = repr(args)
        try:
            ast.literal_eval(text)
        except (ValueError, SyntaxError) as err:
            raise CallFailed(f"arguments are not literals: {text[:80]}") from err
        if limit <= 0:
            raise CallFailed("no time left for the call", "timeout")
        if self.child is None:
            try:
                self.child = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", program("call_server")],
                    cwd=self.repo,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    env=command_env(self.scratch),
                    start_new_session=True,
                )
            except OSError as err:  # out of processes or memory: the code's doing, or not
                raise CallFailed(f"could not start the code under test: {err}") from err
        try:
            line = json.dumps({"module": module, "name": name, "args": text}) + "\n"
            self.child.stdin.write(line.encode())
            self.child.stdin.flush()
        except OSError:
            pass  # the child is gone: reading below finds out how
        reply = self._read_line(limit)
        if reply is None:
            self.close()
            raise CallFailed(f"the call did not return within {limit:.1f} s", "timeout")
        if len(reply) > REPLY_LIMIT:
            self.close()
            raise CallFailed(f"a value of more than {REPLY_LIMIT} bytes", "wrong_answer")
        if reply == b"":
            raise self._ended()
        try:
            answer = json.loads(reply)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not ("value" in answer or "error" in answer):
            self.tampered.append("a malformed reply on the call channel")
            self.close()
            raise CallFailed("a malformed reply")
        if "error" in answer:
            error = str(answer["error"])
            if answer.get("exit"):
                self.tampered.append(f"raised {error.split(':')[0]} during a call")
            verdict = "memory_limit" if error.startswith("MemoryError") else "runtime_error"
            raise CallFailed(error, verdict)
        try:
            return ast.literal_eval(str(answer["value"]))
        except (ValueError, SyntaxError, MemoryError, RecursionError) as err:
            raise CallFailed(f"not a literal value: {str(answer['value'])[:80]}",
                             "wrong_answer") from err

    def _read_line(self, limit: float) -> bytes | None:
        """One reply line; b"" at end of file; None when none came within `limit` seconds."""
        deadline = time.monotonic() + limit
        fd = self.child.stdout.fileno()
        while b"\n" not in self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.pending = b""
                return b""
            self.pending += chunk
            if len(self.pending) > REPLY_LIMIT:
                return self.pending
        line, _, self.pending = self.pending.partition(b"\n")
        return line + b"\n"

    def _ended(self) -> CallFailed:
        """The child closed its channel during a call: name how it ended."""
        code, cpu = self.close(grace=1.0)
        if code is None:
            self.tampered.append("closed the call channel")
            return CallFailed("the code under test closed its channel")
        if code >= 0:
            self.tampered.append(f"exited with status {code} during a call")
            return CallFailed(f"the code under test exited with status {code}")
        if -code in UNASKED_SIGNALS:
            cpu_limit = resource_cpu_limit()
            if -code == signal.SIGXCPU or (-code == signal.SIGKILL and cpu >= 0.5 * cpu_limit):
                return CallFailed(f"used {cpu:.2f} s of CPU", "cpu_limit")
            if -code == signal.SIGKILL:
                return CallFailed("killed (out of memory?)", "memory_limit")
            return CallFailed(f"the code under test crashed (signal {-code})")
        self.tampered.append(f"killed by signal {-code} during a call")
        return CallFailed(f"the code under test died of signal {-code}")

    def close(self, grace: float = 0.0) -> tuple[int | None, float]:
        """Stop the child and its process group: (its exit status, or minus the signal that
        ended it, or None when it was still running after `grace` seconds; its CPU seconds)."""
        if self.child is None:
            return None, 0.0
        child, self.child, self.pending = self.child, None, b""
        status, usage = None, None
        deadline = time.monotonic() + grace
        while True:
            pid, raw, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                status = os.waitstatus_to_exitcode(raw)
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        if status is None:
            _, raw, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(raw)  # reaped here, not by Popen
        for pipe in (child.stdin, child.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        return status, usage.ru_utime + usage.ru_stime


def resource_cpu_limit() -> float:
    """This process's CPU limit in seconds (inherited by the child), infinity when unset."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_CPU)[0]
    return float("inf") if soft == resource.RLIM_INFINITY else float(soft)


def strict_equal(actual: object, expected: object) -> bool:
    """Equality a type cannot bend: both sides of one type (an int and a float compare by value;
    a bool is not a number here: False is not an answer to "0"), containers element by
    element. The checks' `==` and `!=` are rewritten to call it (STRICT_EQUAL)."""
    numbers = (int, float)
    if type(actual) is not type(expected):
        return type(actual) in numbers and type(expected) in numbers and actual == expected
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(
            strict_equal(a, e) for a, e in zip(actual, expected, strict=True))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            strict_equal(actual[k], expected[k]) for k in actual)
    return actual == expected


STRICT_EQUAL = "_evotrainer_strict_equal"


class RepoModule(types.ModuleType):
    """What `from solution import f` gives the tests: a function that calls the repository's
    `solution.f` in the child."""

    def __init__(self, name: str, calls: RepoCalls) -> None:
        super().__init__(name)
        self._calls = calls

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *args: self._calls.call(self.__name__, attr, args)


def do_evaluate(repo: str, request: dict) -> dict:
    """Run the pristine tests (their text comes with the request, never from the repository)
    here, in the runner, against the repository's code called through a child process, and
    decide every verdict here: whatever the repository's code does (print a fake result,
    exit early, patch the runner, return an object equal to everything) stays in the child
    and can only make its own calls fail."""
    scratch = tempfile.mkdtemp(prefix="swe-")
    calls = RepoCalls(repo, scratch)
    results: dict[str, str] = {}
    lines = []
    try:
        for path in sorted(request["pristine"]):
            folder, name = os.path.split(path)
            if folder != "tests" or not (name.startswith("test_") and name.endswith(".py")):
                continue
            imported = {m: RepoModule(m, calls) for m in ("solution", "utils")}
            saved = {m: sys.modules.get(m) for m in imported}
            sys.modules.update(imported)
            namespace: dict = {"__name__": name[:-3]}
            try:
                exec(compile(request["pristine"][path], path, "exec"), namespace)
            except Exception as exc:  # a test file that does not load: its tests are absent
                lines.append(f"ERROR {path}: {type(exc).__name__}: {exc}")
                continue
            finally:
                for module, previous in saved.items():
                    if previous is None:
                        sys.modules.pop(module, None)
                    else:
                        sys.modules[module] = previous
            for test, fn in list(namespace.items()):
                if not (test.startswith("test_") and callable(fn)):
                    continue
                test_id = f"{path}::{test}"
                try:
                    fn()
                    results[test_id] = "pass"
                except Exception as exc:
                    results[test_id] = "fail"
                    lines.append(f"FAIL {test_id}: {type(exc).__name__}: {str(exc)[:80]}")
    finally:
        calls.close()
    passed = sum(v == "pass" for v in results.values())
    lines.append(f"{passed} passed, {len(results) - passed} failed")
    return {"output": "\n".join(lines), "exit_code": 0, "results": results,
            "tampered": calls.tampered}


# Verdicts after which the rest of a check is not run: it would hit the same limit.
LIMIT_VERDICTS = frozenset({"timeout", "cpu_limit", "memory_limit"})


def do_check(repo: str, request: dict) -> dict:
    """A HumanEval check, in one pass. `program` (the candidate's module) is imported only by
    the child; `preamble` (the prompt's imports, the test's top level) runs here, then the
    statements of `check(candidate)` in order, in one scope where `parameter` and `functions`
    (what the prompt defines, `entry_point` among them) call into the child. A statement that
    fails is recorded and the next one runs, so each assert statement gets its verdict without
    running anything twice: pass, wrong_answer (an assert failed, or a value that is not a
    literal), runtime_error, timeout, cpu_limit, memory_limit, or skipped (not run after a
    limit). `whole` is the first verdict other than pass of any statement (setup included),
    else pass: what the original check, stopping at its first failure, would say. All within
    `budget_s`."""
    deadline = time.monotonic() + float(request["budget_s"])
    folder = tempfile.mkdtemp(prefix="check-", dir=repo)
    with open(os.path.join(folder, "solution.py"), "w", encoding="utf-8") as f:
        f.write(request["program"])
    calls = RepoCalls(folder, folder)
    scope: dict = {"__name__": "__check__", STRICT_EQUAL: strict_equal}
    try:
        exec(compile(request["preamble"], "test.py", "exec"), scope)
    except Exception as exc:  # the test's own top level fails here: no assert can run
        return {"whole": "runtime_error", "tampered": [],
                "units": ["skipped" for s in request["statements"] if s["assert"]],
                "detail": f"the test's preamble failed: {type(exc).__name__}: {exc}"[:300]}
    for name in request["functions"]:
        scope[name] = (lambda fn: lambda *args: calls.call(
            "solution", fn, args, deadline - time.monotonic()))(name)
    scope[request["parameter"]] = scope[request["entry_point"]]
    whole, units, detail = "pass", [], ""
    try:
        for statement in request["statements"]:
            if whole in LIMIT_VERDICTS:
                outcome = "skipped"
            else:
                try:
                    exec(compile(statement["source"], "check.py", "exec"), scope)
                    outcome = "pass"
                except CallFailed as failed:
                    outcome, detail = failed.verdict, detail or str(failed)
                except AssertionError:
                    outcome = "wrong_answer"
                    detail = detail or f"assert failed: {statement['source'][:200]}"
                except Exception as exc:  # the check itself failed on what the code returned
                    outcome, detail = "runtime_error", detail or f"{type(exc).__name__}: {exc}"
                if whole == "pass":
                    whole = outcome
            if statement["assert"]:
                units.append(outcome)
    finally:
        calls.close()
    return {"whole": whole, "units": units, "tampered": calls.tampered, "detail": detail[:300]}


PYTEST_KEY_BYTES = 32


def read_records(data: bytes, key: bytes) -> tuple[list[list[str]], list[str]]:
    """The test process's authentic records in order, each [kind, fields...], and what was
    wrong with the channel: a line without a valid HMAC, a record out of sequence, or no
    `end` record (the process exited, crashed or was stopped before pytest finished)."""
    records, problems = [], []
    for line in data.decode("utf-8", "replace").splitlines():
        mac, _, body = line.partition(" ")
        expected = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, expected):
            problems.append("a record on the results channel that the grader did not write")
            continue
        number, _, rest = body.partition("\t")
        if number != str(len(records)):
            problems.append("a results record out of sequence")
            continue
        records.append(rest.split("\t"))
    if not records or records[-1][0] != "end":
        problems.append("the test process ended before pytest finished")
    return records, problems


# Names of the files that run by themselves in the test process (pytest's conftest, Python's
# startup hooks) and of pytest's configuration files: restored to the task's versions before
# the tests run, or removed when the task has none.
SELF_RUNNING = ("conftest.py", "sitecustomize.py", "usercustomize.py")
CONFIG_FILES = ("pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")


def self_running(path: str) -> bool:
    name = os.path.basename(path)
    return name in SELF_RUNNING or name.endswith(".pth")


def guarded(path: str) -> bool:
    return self_running(path) or os.path.basename(path) in CONFIG_FILES


def tree_digests(repo: str) -> dict[str, str]:
    """sha256 of every file of `repo` and of every link's target text (a link to a folder
    too, never followed), .git excluded."""
    digests = {}
    for root, dirs, names in os.walk(repo):
        dirs[:] = [d for d in dirs if not (root == repo and d == ".git")]
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            data = (os.readlink(path).encode() if os.path.islink(path)
                    else Path(path).read_bytes())
            digests[os.path.relpath(path, repo)] = hashlib.sha256(data).hexdigest()
    return digests


def _put(root: str, path: str, data: str | bytes | None) -> None:
    """Write `data` (text or bytes) at `path` under `root` (None: remove it), through real
    folders only: whatever file or link stands where a folder of the path should be is
    removed first."""
    parts = path.split("/")
    here = root
    for part in parts[:-1]:
        here = os.path.join(here, part)
        if os.path.islink(here) or (os.path.exists(here) and not os.path.isdir(here)):
            os.unlink(here)
        if data is not None:
            os.makedirs(here, exist_ok=True)
    target = os.path.join(here, parts[-1])
    if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target)
    elif os.path.lexists(target):
        os.unlink(target)
    if data is not None:
        with open(target, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)


def _clear_caches(root: str) -> None:
    """Remove compiled caches, which Python and pytest would take for the sources they name."""
    for folder, dirs, names in os.walk(root):
        for name in [d for d in dirs if d == "__pycache__"]:
            dirs.remove(name)
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        for name in names:
            if name.endswith((".pyc", ".pyo")):
                os.unlink(os.path.join(folder, name))


def _safe(path: str) -> bool:
    return not (".." in path.split("/") or path.startswith("/"))


def under(path: str, folders: list[str]) -> bool:
    """Whether `path` lies inside one of `folders` (paths relative to the repository)."""
    return any(path.startswith(folder.rstrip("/") + "/") for folder in folders)


def _put_back(root: str, request: dict) -> list[str]:
    """Put the task's files back over the episode's (see `do_pytest`); what the episode
    tried that no honest fix does, as `tampered` lines."""
    trusted, base = request["trusted"], request["base"]
    folders = [f for f in request.get("test_dirs", []) if f and _safe(f)]
    originals = request.get("originals", {})
    tampered: list[str] = []
    final = tree_digests(root)
    for path in sorted(final):
        full = os.path.join(root, path)
        if os.path.islink(full) and base.get(path) != final[path]:
            # A link of the episode's own could stand in for a test file or folder.
            _put(root, path, None)
            del final[path]
            tampered.append(f"added the link {path}")
        elif guarded(path) and path not in trusted and os.path.lexists(full):
            _put(root, path, None)
            del final[path]
            if self_running(path):
                tampered.append(f"added {path}")
        elif under(path, folders) and path not in trusted and base.get(path) != final[path]:
            # A file the episode added or changed in a test folder (a package's __init__.py
            # that installs an import hook, a helper the tests import): the base's, or none.
            original = originals.get(path)
            _put(root, path, None if original is None else base64.b64decode(original))
            del final[path]
    for path, original in sorted(originals.items()):
        if path not in final and under(path, folders) and _safe(path):
            _put(root, path, base64.b64decode(original))  # one the episode deleted
    for path, text in sorted(trusted.items()):
        if not _safe(path):
            continue
        digest = final.get(path)
        wanted = None if text is None else hashlib.sha256(text.encode()).hexdigest()
        if digest != wanted or (text is not None and os.path.islink(os.path.join(root, path))):
            _put(root, path, text)
            # The episode's own conftest (or startup hook): one it changed from the base's.
            if self_running(path) and digest is not None and digest != base.get(path):
                tampered.append(f"changed {path}")
    return tampered


def _run_test_process(root: str, request: dict, edited: list[str], sources: dict[str, str]
                      ) -> tuple[bytes, bytes, bool, int | None, bytes] | str:
    """Run the graded tests in the test process (graders/pytest_bootstrap.py): (the results
    channel's bytes, the output, timed out, the exit status, the key), or the reason it could
    not start (the environment's fault, not the code's). `sources`: each Python file's
    sha256 now, what a legitimate module load of it compiles."""
    key = secrets.token_bytes(PYTEST_KEY_BYTES)
    scratch = tempfile.mkdtemp(prefix="swe-")
    read_end, write_end = os.pipe()
    setup = {"key": key.hex(), "fd": write_end, "edited": edited, "sources": sources,
             "tests": request["tests"]}
    python = request.get("python") or sys.executable
    try:
        proc = subprocess.Popen(
            [python, "-I", "-c", program("pytest_bootstrap")],
            cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=command_env(scratch, request.get("python")), start_new_session=True,
            pass_fds=(write_end,),
        )
    except OSError as err:
        os.close(read_end)
        os.close(write_end)
        return f"the test environment's {python} could not start here: {err}"
    os.close(write_end)
    data, output, timed_out = _collect(proc, read_end, json.dumps(setup) + "\n",
                                       float(request["timeout"]), int(request["cap"]))
    return data, output, timed_out, proc.returncode, key


def _verdicts(tests: list[str], records: list[list[str]], problems: list[str]
              ) -> tuple[dict[str, str], list[str]]:
    """Each graded test's verdict from the authentic records ("fail" unless one says pass and
    the channel is sound), and the tests given two verdicts (tampering)."""
    results = {t: "fail" for t in tests}
    verdicts = [r[1:3] for r in records if r[0] == "test" and len(r) == 3]
    if not problems:  # a channel that was written to by anyone else, or cut short, decides none
        for test, outcome in verdicts:
            if test in results:
                results[test] = "pass" if outcome == "pass" else "fail"
    tampered = []
    named = [test for test, _ in verdicts]
    for test in sorted({t for t in named if named.count(t) > 1}):
        tampered.append(f"two verdicts for {test}")
        results[test] = "fail"
    return results, tampered


def do_pytest(repo: str, request: dict) -> dict:
    """A SWE-rebench-style evaluation: the task's test files (`trusted`, path → text, the
    test patch applied) written over whatever the episode left, every other file of the test
    folders (`test_dirs`) the episode added, changed or deleted put back to the base's
    (`originals`, path → base64) or removed, every other conftest, startup hook and pytest
    configuration file restored to the base tree's or removed, then `tests` run by pytest
    in a child (graders/pytest_bootstrap.py) whose verdicts come back signed on their own
    descriptor. `tampered` lists what the code under test tried: a conftest, hook or
    configuration of its own, introspection refused by the audit hook, an import hook,
    pytest's machinery changed, a plugin registered from an edited file, an object equal to
    everything in a graded comparison, a forged or missing record. The episode's edits of
    test files and pytest's configuration are put back silently (as SWE-bench applies the
    test patch): not tampering."""
    root = os.path.realpath(repo)
    _clear_caches(root)
    tampered = _put_back(root, request)
    base, trusted = request["base"], request["trusted"]
    sources = {p: d for p, d in tree_digests(root).items()
               if p.endswith(".py") and not os.path.islink(os.path.join(root, p))}
    edited = sorted(p for p, d in sources.items() if base.get(p) != d and p not in trusted)
    ran = _run_test_process(root, request, edited, sources)
    if isinstance(ran, str):  # the environment's fault, not the code's: the host says so
        return {"output": "", "exit_code": None, "results": {}, "tampered": tampered,
                "error": ran}
    data, output, timed_out, status, key = ran
    records, problems = read_records(data, key)
    failure = next((r[1] for r in records if r[0] == "error" and len(r) > 1), None)
    if failure:  # the environment's fault, not the code's: the host says so
        return {"output": "", "exit_code": None, "results": {}, "tampered": tampered,
                "error": failure}
    if timed_out:
        problems = [p for p in problems if "ended before" not in p]
    tampered += problems + [r[1].replace(root + os.sep, "") for r in records
                            if r[0] == "tampered" and len(r) > 1]
    results, twice = _verdicts(request["tests"], records, problems)
    text = output.decode("utf-8", "replace")[: int(request["cap"])]
    if timed_out:
        text += f"\n[timed out after {float(request['timeout']):g} s]"
    return {"output": text, "exit_code": None if timed_out else status,
            "results": results, "tampered": tampered + twice}


def _collect(proc: subprocess.Popen, channel: int, stdin: str, timeout: float, cap: int
             ) -> tuple[bytes, bytes, bool]:
    """(the results channel's bytes, the first `cap` bytes of output, timed out) of `proc`,
    reading both until it exits or `timeout` passes; its process group is killed then."""
    proc.stdin.write(stdin.encode())
    proc.stdin.close()
    deadline = time.monotonic() + timeout
    data, output = bytearray(), bytearray()
    streams = {channel: data, proc.stdout.fileno(): output}
    timed_out = False
    while streams:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        exited = proc.poll() is not None
        # Once it has exited, what is left in the pipes is read without waiting: a process it
        # left behind may hold them open.
        ready, _, _ = select.select(list(streams), [], [], 0 if exited else min(remaining, 0.2))
        if exited and not ready:
            break
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                del streams[fd]
            elif len(streams[fd]) < REPLY_LIMIT:
                streams[fd] += chunk
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    os.close(channel)
    proc.stdout.close()
    return bytes(data), bytes(output[:cap]), timed_out


def read_report(stdout: str, nonce: str) -> tuple[dict | None, str | None]:
    """The host's side of the reply channel: (the reply, None) when `stdout` is exactly one
    line, `nonce`, a space and a JSON object; else (None, why): "no report" (nothing written),
    "report not authenticated" (anything else on the channel, a wrong or missing nonce, a
    second line) or "malformed report"."""
    if not stdout:
        return None, "no report"
    head, space, body = stdout.partition(" ")
    if head != nonce or not space or not body.endswith("\n") or body.count("\n") != 1:
        return None, "report not authenticated"
    try:
        reply = json.loads(body)
    except ValueError:
        return None, "malformed report"
    return (reply, None) if isinstance(reply, dict) else (None, "malformed report")


ACTIONS = {"shell": do_shell, "write": do_write, "patch": do_patch, "evaluate": do_evaluate,
           "check": do_check, "pytest": do_pytest}


def unpack(snapshot: str, where: str) -> None:
    data = base64.b64decode(snapshot)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 / 3.12
            archive.extractall(where, filter="data")
        else:
            archive.extractall(where)


def pack(repo: str) -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(repo, arcname="repo")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def with_programs(text: str) -> str:
    """`text` (this file's) with `PROGRAMS` holding every program's text, so that it runs
    alone."""
    line = "PROGRAMS: dict[str, str] = {}\n"
    if text.count(line) != 1:
        raise RuntimeError("runner.py: the PROGRAMS line is not where SOURCE writes them")
    programs = {name: program(name) for name in ("call_server", "pytest_bootstrap")}
    return text.replace(line, f"PROGRAMS: dict[str, str] = {programs!r}\n")


def main() -> None:
    if len(sys.argv) > 1:
        with open(sys.argv[1], encoding="utf-8") as f:
            request = json.load(f)
        # The request holds the nonce: gone before any code of the repository runs.
        os.unlink(sys.argv[1])
    else:
        request = json.loads(sys.stdin.read())
    protect_from_children()
    # The reply gets its own descriptor and fd 1 becomes /dev/null: nothing else this process
    # runs (a test that prints, a module printing at import) lands in the reply.
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    if request.get("snapshot"):
        unpack(request["snapshot"], os.path.dirname(os.path.abspath(request["repo"])))
    reply = ACTIONS[request["kind"]](request["repo"], request)
    if request.get("return_snapshot"):
        reply["snapshot"] = pack(request["repo"])
    if "nonce" in request:
        channel.write(f"{request['nonce']} {json.dumps(reply)}\n")
    else:
        channel.write(json.dumps(reply))
    channel.close()


if __name__ == "__main__":
    main()
else:
    # This file's text, the programs it starts written in: what the hosts (the swe,
    # swe_rebench and humaneval domains) send to the executor.
    SOURCE = with_programs(Path(__file__).read_text(encoding="utf-8"))
