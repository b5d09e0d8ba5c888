"""One action of a `swe` episode, run inside the executor (the local sandbox or the episode's
container). Standalone: the standard library only, no evotrainer import, because this file's
text is what the executor runs (`python -I -S swe_runner.py [REQUEST.json]`, else the request
on stdin).

The request is JSON: `kind` (shell | write | patch | evaluate), the action's fields, `repo`
(where the repository is), optionally `snapshot` (base64 tar of `repo/...` to unpack first:
the local executor carries the repository between runs this way) and `return_snapshot`.
The reply, on stdout, is JSON: `output` (what the agent sees), `exit_code`, for `evaluate`
`results` ({test id: "pass" | "fail" | "error"}), and `snapshot` when asked for.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tarfile
import tempfile
import types

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


def command_env(scratch: str) -> dict[str, str]:
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"])
    return {**AGENT_ENV, "PATH": path, "HOME": scratch, "TMPDIR": scratch}


def run_process(argv: list[str], repo: str, timeout: float, cap: int, stdin: str = "") -> dict:
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
            env=command_env(scratch),
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
    return run_process(
        ["/bin/sh", "-c", request["command"]], repo, request["timeout"], request["cap"]
    )


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


# The repository's side of `evaluate`: a child process that imports the repository's module
# and serves calls, one JSON line in (`module`, `name`, `args` as a Python literal), one out
# (`value` as a Python literal, or `error`). It holds no verdict, so nothing it runs can fake one.
CALL_SERVER = r"""
import ast, json, os, sys
reply = os.fdopen(os.dup(1), "w")
sys.stdout = sys.stderr
sys.path.insert(0, os.getcwd())
for line in sys.stdin:
    try:
        request = json.loads(line)
        module = __import__(request["module"])
        value = getattr(module, request["name"])(*ast.literal_eval(request["args"]))
        answer = {"value": repr(value)}
    except BaseException as exc:
        answer = {"error": type(exc).__name__ + ": " + str(exc)[:200]}
    reply.write(json.dumps(answer) + "\n")
    reply.flush()
"""
CALL_LIMIT_S = 3.0  # per call, as run_tests.py's per-test limit


class CallFailed(Exception):
    """The repository's code raised, hung, crashed, or returned a non-literal value."""


class RepoCalls:
    """Calls into the repository's modules through one child process (restarted after a
    failure): arguments and results cross as Python literals only."""

    def __init__(self, repo: str, scratch: str) -> None:
        self.repo, self.scratch, self.child = repo, scratch, None

    def call(self, module: str, name: str, args: tuple) -> object:
        text = repr(args)
        try:
            ast.literal_eval(text)
        except (ValueError, SyntaxError) as err:
            raise CallFailed(f"arguments are not literals: {text[:80]}") from err
        if self.child is None:
            self.child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", CALL_SERVER],
                cwd=self.repo,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=command_env(self.scratch),
                start_new_session=True,
            )
        try:
            line = json.dumps({"module": module, "name": name, "args": text}) + "\n"
            self.child.stdin.write(line.encode())
            self.child.stdin.flush()
            ready, _, _ = select.select([self.child.stdout], [], [], CALL_LIMIT_S)
            answer = json.loads(self.child.stdout.readline()) if ready else None
        except (OSError, ValueError):
            answer = None
        if not isinstance(answer, dict) or not ("value" in answer or "error" in answer):
            self.close()  # hung or broken: the next call starts a fresh child
            raise CallFailed("the call timed out or its process died")
        if "error" in answer:
            raise CallFailed(str(answer["error"]))
        try:
            return ast.literal_eval(str(answer["value"]))
        except (ValueError, SyntaxError) as err:
            raise CallFailed(f"not a literal value: {str(answer['value'])[:80]}") from err

    def close(self) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait()
            self.child = None


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
    return {"output": "\n".join(lines), "exit_code": 0, "results": results}


ACTIONS = {"shell": do_shell, "write": do_write, "patch": do_patch, "evaluate": do_evaluate}


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


def main() -> None:
    if len(sys.argv) > 1:
        with open(sys.argv[1], encoding="utf-8") as f:
            request = json.load(f)
    else:
        request = json.loads(sys.stdin.read())
    if request.get("snapshot"):
        unpack(request["snapshot"], os.path.dirname(os.path.abspath(request["repo"])))
    reply = ACTIONS[request["kind"]](request["repo"], request)
    if request.get("return_snapshot"):
        reply["snapshot"] = pack(request["repo"])
    sys.stdout.write(json.dumps(reply))


if __name__ == "__main__":
    main()
