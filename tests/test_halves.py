"""store/halves.py: per-item work in two halves, the second in a forked child. The answer is
the one-process answer, in order, whatever happens to the child."""

from __future__ import annotations

import os

import pytest

from evotrainer.store import halves, specs
from evotrainer.store.halves import map_in_halves

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or halves.cpus() < 2,
                                reason="the second half runs in a forked child on a second CPU")


@pytest.fixture
def forking(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Halves from a handful of items on; the pids of the forked children, as they start.
    The test runner's own threads (pytest-xdist's I/O thread) hold no lock the work here
    takes, so they do not stop the fork; a thread of the process under test does (below)."""
    monkeypatch.setattr(halves, "MIN_ITEMS", 4)
    monkeypatch.setattr(halves, "_other_threads", lambda: False)
    children: list[int] = []
    fork = os.fork

    def counted_fork() -> int:
        pid = fork()
        if pid:
            children.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", counted_fork)
    return children


def test_the_halves_answer_in_order_as_one_process_does(forking):
    """Each item's answer, in the items' order: the child's half comes back after the
    parent's own."""
    items = list(range(11))
    assert map_in_halves(lambda part: [(i, os.getpid()) for i in part], items)[-1][1] != \
        os.getpid()
    assert [i for i, _ in map_in_halves(lambda part: [(i, 0) for i in part], items)] == items
    assert len(forking) == 2


def test_a_child_that_fails_costs_its_half_here_not_the_answer(forking):
    """The child raises on its half (here: any process but this one): that half is computed
    in this process instead, and the answer is whole."""
    parent = os.getpid()

    def work(part):
        if os.getpid() != parent:
            raise RuntimeError("the child fails")
        return [i * i for i in part]

    assert map_in_halves(work, list(range(10))) == [i * i for i in range(10)]
    assert len(forking) == 1


def test_few_items_are_worked_in_this_process(forking):
    assert map_in_halves(lambda part: [i + 1 for i in part], [1, 2, 3]) == [2, 3, 4]
    assert forking == []


def test_specs_parsed_and_checked_in_halves_are_what_one_process_finds(forking):
    """Valid specs, one the schema refuses, one that does not parse and one with a repeated
    key: parsed and checked in two halves, each comes back as `parse` and `check` say, the
    refused one with its field and position (found again here from its text)."""
    valid = [f"apiVersion: evotrainer/v1\nkind: PolicyVersion\nname: v{i}\nparent: v0\n"
             for i in range(6)]
    texts = [*valid,
             "apiVersion: evotrainer/v1\nkind: PolicyVersion\nname: v6\nparent: v0\nrecipe:\n"
             "  grpo:\n    lrr: 1\n",
             "apiVersion: [evotrainer/v1\n",
             "apiVersion: evotrainer/v1\nname: v8\nname: v9\n"]
    items = [(text.encode(), f"evo/v{i}:spec/versions/v{i}.yaml") for i, text in enumerate(texts)]
    docs = specs.parse_many(items)
    assert [doc is None for doc in docs] == [False] * 7 + [True, True]
    assert [d.data for d in docs[:7]] == [specs.parse(raw, s).data for raw, s in items[:7]]
    problems = specs.check_many(docs[:7], "PolicyVersion")
    assert problems[:6] == [[]] * 6
    [refused] = problems[6]
    assert refused.field == "recipe.grpo.lrr" and "unknown key 'lrr'" in refused.message
    assert refused.where == "evo/v6:spec/versions/v6.yaml:7:5"
    assert len(forking) == 2


def test_no_fork_while_another_thread_of_the_process_runs(monkeypatch):
    """A lock another thread holds at the fork would stay held in the child: with a second
    thread running, everything is computed here."""
    import threading

    monkeypatch.setattr(halves, "MIN_ITEMS", 4)
    forks: list[int] = []
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or 0)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert map_in_halves(lambda part: [i * 2 for i in part], list(range(10))) == \
            [i * 2 for i in range(10)]
    finally:
        stop.set()
        thread.join()
    assert forks == []


def test_thousands_of_git_reads_go_to_two_processes_with_the_answers_in_order(workspace,
                                                                               monkeypatch):
    """GitStore.read_many and present from MIN_ITEMS requests on: two `git cat-file`
    processes at once, each request answered as a read of it alone answers it (a file, a
    missing file, a folder, an unknown ref)."""
    import subprocess

    from evotrainer.store.git import branch_name
    from evotrainer.store.workspace import PROJECT_FILE, version_spec_path

    store = workspace.git
    branch = branch_name("v0")
    wanted = [(ref, path) for ref in ("main", branch, "no-such-ref")
              for path in (PROJECT_FILE, version_spec_path("v0"), "spec", "missing.yaml")]
    alone = {key: store.read_many([key])[key] for key in wanted}
    found = {key for key in wanted if store.present([key])}
    assert alone[("main", PROJECT_FILE)] and alone[(branch, version_spec_path("v0"))]
    assert ("main", "spec") in found and alone[("main", "spec")] is None

    monkeypatch.setattr(halves, "MIN_ITEMS", 4)
    batches: list[bytes] = []
    run = subprocess.run

    def counted(argv, *args, **kwargs):
        if "cat-file" in argv:
            batches.append(kwargs["input"])
        return run(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counted)
    assert store.read_many(wanted) == alone
    assert store.present(wanted) == found
    assert len(batches) == 4 and all(batch.count(b"\n") == len(wanted) // 2
                                     for batch in batches)


def test_a_forked_child_reads_git_through_processes_of_its_own(workspace):
    """GitPython keeps one `cat-file` process a repository for its lookups; a child forked
    after its parent started one starts its own. The attack: parent and child look up two
    objects at once, thousands of times each, after the fork; each reads its own answers
    and neither waits forever (through one process they read each other's answers off its
    pipe, or wait for one the other read)."""
    import signal

    from evotrainer.store.git import GitStore

    store = GitStore(workspace.root)
    commit, tree = store.rev("main"), store.rev("main^{tree}")  # the process starts here
    assert commit != tree
    go_read, go_write = os.pipe()

    def stuck(*_):
        raise TimeoutError("waited a minute for git's answer")

    child = os.fork()
    if child == 0:
        right = False
        try:
            os.read(go_read, 1)
            right = all(store.rev(tree) == tree for _ in range(3000))
        finally:
            os._exit(0 if right else 1)
    signal.signal(signal.SIGALRM, stuck)
    signal.alarm(60)
    status = None
    try:
        os.write(go_write, b"x")  # both start together
        answers = [store.rev(commit) for _ in range(3000)]
        _, status = os.waitpid(child, 0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        if status is None:  # stuck: stopped
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        os.close(go_read)
        os.close(go_write)
    assert set(answers) == {commit}
    assert os.waitstatus_to_exitcode(status) == 0
