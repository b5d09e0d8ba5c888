"""Rewards the scored code cannot forge, performed for real.

Every attack is a wrong answer (a function returning False, a program printing a wrong
number) plus one way of faking a pass: an early exit, an exit hook, an object equal to
everything, a forged report on the checker's channel, a nonce stolen from the checker's
memory, a signal, the checker killed. Each must score correctness 0 and pass_fraction 0, and
the attacks the scoring process can see leave `tampered` 1."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

# As root the plain mode runs the program as a fresh uid, which must be able to run the
# interpreter (see test_sandbox.py).
from test_humaneval import PROBLEM
from test_sandbox import SHARED_PYTHON

from evotrainer.domains import make_domain
from evotrainer.domains.code import CodeDomain
from evotrainer.errors import EvoError
from evotrainer.sandbox.process import Limits, LocalSandbox, RunResult

WRONG = "def area(r):\n    return False\n"


def parent_memory_program(mode: str, per_region: str, after: str = "") -> str:
    """Program text that opens its parent's /proc/<pid>/mem (`mode`: "os.O_RDONLY" or
    "os.O_RDWR") and runs `per_region` for every writable mapping (`memory`, `start` and its
    bytes `data` defined), then `after`; an OSError ends it quietly, as an attacker's would."""
    per_region = textwrap.indent(textwrap.dedent(per_region), " " * 12)
    after = textwrap.indent(textwrap.dedent(after), " " * 4)
    return f"""
import os, re, signal
parent, found = os.getppid(), None
try:
    memory = os.open(f"/proc/{{parent}}/mem", {mode})
    with open(f"/proc/{{parent}}/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("rw"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            try:
                data = os.pread(memory, end - start, start)
            except OSError:
                continue
{per_region}
{after}
except OSError:
    pass
"""


# Finds the scoring process's nonce in its memory, writes a forged report to its stdout and
# kills it: what a candidate could do if the checker were an ordinary same-uid process.
STEAL_NONCE = parent_memory_program("os.O_RDONLY", """
    hit = re.search(rb'"nonce": "([0-9a-f]{32})"', data)
    if hit:
        found = hit.group(1).decode()
""", """
    report = '{"whole": "pass", "units": ["pass", "pass", "pass"], "tampered": []}'
    channel = os.open(f"/proc/{parent}/fd/1", os.O_WRONLY)
    os.write(channel, f"{found} {report}\\n".encode())
    os.kill(parent, signal.SIGKILL)
""")

# name -> (program, whether the scoring process can see the attempt)
VECTORS = {
    "os._exit at import": (WRONG + "import os\nos._exit(0)\n", True),
    "sys.exit at import": (WRONG + "import sys\nsys.exit(0)\n", True),
    "raise SystemExit": (WRONG + "raise SystemExit\n", True),
    "atexit os._exit": ("import atexit, os\natexit.register(lambda: os._exit(0))\n" + WRONG,
                        False),
    "excepthook exits 0": ("import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n"
                           "def area(r):\n    raise ValueError(r)\n", False),
    "__del__ os._exit": ("import os\nclass Bye:\n    def __del__(self):\n        os._exit(0)\n"
                         "def area(r):\n    Bye()\n    return False\n", True),
    "exit inside the call": ("def area(r):\n    import os\n    os._exit(0)\n", True),
    "__eq__ always true": ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                           "    def __ne__(self, other):\n        return False\n"
                           "    __hash__ = object.__hash__\n"
                           "def area(r):\n    return Anything()\n", False),
    "AssertionError patched": ("import builtins\nclass Never(Exception):\n    pass\n"
                               "builtins.AssertionError = Never\n" + WRONG, False),
    "print overridden": ("import builtins\nbuiltins.print = lambda *a, **k: None\n" + WRONG,
                         False),
    "fake report on fd 1 and 2": (
        WRONG + "import os\nfake = b'{\"whole\": \"pass\", \"units\": [], \"tampered\": []}\\n'\n"
        "os.write(1, fake)\nos.write(2, fake)\nos._exit(0)\n", True),
    "signal to itself": (WRONG + "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n",
                         True),
    "kill the parent": (WRONG + "import os, signal\ntry:\n"
                        "    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n"
                        "    pass\n", False),
    "nonce stolen from /proc/<parent>/mem": (WRONG + STEAL_NONCE, False),
}


# The sandbox's two modes: namespaces (as root: the program is pid 1 of its own pid namespace,
# where a signal it sends itself or its parent does nothing) and plain (no namespaces: such a
# signal lands).
MODES = ["namespaces", "plain"]


