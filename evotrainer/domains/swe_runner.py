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

import base64
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile

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


def do_evaluate(repo: str, request: dict) -> dict:
    """Restore the pristine test files (the agent may have edited them), run the test runner
    and read its RESULTS line."""
    for path, content in request["pristine"].items():
        target = inside(repo, path)
        if target is None:
            continue
        if os.path.islink(target) or os.path.isdir(target):
            subprocess.run(["rm", "-rf", target], check=False)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(content)
    run = run_process([sys.executable, "run_tests.py"], repo, request["timeout"], request["cap"])
    results: dict[str, str] = {}
    for line in run["output"].splitlines():
        if line.startswith("RESULTS "):
            try:
                parsed = json.loads(line[len("RESULTS ") :])
            except ValueError:
                continue
            if isinstance(parsed, dict):
                results = {str(k): str(v) for k, v in parsed.items()}
    return {"output": run["output"], "exit_code": run["exit_code"], "results": results}


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
