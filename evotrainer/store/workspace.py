"""The workspace: a git repository holding specs (desired) and runs (recorded).

```
spec/project.yaml            domain, base recipe, harness in force, budgets, autonomy
spec/versions/<name>.yaml    one policy version, at the tip of branch evo/<name>
harness_versions/<h>.yaml    harness revisions
skills/<name>.yaml           skills
runs/<name>/                 run.yaml, scores.csv, diagnosis.yaml, decision.yaml
.evotrainer/                 git-ignored: artifacts, worktrees, lock
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.store import recipe as recipes
from evotrainer.store import specs
from evotrainer.store.git import GitStore, branch_name
from evotrainer.store.records import DecisionRecord, DiagnosisRecord, RunRecord

PROJECT_FILE = "spec/project.yaml"
STATE_DIR = ".evotrainer"
RECORD_FILES = ("run.yaml", "diagnosis.yaml", "decision.yaml")


def version_spec_path(name: str) -> str:
    return f"spec/versions/{name}.yaml"


def run_path(name: str, file: str) -> str:
    return f"runs/{name}/{file}"


TYPED_RECORDS = {"run": RunRecord, "diagnosis": DiagnosisRecord, "decision": DecisionRecord}


@dataclass
class VersionState:
    """A version as recorded at the tip of its branch."""

    name: str
    sha: str
    spec: dict | None  # None when the branch lacks its spec file
    spec_source: str
    spec_raw: bytes | None
    records: dict[str, dict | None] = field(default_factory=dict)  # run/diagnosis/decision
    # A record file present but unreadable (not YAML, an alias bomb, too large): the
    # version is refused rather than read as never run and launched over it.
    record_errors: dict[str, EvoError] = field(default_factory=dict)

    def record_where(self, kind: str) -> str:
        return f"{branch_name(self.name)}:{run_path(self.name, kind + '.yaml')}"

    @property
    def run(self) -> RunRecord | None:
        return RunRecord.from_record(self.records.get("run"), self.record_where("run"))

    @property
    def diagnosis(self) -> DiagnosisRecord | None:
        return DiagnosisRecord.from_record(
            self.records.get("diagnosis"), self.record_where("diagnosis")
        )

    @property
    def decision(self) -> DecisionRecord | None:
        return DecisionRecord.from_record(
            self.records.get("decision"), self.record_where("decision")
        )

    @property
    def parent(self) -> str | None:
        return (self.spec or {}).get("parent")

    @property
    def approval(self) -> dict:
        approval = (self.spec or {}).get("approval")
        return approval if isinstance(approval, dict) else {}

    @property
    def approved(self) -> bool:
        """The spec *claims* approval; `Workspace.approval_status` says whether it holds."""
        return self.approval.get("approved") is True

    @property
    def spec_digest(self) -> str:
        """Digest of what the version asks for; approving it does not change it."""
        return recipes.digest({k: v for k, v in (self.spec or {}).items() if k != "approval"})


class Workspace:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.git = GitStore(self.root)
        if not (self.root / PROJECT_FILE).is_file():
            raise EvoError(
                f"no {PROJECT_FILE} here, so this is not an EvoTrainer workspace",
                where=str(self.root), hint="run `evotrainer init DIR`, or pass -C DIR",
            )

    @classmethod
    def find(cls, start: Path | None = None) -> Workspace:
        start = (start or Path.cwd()).resolve()
        for candidate in (start, *start.parents):
            if (candidate / PROJECT_FILE).is_file():
                return cls(candidate)
        return cls(start)  # raises the "not a workspace / not a git repository" error

    # ---- desired state -----------------------------------------------------------------

    @cached_property
    def project(self) -> dict:
        return specs.load(self.root / PROJECT_FILE, "Project", source=PROJECT_FILE).data

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    @property
    def artifact_root(self) -> Path:
        # An absolute artifact_root (a shared disk) is used as is: `root / absolute` is it.
        return self.root / self.project.get("artifact_root", f"{STATE_DIR}/artifacts")

    def record_path(self, path: Path) -> str:
        """How a run record names a file: relative to the workspace when inside it, else
        absolute (an artifact_root on another disk)."""
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def worktree_path(self, name: str) -> Path:
        return self.state_dir / "worktrees" / name

    def artifact_dir(self, name: str, job_id: str) -> Path:
        return self.artifact_root / name / job_id

    def run_dir(self, name: str, run: dict) -> Path:
        """The artifact dir a run record names, which must be the one reconcile gives this
        version's job (inside the artifact root): a record edited on a branch cannot point
        jobs, diagnosis or trackers at any other folder."""
        recorded = (self.root / str(run.get("artifact_dir"))).resolve()
        expected = self.artifact_dir(name, str(run.get("job_id"))).resolve()
        if recorded != expected or not expected.is_relative_to(self.artifact_root.resolve()):
            raise EvoError(
                f"the run record of {name} names {run.get('artifact_dir')!r}, not its "
                f"artifact folder {self.record_path(expected)}",
                where=f"{branch_name(name)}:{run_path(name, 'run.yaml')}",
                field="artifact_dir",
                hint="a run's files live only in its own folder under the artifact root; "
                "restore the record",
            )
        return recorded

    def harness_path(self, name: str) -> Path:
        return self.root / "harness_versions" / f"{name}.yaml"

    def skill_path(self, name: str) -> Path:
        return self.root / "skills" / f"{name}.yaml"

    def harness_names(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "harness_versions").glob("*.yaml"))

    def skill_names(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "skills").glob("*.yaml"))

    def harness_in_force(self, version: VersionState | None = None) -> str:
        if version and version.spec and version.spec.get("harness"):
            return version.spec["harness"]
        return self.project.get("harness", "h0")

    # ---- recorded state ----------------------------------------------------------------

    def versions(self) -> dict[str, VersionState]:
        """Every version branch with its spec and records, read in batch."""
        branches = self.git.version_branches()
        wanted = []
        for name in branches:
            ref = branch_name(name)
            wanted.append((ref, version_spec_path(name)))
            wanted += [(ref, run_path(name, f)) for f in RECORD_FILES]
        blobs = self.git.read_many(wanted)
        states = {}
        for name, sha in branches.items():
            ref = branch_name(name)
            source = f"{ref}:{version_spec_path(name)}"
            raw = blobs[(ref, version_spec_path(name))]
            state = VersionState(name, sha, None, source, raw)
            spec = safe_yaml(raw, source)  # `validate` reports a broken spec; listing goes on
            state.spec = spec if isinstance(spec, dict) else None
            for f in RECORD_FILES:
                kind, where = f.removesuffix(".yaml"), f"{ref}:{run_path(name, f)}"
                blob = blobs[(ref, run_path(name, f))]
                try:
                    state.records[kind] = load_record(blob, where)
                    # A record of the wrong shape (a list for `result`, text for `attempt`)
                    # belongs to this version too: read its typed view once here.
                    TYPED_RECORDS[kind].from_record(state.records[kind], where)
                except EvoError as err:
                    state.records[kind] = None
                    state.record_errors[kind] = err
            states[name] = state
        return states

    def version(self, name: str, states: dict[str, VersionState] | None = None) -> VersionState:
        states = states if states is not None else self.versions()
        if name not in states:
            known = ", ".join(sorted(states)) or "none yet"
            raise EvoError(f"no version {name!r} (no branch {branch_name(name)})",
                           hint=f"known versions: {known}")
        state = states[name]
        if state.spec is None:
            raise EvoError("missing or unreadable version spec", where=state.spec_source,
                           hint="run `evotrainer validate` for details")
        return state

    def chain(self, name: str, states: dict[str, VersionState]) -> list[VersionState]:
        """Root → `name` along parent links."""
        out: list[VersionState] = []
        seen: set[str] = set()
        current: str | None = name
        while current is not None:
            if current in seen:
                raise EvoError(f"parent cycle through {current!r}",
                               where=states[current].spec_source, field="parent")
            seen.add(current)
            state = self.version(current, states)
            out.append(state)
            current = state.parent
        return out[::-1]

    def resolved_recipe(self, name: str, states: dict[str, VersionState] | None = None) -> dict:
        states = states if states is not None else self.versions()
        chain = [s.spec.get("recipe") or {} for s in self.chain(name, states)]
        return recipes.resolve(self.project.get("recipe") or {}, chain)

    # ---- approvals ---------------------------------------------------------------------

    def approval_digest(self, name: str, states: dict[str, VersionState] | None = None) -> str:
        """What an approval of `name` binds to: its spec without the approval block and the
        recipe it resolves to (so an inherited change, from an ancestor or the project,
        makes an earlier approval stale too)."""
        states = states if states is not None else self.versions()
        state = self.version(name, states)
        spec = {k: v for k, v in state.spec.items() if k != "approval"}
        return recipes.digest({"spec": spec, "recipe": self.resolved_recipe(name, states)})

    def approval_status(
        self, state: VersionState, states: dict[str, VersionState] | None = None
    ) -> str:
        """`approved` (the approval's digest matches the content now), `unapproved`,
        `stale` (the content changed since it was approved) or `unbound` (an approval block
        without a digest: hand-written, not an approval)."""
        if not state.approved:
            return "unapproved"
        recorded = state.approval.get("digest")
        if not isinstance(recorded, str) or not recorded:
            return "unbound"
        try:
            current = self.approval_digest(state.name, states)
        except EvoError:
            return "stale"  # the lineage no longer resolves: nothing it approved holds
        return "approved" if recorded == current else "stale"


def load_record(blob: bytes | None, source: str) -> dict | None:
    """A record file's data (None when absent), read within the YAML bounds; EvoError when
    it is not a readable mapping."""
    if blob is None:
        return None
    data = specs.load_yaml(blob, source)
    if not isinstance(data, dict):
        raise EvoError("a record must be a mapping", where=source,
                       hint="restore the record from the branch's history")
    return data


def safe_yaml(blob: bytes | None, source: str = "<yaml>") -> Any:
    """The data of a YAML blob, or None when absent or unreadable (broken, an alias bomb,
    too large): `validate` reports why, listing goes on."""
    if blob is None:
        return None
    try:
        return specs.load_yaml(blob, source)
    except EvoError:
        return None