def use_mode(domain, mode: str, monkeypatch) -> None:
    if mode == "plain":
        if SHARED_PYTHON is None:
            pytest.skip("as root the plain mode needs an interpreter other uids may run")
        plain = LocalSandbox(SHARED_PYTHON, privileged=False)
        monkeypatch.setattr(domain, "sandbox", lambda: plain)


def signal_lands(mode: str) -> bool:
    return mode == "plain" or os.geteuid() != 0


@pytest.fixture
def humaneval(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the job's working directory: its data root
    data = tmp_path / "he.jsonl"
    data.write_text(json.dumps(PROBLEM) + "\n")
    return make_domain({"name": "humaneval", "data": {"train": str(data)}})


def fenced(source: str) -> str:
    return f"```python\n{source}```\n"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vector", sorted(VECTORS))
def test_humaneval_wrong_answer_plus_attack_scores_zero(humaneval, vector, mode, monkeypatch):
    source, visible = VECTORS[vector]
    use_mode(humaneval, mode, monkeypatch)
    if vector == "kill the parent":
        visible = signal_lands(mode)  # the checker killed: no report
    score, details = humaneval.judge(humaneval.task_at(0), fenced(source))
    assert score.components["correctness"] == 0.0, details
    assert score.components["pass_fraction"] == 0.0, details
    assert score.correct == 0.0
    if visible:
        assert score.components["tampered"] == 1.0, details
        assert details["tampering"], details


def test_humaneval_honest_answers_are_not_tampered(humaneval):
    task = humaneval.task_at(0)
    honest = fenced(PROBLEM["prompt"] + PROBLEM["canonical_solution"])
    right, details = humaneval.judge(task, honest)
    assert right.components["correctness"] == 1.0 and right.components["tampered"] == 0.0
    wrong, details = humaneval.judge(task, fenced(WRONG))
    assert (wrong.components["correctness"], wrong.components["tampered"]) == (0.0, 0.0)
    assert details["failure"] == "wrong_answer"


def test_humaneval_answers_compare_by_type(humaneval):
    """False == 0 and True == 1 in Python: a bool is not an answer to an int question; an
    int where a float is expected (or back) still compares by value."""
    task = humaneval.task_at(0)
    boolean = "import math\ndef area(r):\n    v = round(math.pi * r * r)\n    return v == 3 or v\n"
    score, details = humaneval.judge(task, fenced(boolean))
    # r = 0 gives 0 (an int), r = 1 gives True: the second assert fails.
    assert (details["passed"], score.correct) == (2, 0.0)
    floating = "import math\ndef area(r):\n    return float(round(math.pi * r * r))\n"
    assert humaneval.judge(task, fenced(floating))[0].correct == 1.0


# Run by a child of the checker: can it open its parent's memory for writing?
OPEN_PARENT_MEMORY = """
import os
try:
    os.close(os.open(f"/proc/{os.getppid()}/mem", os.O_RDWR))
    print("opened")
except OSError as err:
    print(type(err).__name__)
"""


@pytest.mark.parametrize("protected", [True, False])
def test_the_checker_memory_is_closed_to_its_children_only_once_protected(protected):
    """The runner's own code in the sandbox, with and without `protect_from_children()`: a
    child of the same uid opens the parent's /proc/<pid>/mem read-write (what the swe attack
    below uses to rewrite verdicts) exactly when the parent skipped the protection."""
    import evotrainer.sandbox.runner as runner

    body = runner.SOURCE.split('\nif __name__ == "__main__":')[0]
    probe = ("protect_from_children()\n" if protected else "") + (
        "import subprocess, sys\n"
        f"print(subprocess.run([sys.executable, '-I', '-S', '-c', {OPEN_PARENT_MEMORY!r}],"
        " capture_output=True, text=True).stdout, end='')\n")
    result = LocalSandbox().run(body + "\n" + probe)
    assert result.stdout == ("PermissionError\n" if protected else "opened\n"), result


class ForgedChannel:
    """A sandbox whose output the test chooses: what the host sees if anything but the checker
    wrote to the channel, or the checker died."""

    def __init__(self, stdout: str, status: str = "ok", exit_code: int | None = 0) -> None:
        self.stdout, self.status, self.exit_code = stdout, status, exit_code

    def run(self, source: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
        nonce = json.loads(stdin)["nonce"]
        return RunResult(self.status, self.stdout.replace("NONCE", nonce), "", self.exit_code)


PASS_REPORT = '{"whole": "pass", "units": null, "tampered": []}'


@pytest.mark.parametrize(
    ("channel", "reason"),
    [
        (ForgedChannel(""), "no report"),
        (ForgedChannel("", "runtime_error", -9), "no report"),
        (ForgedChannel(f"0123 {PASS_REPORT}\n"), "report not authenticated"),
        (ForgedChannel(f"{PASS_REPORT}\n"), "report not authenticated"),
        (ForgedChannel(f"NONCE {PASS_REPORT}\nNONCE {PASS_REPORT}\n"), "report not authenticated"),
        (ForgedChannel(f"junk\nNONCE {PASS_REPORT}\n"), "report not authenticated"),
        (ForgedChannel("NONCE {not json\n"), "malformed report"),
        (ForgedChannel('NONCE {"whole": "pass"}\n'), "malformed report"),
        (ForgedChannel('NONCE {"whole": "yes", "units": null, "tampered": []}\n'),
         "malformed report"),
    ],
)
def test_host_refuses_a_missing_forged_or_malformed_report(humaneval, monkeypatch, channel,
                                                           reason):
    task = humaneval.task_at(0)
    monkeypatch.setattr(humaneval, "sandbox", lambda: channel)
    score, details = humaneval.judge(task, fenced(PROBLEM["prompt"] +
                                                  PROBLEM["canonical_solution"]))
    assert (score.correct, score.components["pass_fraction"]) == (0.0, 0.0)
    assert score.components["tampered"] == 1.0
    assert reason in details["tampering"]


def test_a_timed_out_checker_fails_without_counting_as_tampering(humaneval, monkeypatch):
    monkeypatch.setattr(humaneval, "sandbox", lambda: ForgedChannel("", "timeout", None))
    score, details = humaneval.judge(humaneval.task_at(0), fenced(WRONG))
    assert (score.correct, score.components["tampered"], details["failure"]) == (
        0.0, 0.0, "timeout")


CODE_TESTS = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in [(1, 2), (2, 2), (5, 0)]]
WRONG_PROGRAM = "print(False)\n"
CODE_VECTORS = {
    "os._exit": (WRONG_PROGRAM + "import os\nos._exit(0)\n", False),
    "sys.exit": (WRONG_PROGRAM + "import sys\nsys.exit(0)\n", False),
    "atexit": ("import atexit, os\natexit.register(lambda: os._exit(0))\n" + WRONG_PROGRAM
               + "raise ValueError\n", False),
    "excepthook": ("import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n" + WRONG_PROGRAM
                   + "raise ValueError\n", False),
    "signal to itself": (WRONG_PROGRAM + "import os, signal\nos.kill(os.getpid(), 15)\n", True),
    "kill the parent": ("import os, signal\ntry:\n    os.kill(os.getppid(), 9)\n"
                        "except OSError:\n    pass\n" + WRONG_PROGRAM, False),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vector", sorted(CODE_VECTORS))
def test_code_wrong_program_plus_attack_scores_zero(vector, mode, monkeypatch):
    source, visible = CODE_VECTORS[vector]
    domain = CodeDomain()
    use_mode(domain, mode, monkeypatch)
    visible = visible and signal_lands(mode)
    task = domain.task_at(0)
    score, details = domain.judge(task, fenced(source))
    assert score.components["correctness"] == 0.0 and score.components["pass_fraction"] == 0.0
    assert score.components["tampered"] == float(visible), details


def test_tampered_is_a_component_of_every_code_scored_domain_and_adds_nothing_unweighted(
        humaneval, tmp_path):
    """Through the verl reward module (the engine sums weighted components the same way):
    `tampered` lands in the extras, and in the score only when the recipe weights it."""
    from evotrainer.backends.verl_reward import compute_score

    for name in ("code", "humaneval", "swe"):
        assert "tampered" in make_domain_class(name).components
    task = humaneval.task_at(0)
    info = {"task_id": task.task_id, "meta": json.dumps(task.meta), "index": 0}
    forged = fenced(VECTORS["os._exit at import"][0])
    scores = []
    for weights in ([("correctness", 1.0)], [("correctness", 1.0), ("tampered", -1.0)]):
        config = tmp_path / f"reward{len(weights)}.json"
        config.write_text(json.dumps({
            "domain": {"name": "humaneval", "data": {"train": "he.jsonl"}},
            "reward": {"components": [{"name": n, "weight": w} for n, w in weights]},
        }))
        result = compute_score(task.data_source, forged, task.answer, info,
                               config_path=str(config))
        assert (result["tampered"], result["acc"]) == (1.0, 0.0)
        scores.append(result["score"])
    assert scores == [0.0, -1.0]


def make_domain_class(name: str):
    from evotrainer.domains import get_domain

    return get_domain(name)


def test_humaneval_has_no_docker_executor(tmp_path, monkeypatch):
    """A DockerSandbox run keeps the request (with its nonce) and the report in files of the
    program's own /tmp: the checker's channel would not be private there, so humaneval runs
    only in the local sandbox; asking for an executor is an error naming the field."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EvoError) as err:
        make_domain({"name": "humaneval", "params": {"executor": "docker"}})
    assert err.value.field == "domain.params.executor"
