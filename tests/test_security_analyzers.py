"""A harness revision's analyzers, attacked for real (docs/security.md, "harness-declared
analyzers"): a Python analyzer that escapes its source check reaches neither the record key,
the caller's environment, the network, files outside the sandbox nor the time after its run,
whether the controller is root or not; where the machine cannot isolate it, an unreviewed
revision's Python analyzer is not run and one line says so; an analyzer runs once per
diagnosis and a revision's analyzers share a time budget; `rows.where` is one expression,
never a second query."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from evotrainer.diagnosis import declared
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import parse_harness, parse_harness_text, resolve_harness
from evotrainer.errors import EvoError
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.sandbox.process import LocalSandbox

REPO = Path(__file__).resolve().parent.parent
SPARE_UID = 65533  # an unprivileged uid no account uses: the non-root controller
SECRET_RESPONSE = "the-undeclared-response-text"
ROWS = [dict(step=step, group_id=f"g{g}", sample_idx=i, task_id=f"t{g}", turns=1 + i,
             response=SECRET_RESPONSE, correct=float(i % 2), reward=float(i % 2))
        for step in (1, 2) for g in range(2) for i in range(3)]

# The escape the load check cannot see: string.Formatter walks attributes named in strings,
# from the analyzer function to its globals, to the runner's guarded __import__, to that
# function's globals and so to the real builtins; then everything an attacker wants.
ESCAPE = """\
import string
def evil(rows, params):
    fmt = string.Formatter()
    names = fmt.get_field("0.__globals__", [evil], {})[0]
    guarded = names["__builtins__"]["__import__"]
    real = fmt.get_field("0.__globals__", [guarded], {})[0]["builtins"]
    load = fmt.get_field("0.__import__", [real], {})[0]
    os, socket, sys = load("os"), load("socket"), load("sys")
    seen = []
    try:
        seen.append("key=" + real.open(params["key"]).read())
    except Exception as err:
        seen.append("key:" + repr(err).split("(")[0])
    seen.append("env=" + repr(dict(os.environ)))
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                seen.append("proc=" + real.open("/proc/" + pid + "/environ", "rb").read()
                            .decode("utf-8", "replace"))
            except Exception:
                pass
    for path in params["writes"]:
        try:
            real.open(path, "w").write("pwned")
            seen.append("wrote " + path)
        except Exception as err:
            seen.append("write:" + repr(err).split("(")[0])
    try:
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-c",
                     "import time; time.sleep(60)  # " + params["marker"]])
    except Exception as err:
        seen.append("fork:" + repr(err).split("(")[0])
    try:
        socket.create_connection(("127.0.0.1", params["port"]), timeout=2).sendall(b"pwned")
        seen.append("socket connected")
    except Exception as err:
        seen.append("socket:" + repr(err).split("(")[0])
    raise ValueError(" | ".join(seen).replace(chr(10), " ")[:4000])
