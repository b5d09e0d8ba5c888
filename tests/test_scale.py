"""Scale: a reconcile pass re-reads after an action only what the
action changed, so an action costs the same however many branches the workspace holds
(counted in files read from git and git processes, never timed); `plan` writes nothing,
not even while a job runs (the live look is reconcile's)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from standin import StandinBackend, propose, reconciler, wait_for
from test_early_stop import flushing_version, job_pid

from evotrainer.control.reconcile import Reconciler, load_context
from evotrainer.store.git import GitStore
from evotrainer.store.workspace import PROJECT_FILE, Workspace

pytestmark = pytest.mark.usefixtures("standin")
BENCH = Path(__file__).resolve().parents[1] / "bench" / "lineage.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_lineage", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_build(root: Path, count: int, shape: str = "tree") -> Workspace:
    """bench/lineage.py's workspace: `count` unapproved versions in a binary tree or one
    chain."""
    return bench_module().build(root, count, shape)


class Counter:
    """Files read from git (through GitStore.read_many) and git processes started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files = self.processes = 0
        read_many, popen_init = GitStore.read_many, subprocess.Popen.__init__

        def counted_read_many(store, wanted):
            wanted = list(wanted)
            self.files += len(wanted)
            return read_many(store, wanted)

        def counted_popen(process, args, *rest, **kwargs):
            if (args[0] if isinstance(args, list | tuple) else str(args)).endswith("git"):
                self.processes += 1
            return popen_init(process, args, *rest, **kwargs)

        monkeypatch.setattr(GitStore, "read_many", counted_read_many)
        monkeypatch.setattr(subprocess.Popen, "__init__", counted_popen)

    def snapshot(self) -> tuple[int, int]:
        return self.files, self.processes


class NoJobBackend(StandinBackend):
    """Launches nothing: what is counted is reconcile's own work around the action."""

    def submit(self, job) -> None:
        pass


