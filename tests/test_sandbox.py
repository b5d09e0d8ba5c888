"""The sandbox contains hostile programs and says what happened (no timing assertions)."""

from __future__ import annotations

import os
import select
import selectors
import socket
import sys
from pathlib import Path

import pytest

import evotrainer.sandbox.process as sandbox_module
from evotrainer.sandbox.process import DockerSandbox, Limits, LocalSandbox

# The wall clock sits far above the CPU limit: on a loaded machine one CPU second can take
# many wall seconds, and these tests must see the CPU limit, not the deadline.
CPU_BOUND = Limits(cpu_seconds=1, wall_seconds=60)


@pytest.fixture(scope="module")
def sandbox() -> LocalSandbox:
    return LocalSandbox()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="namespace isolation needs root")


def _others_can_run(path: str) -> bool:
    """Whether a uid other than the owner may execute `path` (every folder on the way too)."""
    real = Path(path).resolve()
    return real.is_file() and all(p.stat().st_mode & 0o001 for p in (*real.parents, real))


# As root without namespaces the program runs as a fresh uid, which must be able to run the
# interpreter: the test interpreter may live under /root, so take the system one then.
SHARED_PYTHON = next(
    (p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
     if _others_can_run(p)), None)
needs_shared_python = pytest.mark.skipif(
    os.geteuid() == 0 and SHARED_PYTHON is None,
    reason="as root the unprivileged mode needs an interpreter other uids may run")


def test_runs_a_program_with_stdin(sandbox: LocalSandbox) -> None:
    result = sandbox.run("a, b = map(int, input().split())\nprint(a + b)", "2 40\n")
    assert (result.status, result.stdout, result.exit_code) == ("ok", "42\n", 0)


def test_large_stdin_is_fed_while_output_is_read(sandbox: LocalSandbox) -> None:
    data = "x" * 300_000 + "\n"  # larger than a pipe buffer in both directions
    result = sandbox.run("import sys\nsys.stdout.write(sys.stdin.read())", data)
    assert result.status == "ok"
    assert result.stdout == data


def test_runtime_error_keeps_the_traceback_tail(sandbox: LocalSandbox) -> None:
    result = sandbox.run("raise ValueError('boom')")
    assert result.status == "runtime_error"
    assert "ValueError: boom" in result.detail
    assert "ValueError: boom" in result.stderr


def test_infinite_loop_hits_the_cpu_limit(sandbox: LocalSandbox) -> None:
    result = sandbox.run("while True:\n    pass", limits=CPU_BOUND)
    assert result.status == "cpu_limit"


def test_sleeping_program_hits_the_wall_clock(sandbox: LocalSandbox) -> None:
    result = sandbox.run("import time\ntime.sleep(60)", limits=Limits(wall_seconds=1))
    assert result.status == "timeout"
    assert "wall clock" in result.detail


def test_memory_hog_is_stopped(sandbox: LocalSandbox) -> None:
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))"
    # CPU and wall limits far above its 0.15 s of CPU: the pages it touches are zeroed on its
    # CPU time, and a loaded machine's memory reclaim is charged there too.
    result = sandbox.run(
        hog, limits=Limits(memory_bytes=256 * 2**20, cpu_seconds=30, wall_seconds=120)
    )
    assert result.status == "memory_limit"


def test_one_gigabyte_of_stdout_is_cut_at_the_cap(sandbox: LocalSandbox) -> None:
    flood = "import sys\nblock = 'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.write(block)"
    result = sandbox.run(flood, limits=Limits(output_bytes=2**20))
    assert result.status == "output_limit"
    assert len(result.stdout) == 2**20


def test_stderr_flood_is_cut_too(sandbox: LocalSandbox) -> None:
    flood = "import sys\nwhile True:\n    sys.stderr.write('e' * 65536)"
    result = sandbox.run(flood, limits=Limits(output_bytes=2**20))
    assert result.status == "output_limit"
    assert len(result.stderr) <= 4096


@needs_root
def test_fork_bomb_is_contained_and_leaves_nothing_behind(sandbox: LocalSandbox) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = sandbox.run(bomb, limits=Limits(cpu_seconds=1, wall_seconds=2, processes=8))
    assert result.status in ("timeout", "cpu_limit")
    # The machine still forks fine and a fresh run works.
    assert sandbox.run("print('alive')").stdout == "alive\n"


@needs_root
def test_setsid_escapee_is_killed_with_the_program(sandbox: LocalSandbox) -> None:
    escape = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(60)\n"
        "print(os.getpid())\n"
    )
    result = sandbox.run(escape, limits=CPU_BOUND)
    # The program is pid 1 of its own pid namespace: its exit takes the sleeper with it,
    # so the run ends at once instead of waiting for the deadline.
    assert result.status == "ok"
    assert result.stdout == "1\n"


@needs_root
def test_network_is_unreachable(sandbox: LocalSandbox) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
        result = sandbox.run(program, limits=CPU_BOUND)
    assert result.status == "runtime_error"
    assert "OSError" in result.detail
    assert "netns" in result.isolation