"""

SQL_ANALYZER = {"name": "share", "inputs": ["correct"], "output": {"kind": "scalar"},
                "sql": "SELECT avg(correct) AS value FROM rollouts"}


def attack_revision(params: dict) -> dict:
    """h9: one Python analyzer performing the escape, one SQL analyzer, a plain SQL metric."""
    return {
        "apiVersion": "evotrainer/v1", "kind": "HarnessRevision", "name": "h9",
        "metrics": [
            {"name": "evil_metric", "layer": "behavior", "split": "train",
             "analyzer": {"name": "evil", "params": params}},
            {"name": "share_metric", "layer": "behavior", "split": "train",
             "analyzer": {"name": "share"}},
            {"name": "rows", "layer": "score", "split": "train",
             "sql": "SELECT count(*) AS value FROM rollouts"},
        ],
        "analyzers": [
            {"name": "evil", "inputs": ["response"], "output": {"kind": "scalar"},
             "python": ESCAPE, "limits": {"cpu_seconds": 5, "wall_seconds": 10}},
            SQL_ANALYZER,
        ],
    }


class Attack:
    """What the escape is aimed at: a workspace holding a record key (0600, the
    controller's), a token in the controller's environment, places to write, a loopback
    listener, a marker naming any process it leaves behind."""

    def __init__(self, owner: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="evotrainer-attack-"))
        os.chmod(self.root, 0o755)
        self.workspace = self.root / "ws"
        (self.workspace / ".evotrainer").mkdir(parents=True)
        self.key_value = secrets.token_hex(16)
        self.key = self.workspace / ".evotrainer" / "record.key"
        self.key.write_text(self.key_value)
        self.key.chmod(0o600)
        self.token = "ghp_" + secrets.token_hex(12)
        self.marker = "evotrainer-stray-" + secrets.token_hex(6)
        self.writes = [self.workspace / "PWNED", Path(tempfile.gettempdir()) / self.marker]
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.listener.setblocking(False)
        pq.write_table(rollout_table(ROWS), self.workspace / "rollouts.parquet")
        params = {"key": str(self.key), "writes": [str(p) for p in self.writes],
                  "marker": self.marker, "port": self.listener.getsockname()[1]}
        (self.workspace / "h9.yaml").write_text(yaml.safe_dump(attack_revision(params)))
        for path in (self.workspace, *self.workspace.rglob("*")):
            os.chown(path, owner, owner)

    def assert_nothing_reached(self, output: str, *, network: bool = True) -> None:
        assert self.key_value not in output, "the analyzer read the record key"
        assert self.token not in output, "the analyzer read the controller's environment"
        for path in self.writes:
            assert not path.exists(), f"the analyzer wrote {path}"
        time.sleep(0.2)  # a stray would have started by now
        strays = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if self.marker.encode() in cmdline:
                    strays.append(pid)
            except OSError:
                continue
        assert not strays, f"the analyzer left processes running: {strays}"
        if not network:
            return
        try:
            connection, _ = self.listener.accept()
            connection.close()
            pytest.fail("the analyzer opened a loopback connection")
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.listener.close()
        for path in self.writes:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def attack(request):
    made: list[Attack] = []

    def make(owner: int = os.geteuid()) -> Attack:
        made.append(Attack(owner))
        return made[-1]

    yield make
    for one in made:
        one.close()


def _world_usable(path: Path) -> bool:
    """Whether a uid other than the owner may read and traverse `path` (every parent too)."""
    real = path.resolve()
    return real.exists() and all(p.stat().st_mode & 0o005 == 0o005
                                 for p in (*real.parents, real) if p != Path("/"))


def _unprivileged_python() -> tuple[str, str] | None:
    """An interpreter of this Python version the spare uid may run, and a PYTHONPATH giving it
    this checkout and this environment's packages; None when there is none."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    packages = Path(sysconfig.get_paths()["purelib"])
    if not (_world_usable(REPO / "evotrainer") and _world_usable(packages)):
        return None
    for candidate in (sys.executable, f"/usr/bin/python{version}",
                      f"/usr/local/bin/python{version}"):
        path = Path(candidate)
        if path.exists() and _world_usable(path) and path.resolve().stat().st_mode & 0o001:
            done = subprocess.run(
                [str(path), "-S", "-c", "import sys; print(sys.version_info[:2])"],
                capture_output=True, text=True)
            if done.stdout.strip() == str(tuple(sys.version_info[:2])):
                return str(path), os.pathsep.join([str(REPO), str(packages)])
    return None


def _drop(uid: int):
    def preexec() -> None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    return preexec


def run_cli_as(
    uid: int, attack: Attack, *args: str, prelude: str = ""
) -> subprocess.CompletedProcess:
    """`evotrainer ARGS` in the attack's workspace as `uid`, with the token in its
    environment, the way a non-root CI runner or a maintainer's laptop runs it."""
    found = _unprivileged_python()
    if found is None:
        pytest.skip(f"no Python {sys.version_info[:2]} and packages uid {uid} may read")
    python, path = found
    program = (f"{prelude}\nimport sys\nfrom evotrainer.cli import main\n"
               "sys.argv = ['evotrainer', *sys.argv[1:]]\nmain()")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(attack.workspace), "PYTHONPATH": path,
           "GITHUB_TOKEN": attack.token, "LANG": "C.UTF-8", "COLUMNS": "200"}
    return subprocess.run([python, "-S", "-c", program, *args], cwd=attack.workspace, env=env,
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=_drop(uid))


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to a spare uid needs root")


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    return lines[0]


