"""The swe_rebench domain: SWE-rebench instances converted with local mirrors, real episodes on
the shipped repository, and every way the code under test could fake pytest's verdict,
performed for real through the domain's own grading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from evotrainer.domains import make_domain
from evotrainer.domains.data import sample_path
from evotrainer.domains.data.convert import convert_file
from evotrainer.errors import EvoError
from evotrainer.sandbox import runner

RAW = sample_path("swe_rebench_sample.jsonl")
REPOS = sample_path("swe_rebench_repos")
SUBMIT = {"name": "submit", "args": ""}


@pytest.fixture(scope="module")
def domain():
    return make_domain({"name": "swe_rebench"})


@pytest.fixture(scope="module")
def median_task(domain):
    return median_of(domain)


def median_of(domain):
    return next(t for t in domain.split(1, 1)[0] + domain.split(1, 1)[1]
                if t.task_id.endswith("-1"))


def docker_unready() -> str | None:
    """Why the instances cannot be graded in a container here, or None."""
    from evotrainer.sandbox.process import OFFLINE_IMAGE, DockerSandbox

    if not DockerSandbox.image_present():
        return ("needs the docker SDK, a running dockerd and the image built by "
                "scripts/swe-docker-image.sh")
    import docker

    try:
        docker.from_env().containers.run(OFFLINE_IMAGE, ["python3", "-c", "import pytest"],
                                         remove=True, network_disabled=True)
    except docker.errors.ContainerError:
        return "the offline image has no pytest: rebuild it with scripts/swe-docker-image.sh"
    return None


@pytest.fixture(scope="module", params=["local", "docker"])
def graded(request, domain):
    """The domain and its median instance, graded in the local sandbox (this interpreter's
    pytest) or in a container of the offline image (Debian's pytest, another major version)."""
    if request.param == "local":
        return domain, median_of(domain)
    why = docker_unready()
    if why:
        pytest.skip(why)
    in_docker = make_domain({"name": "swe_rebench", "params": {"executor": "docker"}})
    return in_docker, median_of(in_docker)


def write(path: str, content: str) -> dict[str, str]:
    return {"name": "write", "args": f"{path}\n{content}"}


def shell(command: str) -> dict[str, str]:
    return {"name": "shell", "args": command}


def test_converter_reads_swe_rebench_rows_with_local_mirrors(tmp_path):
    result = convert_file("swe_rebench", RAW, repos=REPOS)
    assert result.domain == "swe_rebench" and len(result.rows) == 2
    row = result.rows[0]
    assert row["id"] == "tinystats__tinystats-1" and row["repo"] == "tinystats/tinystats"
    assert row["fail_to_pass"] == ["tests/test_stats.py::test_median_even"]
    assert row["pass_to_pass"] == ["tests/test_stats.py::test_mean",
                                   "tests/test_stats.py::test_median_odd"]
    assert Path(row["mirror"]).name == "tinystats__tinystats.bundle"
    assert row["patch"].startswith("diff --git a/tinystats/stats.py")

    # A repository without a mirror is skipped and counted; no --repos is an error naming it.
    empty = tmp_path / "mirrors"
    empty.mkdir()
    skipped = convert_file("swe_rebench", RAW, repos=empty)
    assert not skipped.rows and sum(skipped.skipped.values()) == 2
    with pytest.raises(EvoError) as err:
        convert_file("swe_rebench", RAW)
    assert err.value.field == "--repos"

    # A malformed row stops the conversion at that row.
    bad = tmp_path / "bad.jsonl"
    row = json.loads(RAW.read_text().splitlines()[0])
    bad.write_text(json.dumps({**row, "FAIL_TO_PASS": "not json"}) + "\n")
    with pytest.raises(EvoError) as err:
        convert_file("swe_rebench", bad, repos=REPOS)
    assert "row 1" in str(err.value.where) and "FAIL_TO_PASS" in str(err.value)


def test_converted_file_is_the_domains_data(tmp_path, monkeypatch):
    from evotrainer.domains.data.convert import write_rows

    monkeypatch.chdir(tmp_path)
    write_rows(convert_file("swe_rebench", RAW, repos=REPOS).rows, tmp_path / "train.jsonl")
    domain = make_domain({"name": "swe_rebench", "data": {"train": "train.jsonl"}})
    assert domain.num_tasks() == 2
    task = domain.task_at(1)
    assert task.task_id == "swe_rebench:tinystats__tinystats-2"
    assert "slugify" in task.prompt


def test_base_fails_the_issue_and_the_reference_fix_resolves_it(graded):
    domain, median_task = graded
    base = domain.score(median_task, "", [SUBMIT]).components
    assert (base["f2p"], base["p2p"], base["correctness"], base["tampered"]) == (0, 1, 0, 0)
    demo = domain.demonstration(median_task, random.Random(0))
    assert demo[0][0].startswith("patch\ndiff --git")
    fixed = [{"name": "patch", "args": median_task.meta["patch"]}, SUBMIT]
    scored = domain.score(median_task, "", fixed).components
    assert (scored["f2p"], scored["p2p"], scored["correctness"], scored["tampered"]) == (
        1, 1, 1, 0)


def test_the_history_holds_the_fix_unless_cleared(median_task):
    def log(clear: bool) -> str:
        domain = make_domain({"name": "swe_rebench", "params": {"clear_git_log": clear}})
        env = domain.environment(median_task, {"tools": [{"name": "shell"}]})
        return env.step("$ git log --all --oneline").observation

    assert "Fix #1: median()" in log(False)  # the paper's Git leak, as in a real clone
    assert log(True).strip().count("\n") == 0 and "Initial commit" in log(True)


FORGING_HOOK = """import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
MODULE = "tinystats/stats.py"
FORGE = ("send('test', 'tests/test_stats.py::test_median_even', 'pass')\n"
         "send('test', 'tests/test_stats.py::test_mean', 'pass')\n"
         "send('test', 'tests/test_stats.py::test_median_odd', 'pass')\n"
         "send('end', '0')\nos._exit(0)\n")


def appended(code: str) -> str:
    """The base module with `code` appended: the code under test, not fixed."""
    text = runner_file(MODULE)
    return text + "\n" + code


def runner_file(path: str) -> str:
    """`path` at the median instance's base commit."""
    import subprocess

    base = json.loads(RAW.read_text().splitlines()[0])["base_commit"]
    return subprocess.run(["git", "show", f"{base}:{path}"], cwd=clone(), check=True,
                          capture_output=True, text=True).stdout


def clone(cache: dict[str, Path] = {}) -> Path:  # noqa: B006 - a module-wide cache
    if "repo" not in cache:
        import subprocess
        import tempfile

        target = Path(tempfile.mkdtemp()) / "repo"
        subprocess.run(["git", "clone", "-q", str(REPOS / "tinystats__tinystats.bundle"),
                        str(target)], check=True)
        cache["repo"] = target
    return cache["repo"]


ATTACKS = {
    "a conftest of its own that rewrites every report": (
        [write("tests/conftest.py", FORGING_HOOK)], "added tests/conftest.py"),
    "the root conftest rewritten": ([write("conftest.py", FORGING_HOOK)], "changed conftest.py"),
    "a startup hook and a .pth file": (
        [write("sitecustomize.py", "import os\nos._exit(0)\n"), write("x.pth", "import os\n")],
        "added sitecustomize.py"),
    "the tests folder replaced by a link to tests of its own": ([
        write("fake/test_stats.py", "def test_median_even():\n    pass\n"
              "def test_mean():\n    pass\ndef test_median_odd():\n    pass\n"),
        shell("rm -rf tests && ln -s fake tests")], "added the link tests"),
    "exit 0 before any test ran": (
        [write(MODULE, appended("import os\nos._exit(0)\n"))], "ended before pytest finished"),
    "pytest's protocol replaced in its module": ([write(MODULE, appended(
        "import _pytest.runner as r\n_run = r.runtestprotocol\n"
        "def runtestprotocol(item, **kw):\n    reports = _run(item, **kw)\n"
        "    for report in reports:\n        report.outcome = 'passed'\n    return reports\n"
        "r.runtestprotocol = runtestprotocol\n"))], "_pytest.runner.runtestprotocol"),
    "a property on pytest's report class": ([write(MODULE, appended(
        "import _pytest.reports as r\n"
        "r.TestReport.outcome = property(lambda s: 'passed', lambda s, v: None)\n"))],
        "_pytest.reports.TestReport.outcome"),
    "a plugin registered through sys.meta_path": ([write(MODULE, appended(
        "import sys, pytest\nclass Forger:\n    @pytest.hookimpl(hookwrapper=True)\n"
        "    def pytest_runtest_makereport(self, item, call):\n        outcome = yield\n"
        "        outcome.get_result().outcome = 'passed'\n"
        "for hook in sys.meta_path:\n    if hasattr(hook, 'config'):\n"
        "        hook.config.pluginmanager.register(Forger())\n"))], "Forger"),
    # The two complete forgeries: find the grader's signing function, sign a pass and an
    # end, and leave before the real tests run.
    "the grader's signing function found with gc": ([write(MODULE, appended(
        "import gc, os\nsend = next(o for o in gc.get_objects()\n"
        "            if getattr(o, '__qualname__', '') == '_boot.<locals>.send')\n" + FORGE))],
        "gc.get_objects from tinystats/stats.py"),
    "the key read from the signer's frame": ([write(MODULE, appended(
        "import gc, hashlib, hmac, os\n"
        "signer = next(o for o in gc.get_objects() if type(o).__name__ == 'generator'\n"
        "              and o.gi_code.co_name == 'signing')\n"
        "key, count = signer.gi_frame.f_locals['key'], signer.gi_frame.f_locals['count']\n"
        "bodies = [f'{count}\\ttest\\ttests/test_stats.py::test_median_even\\tpass',\n"
        "          f'{count + 1}\\tend\\t0']\n"
        "data = b''.join((hmac.new(key, b.encode(), hashlib.sha256).hexdigest() + ' ' + b\n"
        "                 + '\\n').encode() for b in bodies)\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, data)\n"
        "    except OSError:\n        pass\nos._exit(0)\n"))],
        "gc.get_objects from tinystats/stats.py"),
    "the grader's signing function found in the caller's frames": ([write(MODULE, appended(
        "import inspect, os\nframe = inspect.currentframe()\n"
        "while frame.f_code.co_name != '_boot':\n    frame = frame.f_back\n"
        "send = frame.f_locals['send']\n" + FORGE))], "sys._getframe from tinystats/stats.py"),
    "the grader's send taken from its hook's defaults": ([write(MODULE, appended(
        "import os, sys\nconfig = next(h.config for h in sys.meta_path if hasattr(h, 'config'))"
        "\ngrader = next(p for p in config.pluginmanager.get_plugins()\n"
        "              if type(p).__name__ == 'Grader')\n"
        "hook = type(grader).pytest_runtest_protocol\n"
        "send = dict(zip(hook.__code__.co_varnames[3:], hook.__defaults__))['send']\n"
        "send('test', 'tests/test_stats.py::test_median_even', 'pass')\n"
        "send('end', '0')\nos._exit(0)\n"))], "object.__getattr__ from tinystats/stats.py"),
    "the grader's signing function found by code that exec runs": ([write(MODULE, appended(
        "exec(" + repr("import gc, os\nsend = next(o for o in gc.get_objects()\n"
                       "    if getattr(o, '__qualname__', '') == '_boot.<locals>.send')\n"
                       + FORGE) + ")\n"))], "gc.get_objects from tinystats/stats.py"),
    "a builtin the grader might use replaced": ([write(MODULE, appended(
        "import builtins\nbuiltins.all = lambda values: True\n"))], "builtins.all"),
    "code compiled under another file's name": ([write(MODULE, appended(
        "exec(compile('x = 1', '/usr/lib/python3/inspect.py', 'exec'), {})\n"))],
        "compile from tinystats/stats.py"),
    "the results channel found through /proc": ([write(MODULE, appended(
        "import os\nfds = os.listdir('/proc/self/fd')\n"))], "os.listdir from tinystats/stats.py"),
    "forged records written to every descriptor": ([write(MODULE, appended(
        "import json, os\nline = 'f' * 64 + ' ' + json.dumps({'n': 1, 'kind': 'test', "
        "'id': 'tests/test_stats.py::test_median_even', 'outcome': 'pass'}) + '\\n'\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, line.encode())\n"
        "    except OSError:\n        pass\n"))], "did not write"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_code_under_test_cannot_fake_a_verdict(graded, attack):
    domain, median_task = graded
    calls, trace = ATTACKS[attack]
    scored = domain.score(median_task, "", [*calls, SUBMIT]).components
    assert scored["f2p"] == 0 and scored["correctness"] == 0, attack
    assert scored["tampered"] == 1, attack
    _, tampered = domain.evaluate(median_task, [*calls, SUBMIT])
    assert any(trace in t for t in tampered), tampered


def test_edited_tests_are_put_back_and_honest_code_is_not_flagged(graded):
    domain, median_task = graded
    weakened = runner_file("tests/test_stats.py").replace("== 2.5", "!= 2.5")
    weakened += "\n\ndef test_median_even(numbers):\n    assert True\n"
    calls = [write("tests/test_stats.py", weakened), SUBMIT]
    scored = domain.score(median_task, "", calls).components
    assert (scored["f2p"], scored["tampered"]) == (0, 0)

    # An honest fix that logs, builds a named tuple and a TypeVar (standard modules that read
    # frames for themselves) and formats a traceback is graded as it is.
    honest = appended(
        "import collections, logging, traceback, typing\nT = typing.TypeVar('T')\n"
        "Pair = collections.namedtuple('Pair', 'a b')\n"
        "def median(values):\n    logging.getLogger(__name__).warning('median of %d', "
        "len(values))\n    try:\n        raise ValueError\n    except ValueError:\n"
        "        traceback.format_exc()\n    ordered = sorted(values)\n"
        "    middle = len(ordered) // 2\n    if len(ordered) % 2:\n"
        "        return ordered[middle]\n    return (ordered[middle - 1] + ordered[middle]) / 2\n")
    scored = domain.score(median_task, "", [write(MODULE, honest), SUBMIT]).components
    assert (scored["f2p"], scored["p2p"], scored["tampered"]) == (1, 1, 0)


def test_records_are_authenticated_in_sequence_and_must_end():
    import hashlib
    import hmac

    key = b"k" * 32

    def line(n: int, kind: str) -> bytes:
        body = f"{n}\t{kind}"
        return f"{hmac.new(key, body.encode(), hashlib.sha256).hexdigest()} {body}\n".encode()

    records, problems = runner.read_records(line(0, "begin") + line(1, "end"), key)
    assert records == [["begin"], ["end"]] and not problems
    _, problems = runner.read_records(line(0, "begin"), key)
    assert problems == ["the test process ended before pytest finished"]
    _, problems = runner.read_records(line(0, "begin") + line(0, "end"), key)
    assert "a results record out of sequence" in problems
    _, problems = runner.read_records(line(0, "begin") + line(1, "end"), b"x" * 32)
    assert "a record on the results channel that the grader did not write" in problems


def test_a_grpo_job_runs_on_the_instances(tmp_path):
    """The embedded engine end to end on the shipped instances (a tiny model: what it learns
    is not the point, the episode, the grading and the records are)."""
    import pyarrow.parquet as pq

    from evotrainer.engine import run_job
    from evotrainer.store.recipe import resolve

    recipe = resolve({
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                           "num_heads": 2, "num_kv_heads": 2, "max_position_embeddings": 2048},
                  "warm_start": {"steps": 2, "batch_size": 2}},
        "domain": {"name": "swe_rebench", "train_size": 1, "val_size": 1,
                   "params": {"prompt_template": "{problem}"}},
        "environment": {"max_turns": 2},
        "grpo": {"group_size": 2, "prompts_per_step": 1, "steps": 1, "eval_every": 1,
                 "eval_k": 1, "max_response_tokens": 48},
        "reward": {"components": [{"name": "correctness", "weight": 1.0},
                                  {"name": "format", "weight": 0.1}]},
    }, [])
    result = run_job(recipe, tmp_path, "v1")
    assert result["status"] == "ok" and result["steps_done"] == 1
    rows = pq.read_table(tmp_path / "rollouts" / "val.parquet").to_pylist()
    assert {r["task_id"] for r in rows} <= {"swe_rebench:tinystats__tinystats-1",
                                            "swe_rebench:tinystats__tinystats-2"}
    components = [dict(r["reward_components"]) for r in rows]
    # Graded for real: the base repository passes its pass-to-pass tests, not the issue's.
    assert all((c["p2p"], c["f2p"], c["tampered"]) == (1.0, 0.0, 0.0) for c in components)


def test_a_test_environment_without_pytest_is_named_not_taken_for_tampering(tmp_path,
                                                                             median_task):
    import subprocess
    import sys

    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    for path in [tmp_path, *bare.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or path.name.startswith("python") else 0o644)
    domain = make_domain({"name": "swe_rebench",
                          "params": {"test_python": str(bare / "bin" / "python")}})
    with pytest.raises(EvoError) as err:
        domain.score(median_task, "", [SUBMIT])
    assert err.value.field == "domain.params"
    assert "pytest cannot be imported in the test environment" in str(err.value)