def action_cost(root: Path, branches: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """(files read, git processes) a pass spends beyond reading the workspace once, in a
    workspace of `branches` unapproved versions plus two approved ones to launch."""
    ws = bench_build(root, branches)
    project = ws.root / PROJECT_FILE
    data = yaml.safe_load(project.read_text())
    data["autonomy"] = {**(data.get("autonomy") or {}), "max_concurrent_jobs": 2}
    project.write_text(yaml.safe_dump(data, sort_keys=False))
    propose(ws, "wa")
    propose(ws, "wb")
    counter = Counter(monkeypatch)
    reading = Reconciler(Workspace(ws.root), log=lambda _: None,
                         backends={"local": NoJobBackend()})
    before = counter.snapshot()
    load_context(reading.ws, reading.backends)  # no job runs: nothing to look at live
    read_once = [after - then for after, then in zip(counter.snapshot(), before, strict=True)]
    # The same pass from a fresh workspace object: nothing is remembered from the read above.
    passing = Reconciler(Workspace(ws.root), log=lambda _: None,
                         backends={"local": NoJobBackend()})
    before = counter.snapshot()
    plans, applied = passing.pass_once()
    spent = [after - then for after, then in zip(counter.snapshot(), before, strict=True)]
    assert applied == 2 and sorted(p.version for p in plans if p.action) == ["wa", "wb"]
    monkeypatch.undo()
    return spent[0] - read_once[0], spent[1] - read_once[1]


def test_the_cost_of_an_action_does_not_grow_with_the_branches(tmp_path, monkeypatch):
    """Two launches in a pass over 20 branches, then over 120: the files read from git and
    the git processes beyond the pass's one read of the workspace are the same count (the
    old pass read every branch again before each action: 5 files a branch)."""
    small = action_cost(tmp_path / "small", 20, monkeypatch)
    large = action_cost(tmp_path / "large", 120, monkeypatch)
    assert large == small
    assert small[0] < 5 * 20  # the acted versions' files, not another read of every branch


def snapshot(ws: Workspace) -> dict[str, object]:
    """Everything `plan` could write: refs, the working tree, and .evotrainer/ (files,
    their bytes and mtimes) but for the artifact folders the running job itself writes."""
    state: dict[str, object] = {
        "refs": ws.git.repo.git.for_each_ref(),
        "status": ws.git.repo.git.status("--porcelain", "--ignored"),
    }
    artifacts = ws.artifact_root.resolve()
    for path in sorted(ws.root.rglob("*")):
        if ".git" in path.relative_to(ws.root).parts or path.resolve().is_relative_to(artifacts):
            continue
        info = path.lstat()
        state[str(path)] = (info.st_mtime_ns, path.read_bytes() if path.is_file() else None)
    return state


def test_plan_writes_nothing_while_a_job_runs(workspace, cli):
    """A job is running and reconcile has looked at its evidence (.evotrainer/live/). `plan`
    shows it without writing: no ref, no file of the tree, nothing under .evotrainer/ (the
    old plan took a live look of its own and rewrote the live state)."""
    reconciler(workspace).run(wait=True, poll_s=0.05)
    flushing_version(workspace, "v1", leak=False)
    running = reconciler(workspace)
    running.pass_once()  # launch
    pid = job_pid(workspace, "v1")
    live_state = workspace.state_dir / "live" / "v1" / "state.json"

    def looked_at() -> bool:
        running.pass_once()  # polls it to Running, then looks at its evidence
        return (workspace.version("v1").run.state == "Running" and live_state.is_file()
                and json.loads(live_state.read_text())["progress"]["rows"] > 0)

    try:
        wait_for(looked_at)
        before = snapshot(workspace)
        result = cli("-C", str(workspace.root), "plan", "--json")
        assert result.code in (0, 2) and '"version": "v1"' in result.out
        assert snapshot(workspace) == before
    finally:
        psutil.Process(pid).kill()


def parent_reads(root: Path, count: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """How often `validate`'s checks read a version's parent link in a chain `count` deep."""
    from evotrainer.control.validation import check_workspace
    from evotrainer.store.workspace import VersionState

    ws = bench_build(root, count, "chain")
    states = Workspace(ws.root).versions()
    reads = 0
    parent = VersionState.parent

    def counted(state: VersionState) -> str | None:
        nonlocal reads
        reads += 1
        return parent.fget(state)

    with monkeypatch.context() as patch:
        patch.setattr(VersionState, "parent", property(counted))
        validation = check_workspace(Workspace(ws.root), states)
    assert not validation.problems()
    assert validation.refusal(f"v{count - 1}", states) is None
    return reads


def test_validating_a_deep_chain_walks_each_link_a_bounded_number_of_times(tmp_path,
                                                                          monkeypatch):
    """Every version of a chain resolves its recipe and has its ancestors checked; with
    each version's answer remembered, twice the depth reads the parent links about twice
    as often (walking every version's ancestors anew: four times, 12.5 million reads at
    5,000 deep)."""
    shallow = parent_reads(tmp_path / "a", 40, monkeypatch)
    deep = parent_reads(tmp_path / "b", 80, monkeypatch)
    assert deep < 2.5 * shallow


def test_the_benchmark_runs_at_its_smallest_size():
    """bench/lineage.py as a smoke test: a chain of 12, every command and one launch."""
    result = subprocess.run(
        [sys.executable, str(BENCH), "--sizes", "12", "--shapes", "chain",
         "--naive-up-to", "0"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    [row] = [line for line in result.stdout.splitlines() if line.startswith("chain")]
    commands = len(bench_module().COMMANDS)
    assert len(row.split(" s (")) == commands + 2  # each command and the launch, timed


def test_a_lineage_row_as_data_is_what_dataclasses_asdict_gives():
    """`lineage --json` builds each row's data field by field instead of through asdict's
    deep copy: the same data, lists and mappings copied, the spend a mapping."""
    import dataclasses

    from evotrainer.store.lineage import LineageRow, Spend

    row = LineageRow(name="v3", parent="v1", status="prune", score=0.5, ci=(-0.1, 0.2),
                     delta=0.05, verdict="prune", alerts=["leak"], pruned=True, on_main=False,
                     stopped={"rule": "r", "step": 8, "steps": 200, "values": {"x": [1.5]}},
                     spend=Spend(steps=12, wall_hours=0.5, gpu_hours=1.0, planner_tokens=30),
                     against="v0", against_mean=0.4)
    data = row.as_dict()
    assert data == dataclasses.asdict(row) and list(data) == list(dataclasses.asdict(row))
    data["alerts"].append("more")
    data["stopped"]["values"]["x"].append(2.0)
    assert row.alerts == ["leak"] and row.stopped["values"]["x"] == [1.5]
    quiet = LineageRow("v0", None, "proposed", None, None, None, None, [], False, False)
    assert quiet.as_dict() == dataclasses.asdict(quiet)