# ---- 1. the escape, as a non-root controller and as root ----


@needs_root
def test_the_formatter_escape_reaches_nothing_from_a_non_root_controller(attack):
    """The controller is uid 65533: the analyzer runs confined in its own user, mount, pid and
    network namespaces, where the workspace (and so the key), the controller's /proc and the
    network are not there, and whatever it starts dies with it."""
    target = attack(SPARE_UID)
    probe = run_cli_as(SPARE_UID, target, "--version")
    if probe.returncode != 0:
        pytest.skip(f"the CLI does not start as uid {SPARE_UID}: {probe.stderr[-300:]}")
    result = run_cli_as(
        SPARE_UID, target, "diagnose", "--rollouts", "rollouts.parquet", "--harness", "h9.yaml",
        prelude="from evotrainer.diagnosis.declared import analyzer_sandbox\n"
        "assert analyzer_sandbox().confined, 'no unprivileged user namespaces here'")
    if "no unprivileged user namespaces here" in result.stderr:
        pytest.skip("the kernel refuses unprivileged user namespaces (the refusal is tested "
                    "below)")
    assert result.returncode == 1
    line = _one_error_line(result)
    assert "harness h9, analyzer evil: stopped in the sandbox (runtime_error)" in line
    # It did run, and it saw nothing: no key, a minimal environment, one process.
    assert "key:FileNotFoundError" in line and "env={'PATH'" in line
    target.assert_nothing_reached(result.stdout + result.stderr)


@pytest.mark.parametrize("mode", ["namespaces", "fresh uid only"])
def test_the_formatter_escape_reaches_nothing_from_a_root_controller(attack, monkeypatch, mode):
    """As root the analyzer is a fresh uid: the key (0600, root's) and root's environment are
    unreadable whether or not the namespaces are available."""
    if os.geteuid() != 0:
        pytest.skip("the root modes need root")
    target = attack()
    monkeypatch.setenv("GITHUB_TOKEN", target.token)
    monkeypatch.chdir(target.workspace)
    if mode == "fresh uid only":
        python = "/usr/bin/python3" if not _world_usable(Path(sys.executable)) else sys.executable
        if not _world_usable(Path(python)):
            pytest.skip("no interpreter a fresh uid may run")
        box = LocalSandbox(python, privileged=False, confine=True, hide=(str(target.workspace),))
    else:
        box = declared.analyzer_sandbox()
        if not box.privileged:
            pytest.skip("this machine refuses the namespaces even to root")
    monkeypatch.setattr(declared, "analyzer_sandbox", lambda: box)
    harness = resolve_harness(str(target.workspace / "h9.yaml"))
    with pytest.raises(EvoError) as err:
        diagnose(rollout_table(ROWS), None, harness)
    message = str(err.value)
    assert "harness h9, analyzer evil: stopped in the sandbox" in message
    assert "\n" not in message
    target.writes = target.writes[:1]  # a fresh uid may use the shared /tmp (swept after)
    # Without a network namespace (no user namespaces either) the network is not promised.
    target.assert_nothing_reached(message, network=box.privileged or box.user_netns)


@needs_root
def test_without_isolation_an_unreviewed_python_analyzer_is_not_run(attack):
    """Not root and no user namespaces (the kernel's unshare refuses them): the Python
    analyzer never starts; its metric is a gap naming the revision, while the SQL analyzer
    and the SQL metric are computed."""
    target = attack(SPARE_UID)
    # Make every unshare(CLONE_NEWUSER ...) fail, as on a kernel that refuses them.
    refuse = "import evotrainer.sandbox.process as sb\nsb._CLONE_NEWUSER = 0x1\n"
    result = run_cli_as(SPARE_UID, target, "diagnose", "--rollouts", "rollouts.parquet",
                        "--harness", "h9.yaml", "--json", prelude=refuse)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    diagnosis = json.loads(result.stdout)
    assert diagnosis["metrics"]["evil_metric"] is None
    share = sum(r["correct"] for r in ROWS) / len(ROWS)
    assert diagnosis["metrics"]["share_metric"] == pytest.approx(share)
    assert diagnosis["metrics"]["rows"] == len(ROWS)
    (gap,) = [g for g in diagnosis["gaps"] if g["metric"] == "evil_metric"]
    assert gap["reason"].startswith("harness h9, analyzer evil: not run: revision h9 is not "
                                    "reviewed on main and this machine cannot isolate")
    assert "\n" not in gap["reason"]
    target.assert_nothing_reached(result.stdout + result.stderr)