@needs_root
def test_files_outside_the_scratch_dir_are_hidden(sandbox: LocalSandbox, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    secret.chmod(0o644)
    program = f"print(open({str(secret)!r}).read())"
    result = sandbox.run(program, limits=CPU_BOUND)
    assert result.status == "runtime_error"
    assert "FileNotFoundError" in result.detail
    repo_file = os.path.abspath(__file__)
    assert "FileNotFoundError" in sandbox.run(f"open({repo_file!r})", limits=CPU_BOUND).detail


@needs_root
def test_exposed_directories_are_readable_and_read_only_even_under_tmp(tmp_path) -> None:
    """A test environment exposed to the program (the swe_rebench grader's venv) is bound back
    read-only, also where it lives under the host's /tmp, which the sandbox replaces; what is
    beside it stays hidden."""
    environment, beside = tmp_path / "venv", tmp_path / "beside.txt"
    environment.mkdir()
    (environment / "lib.txt").write_text("from the environment")
    beside.write_text("not exposed")
    for path in (tmp_path, environment, environment / "lib.txt", beside):
        path.chmod(0o755 if path.is_dir() else 0o644)
    exposed = LocalSandbox(expose=(str(environment),))
    read = exposed.run(f"print(open({str(environment / 'lib.txt')!r}).read())",
                       limits=CPU_BOUND)
    assert read.status == "ok" and read.stdout.strip() == "from the environment"
    write = exposed.run(f"open({str(environment / 'new.txt')!r}, 'w')", limits=CPU_BOUND)
    assert "Read-only file system" in write.detail or "Permission denied" in write.detail
    hidden = exposed.run(f"open({str(beside)!r})", limits=CPU_BOUND)
    assert "FileNotFoundError" in hidden.detail


@needs_root
def test_scratch_dir_is_private_writable_and_size_limited(sandbox: LocalSandbox) -> None:
    program = (
        "import os\n"
        "open('note.txt', 'w').write('hi')\n"
        "print(os.getcwd(), sorted(os.listdir('.')), os.getuid() != 0)\n"
        "open('big.bin', 'wb').write(b'x' * 2**22)\n"
    )
    result = sandbox.run(program, limits=Limits(file_bytes=2**20))
    assert result.stdout == "/tmp ['main.py', 'note.txt'] True\n"
    assert result.status == "output_limit"  # SIGXFSZ: the file grew past the limit


@needs_shared_python
def test_unprivileged_mode_still_limits(tmp_path) -> None:
    plain = LocalSandbox(SHARED_PYTHON, privileged=False)
    # As root the program still runs as a fresh uid (see test_isolation.py).
    assert ("uid" in plain.run("print(1)").isolation) == (os.geteuid() == 0)
    assert plain.run("print(input()[::-1])", "abc\n").stdout == "cba\n"
    assert plain.run("while True:\n    pass", limits=CPU_BOUND).status == "cpu_limit"


@needs_shared_python
def test_refused_namespaces_fall_back_to_the_unprivileged_mode(monkeypatch) -> None:
    # An invalid unshare flag fails like a container without CAP_SYS_ADMIN does.
    monkeypatch.setattr(sandbox_module, "_CLONE_NEWPID", 0x1)
    fallback = LocalSandbox(SHARED_PYTHON)
    assert not fallback.privileged
    result = fallback.run("print(6 * 7)")
    assert (result.status, result.stdout) == ("ok", "42\n")
    assert "mountns" not in result.isolation
    assert ("uid" in result.isolation) == (os.geteuid() == 0)


@pytest.mark.skipif(
    not DockerSandbox.image_present(),
    reason="no Docker daemon, or no offline image (scripts/swe-docker-image.sh builds it)",
)
def test_docker_sandbox_runs_a_program() -> None:
    result = DockerSandbox().run("print(int(input()) * 2)", "21\n")
    assert (result.status, result.stdout) == ("ok", "42\n")


NO_NEW_PRIVS = (
    "print([line.split()[1] for line in open('/proc/self/status')"
    " if line.startswith('NoNewPrivs:')][0])"
)


def test_programs_run_with_no_new_privileges(sandbox: LocalSandbox) -> None:
    """No setuid binary or file capability can raise what a sandboxed
    program (or anything it starts) may do; on main this printed 0."""
    assert sandbox.run(NO_NEW_PRIVS).stdout == "1\n"
    child = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {NO_NEW_PRIVS!r}])"
    assert sandbox.run(child).stdout == "1\n"


@needs_shared_python
def test_unprivileged_mode_runs_with_no_new_privileges_too() -> None:
    plain = LocalSandbox(SHARED_PYTHON, privileged=False)
    assert plain.run(NO_NEW_PRIVS).stdout == "1\n"


@pytest.mark.skipif(
    not DockerSandbox.image_present(),
    reason="no Docker daemon, or no offline image (scripts/swe-docker-image.sh builds it)",
)
def test_docker_sandbox_runs_with_no_new_privileges() -> None:
    assert DockerSandbox().run(NO_NEW_PRIVS).stdout == "1\n"


def test_an_exit_reported_beside_pending_stdin_is_handled_first(sandbox, monkeypatch) -> None:
    """The program exits without reading its stdin, and the selector reports its exit before
    the writable stdin in one batch: the exit closes stdin, and the stdin event of that same
    batch must not write to the closed pipe (on main: OSError EBADF, one run in ~40)."""

    class ExitFirst(selectors.DefaultSelector):
        def select(self, timeout=None):
            exits = [key.fd for key in self.get_map().values() if key.data == "exit"]
            if exits:  # wait for the program's end, so both events are ready together
                select.select(exits, [], [], timeout)
            return sorted(super().select(timeout), key=lambda event: event[0].data != "exit")

    monkeypatch.setattr(sandbox_module.selectors, "DefaultSelector", ExitFirst)
    result = sandbox.run("import os\nos._exit(0)\n", "x" * 100)
    assert (result.status, result.exit_code) == ("ok", 0)