def test_a_revision_is_reviewed_only_when_main_holds_its_text(tmp_path):
    """The refusal above spares a revision whose file is byte for byte main's; an edit in the
    working tree, or a revision main lacks, is unreviewed."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    (tmp_path / "harness_revisions").mkdir()
    text = yaml.safe_dump(attack_revision({}))
    (tmp_path / "harness_revisions" / "h9.yaml").write_text(text)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "h9"], check=True)
    assert all(a.reviewed for a in resolve_harness("h9", tmp_path).analyzers)
    (tmp_path / "harness_revisions" / "h9.yaml").write_text(text + "description: edited\n")
    assert not any(a.reviewed for a in resolve_harness("h9", tmp_path).analyzers)
    (tmp_path / "harness_revisions" / "h8.yaml").write_text(text.replace("name: h9", "name: h8"))
    assert not any(a.reviewed for a in resolve_harness("h8", tmp_path).analyzers)


# ---- 9. an analyzer runs once per diagnosis; a revision's analyzers share a budget ----


BUSY = """\
def busy(rows, params):
    total = 0
    for i in range(params["loops"]):
        total += i % 7
    return float(total % 5)
"""


def busy_revision(metrics: list[dict], **limits) -> dict:
    return {
        "apiVersion": "evotrainer/v1", "kind": "HarnessRevision", "name": "h9",
        "metrics": metrics,
        "analyzers": [{"name": "busy", "inputs": ["step"], "output": {"kind": "scalar"},
                       "python": BUSY, **({"limits": limits} if limits else {})}],
    }


def test_an_analyzer_named_by_six_metrics_runs_once(monkeypatch):
    runs = []
    real = declared._run_python
    monkeypatch.setattr(declared, "_run_python",
                        lambda *args, **kwargs: runs.append(1) or real(*args, **kwargs))
    metrics = [{"name": f"m{i}", "layer": "behavior", "analyzer":
                {"name": "busy", "params": {"loops": 1000}}} for i in range(6)]
    metrics.append({"name": "other", "layer": "behavior",
                    "analyzer": {"name": "busy", "params": {"loops": 2000}}})
    d = diagnose(rollout_table(ROWS), None, parse_harness(busy_revision(metrics)))
    assert len(runs) == 2  # one per (analyzer, params, rows)
    assert {d["metrics"][f"m{i}"] for i in range(6)} == {float(sum(i % 7 for i in range(1000)) % 5)}


def test_a_revision_past_its_analyzer_time_stops_with_one_line(monkeypatch):
    """Three metrics name a looping analyzer with different params (no reuse): the revision's
    budget, not three times each analyzer's own limit, bounds the diagnosis."""
    monkeypatch.setattr(declared, "MAX_REVISION_SECONDS", 2.0)
    metrics = [{"name": f"m{i}", "layer": "behavior",
                "analyzer": {"name": "busy", "params": {"loops": 10**12 + i}}} for i in range(3)]
    harness = parse_harness(busy_revision(metrics, cpu_seconds=30, wall_seconds=60))
    with pytest.raises(EvoError) as err:  # the message names the budget that stopped it
        diagnose(rollout_table(ROWS), None, harness)
    assert err.value.message.startswith(
        "harness h9: its declared analyzers took more than the 2 s of wall time a diagnosis "
        "allows them (stopped at analyzer busy")
    assert "\n" not in str(err.value)


def test_more_metrics_than_the_cap_are_refused_at_load():
    metrics = [{"name": f"m{i}", "layer": "score", "sql": "SELECT 1 AS value"} for i in range(201)]
    text = yaml.safe_dump({"apiVersion": "evotrainer/v1", "kind": "HarnessRevision",
                           "name": "h9", "metrics": metrics})
    with pytest.raises(EvoError) as err:
        parse_harness_text(text, "harness_revisions/h9.yaml")
    assert "harness_revisions/h9.yaml" in str(err.value) and "metrics" in str(err.value)
    parse_harness_text(yaml.safe_dump({"apiVersion": "evotrainer/v1", "kind": "HarnessRevision",
                                       "name": "h9", "metrics": metrics[:200]}), "h9.yaml")


# ---- 10. rows.where is one expression over rollout columns ----


def where_revision(where: str, *, python: bool = False) -> str:
    analyzer: dict = {"name": "steps_only", "inputs": ["step"], "output": {"kind": "per_row"},
                      "rows": {"where": where}}
    if python:
        analyzer["python"] = ("def steps_only(rows, params):\n"
                              "    return [float(len(rows['step'])) for _ in rows['step']]\n")
    else:
        analyzer["sql"] = "SELECT step, 1.0 AS value FROM rollouts"
    return yaml.safe_dump({
        "apiVersion": "evotrainer/v1", "kind": "HarnessRevision", "name": "h9",
        "params": {"min_turns": 2},
        "metrics": [{"name": "m", "layer": "behavior", "analyzer": {"name": "steps_only"}}],
        "analyzers": [analyzer],
    })


@pytest.mark.parametrize("where, refused", [
    ("false) UNION ALL SELECT response FROM all_rollouts WHERE (true", "not a single SQL"),
    ("step IN (SELECT length(response) FROM all_rollouts)", "holds a subquery"),
    ("(SELECT count(*) FROM all_rollouts) > 0", "holds a subquery"),
    ("true) --", "not a single SQL"),
    ("true; SELECT response FROM all_rollouts", "not a single SQL"),
    ("all_rollouts.response IS NOT NULL", "no rollout column"),
    ("secret > 1", "no rollout column"),
    ("turns", "is a BIGINT expression, not a condition"),
    ("turns > $undefined", "undefined param(s) $undefined"),
])
def test_a_where_clause_that_is_not_one_condition_is_refused_at_load(where, refused):
    with pytest.raises(EvoError) as err:
        parse_harness_text(where_revision(where), "harness_revisions/h9.yaml")
    line = str(err.value)
    assert line.startswith("harness_revisions/h9.yaml:")
    assert "analyzers[0].rows.where" in line and refused in line
    assert "\n" not in line


@pytest.mark.parametrize("python", [False, True])
def test_the_union_never_reaches_the_analyzer_even_past_the_load_check(python):
    """Past the load check (the revision's analyzer swapped after it loaded), the rows' query
    is still written from a parsed expression: the injected UNION is refused, no response
    text reaches the analyzer or the error line."""
    harness = parse_harness_text(where_revision("turns >= 1", python=python), "h9.yaml")
    injected = dataclasses.replace(
        harness.analyzers[0],
        where="false) UNION ALL SELECT response FROM all_rollouts WHERE (true")
    harness = dataclasses.replace(harness, analyzers=(injected,))
    with pytest.raises(EvoError) as err:
        diagnose(rollout_table(ROWS), None, harness)
    message = str(err.value)
    assert "harness h9, analyzer steps_only: the row condition is not a single SQL" in message
    assert SECRET_RESPONSE not in str(err.value)


@pytest.mark.parametrize("where, rows", [
    ("turns >= $min_turns", sum(1 for r in ROWS if r["turns"] >= 2)),
    ("turns >= 2 AND response LIKE '%--%'", 0),
    ("turns >= 3 -- the long ones", sum(1 for r in ROWS if r["turns"] >= 3)),
    ("reward_components['tampered'] IS NULL AND step = 1", sum(1 for r in ROWS if r["step"] == 1)),
])
def test_a_plain_condition_still_filters(where, rows):
    d = diagnose(rollout_table(ROWS), None,
                 parse_harness_text(where_revision(where, python=True), "h9.yaml"))
    assert d["metrics"]["m"] == (float(rows) if rows else None)
