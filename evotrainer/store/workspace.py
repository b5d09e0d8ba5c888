"""The workspace: a git repository holding specs (desired) and runs (recorded).

```
spec/project.yaml            domain, base recipe, harness in force, budgets, autonomy
spec/versions/<name>.yaml    one policy version, at the tip of branch evo/<name>
harness_revisions/<h>.yaml   harness revisions
skills/<name>.yaml           skills
runs/<name>/                 run.yaml, scores.csv, diagnosis.yaml, decision.yaml
.evotrainer/                 git-ignored: artifacts, worktrees, lock
```
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.store import recipe as recipes
from evotrainer.store import seal, specs
from evotrainer.store.builtin import HARNESS_FOLDER
from evotrainer.store.git import DIFF_SAFETY, GitStore, branch_name
from evotrainer.store.recipe import copy_tree
from evotrainer.store.records import DecisionRecord, DiagnosisRecord, RunRecord

PROJECT_FILE = "spec/project.yaml"
# Where main keeps the SSH keys whose signatures make an approval (git's allowed-signers
# format). Absent: an approval is proven by the controller's seal alone.
ALLOWED_SIGNERS = "spec/allowed_signers"
STATE_DIR = ".evotrainer"
MAIN_REF = "refs/heads/main"
RECORD_FILES = ("run.yaml", "diagnosis.yaml", "decision.yaml")
# A version's files under runs/<name>/ that its seal covers, and the seal itself.
SEALED_AND_SEAL = (*seal.SEALED_FILES, seal.SEAL_FILE)
# The folder of harness revisions (HARNESS_FOLDER) as a workspace made by an older
# evotrainer names it: `evotrainer migrate` moves it in one commit on main, and every other
# command refuses a checkout that holds it.
OLD_HARNESS_FOLDER = "harness_versions"


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
    # The approval block carries the controller's seal (see store/seal.py).
    approval_sealed: bool = False
    # Records or an approval this reader cannot check: it holds no record key.
    unverified: bool = False
    # Files the branch changed after the commit that sealed its records (commits nobody
    # recorded, e.g. pushed onto a parent after it ran): what its children carry unrecorded.
    changed_after_record: list[str] = field(default_factory=list)
    # The spec as a document found valid before (specs.cached_valid), when it was: what
    # validation reads instead of looking it up again.
    checked: specs.Document | None = field(default=None, repr=False, compare=False)
    # Otherwise the spec as parsed when it was read (positions kept, duplicate keys refused),
    # when it parsed: what validation checks instead of parsing the bytes a second time.
    parsed: specs.Document | None = field(default=None, repr=False, compare=False)

    def copy(self) -> VersionState:
        """A copy whose spec and records can be changed without changing this one."""
        return replace(self, spec=copy_tree(self.spec), records=copy_tree(self.records),
                       record_errors=dict(self.record_errors),
                       changed_after_record=list(self.changed_after_record))

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


class OldLayout(EvoError):
    """A workspace in an older evotrainer's layout (its fix is run in that workspace)."""


class Workspace:
    def __init__(self, root: Path, *, migrating: bool = False) -> None:
        """The workspace at `root`; `migrating`: also one in an older evotrainer's layout
        (only `migrate` opens one)."""
        self.root = root.resolve()
        self.git = GitStore(self.root)
        self._record_key: bytes | None = None
        # name → (commit, record key, state) of each branch read so far: see `_states`.
        self._read: dict[str, tuple[str, tuple[bytes | None, str | None], VersionState]] = {}
        # Resolved recipes by what they are resolved from: see `resolved_recipe`.
        self._recipes: dict[str, dict] = {}
        self._project_key: tuple[Any, str] = (None, "")
        # The resolved-recipe key of each version of one `states` mapping (held, so its
        # identity is not reused) under one project key: see `_recipe_key`.
        self._keyed: tuple[dict | None, str] = (None, "")
        self._version_keys: dict[str, str] = {}
        if not (self.root / PROJECT_FILE).is_file():
            raise EvoError(
                f"no {PROJECT_FILE} here, so this is not an EvoTrainer workspace",
                where=str(self.root), hint="run `evotrainer init DIR`, or pass -C DIR",
            )
        if not migrating:
            self._refuse_old_layout()

    @classmethod
    def find(cls, start: Path | None = None, *, migrating: bool = False) -> Workspace:
        start = (start or Path.cwd()).resolve()
        for candidate in (start, *start.parents):
            if (candidate / PROJECT_FILE).is_file():
                return cls(candidate, migrating=migrating)
        raise EvoError(
            f"not inside an EvoTrainer workspace (no {PROJECT_FILE} here or above)",
            where=str(start),
            hint="cd into a workspace or pass -C DIR; `evotrainer init DIR` creates one",
        )

    def _refuse_old_layout(self) -> None:
        """Raise when the checkout holds harness_versions/, where an older evotrainer kept
        the harness revisions: no command reads that folder, so none runs beside it."""
        old, new = OLD_HARNESS_FOLDER, HARNESS_FOLDER
        if not self._old_harness_files():
            return
        if (self.root / new).exists():
            raise EvoError(
                f"{old}/ is left beside {new}/, and no command reads it",
                where=str(self.root),
                hint=f"move what it still holds into {new}/ (`git status {old}`), then "
                "remove it",
            )
        raise OldLayout(
            f"{old}/ is now named {new}/ (this workspace was made by an older evotrainer)",
            where=str(self.root),
            hint="run `evotrainer migrate`: one commit on main moves the folder, each file "
            f"keeps its history; or on main: git mv {old} {new} && git commit -m "
            f'"rename {old} to {new}"',
        )

    def migrate(self) -> int:
        """Move harness_versions/ to harness_revisions/ on main in one commit (trailer
        Action: migrate); the number of files moved (0: nothing to move). Refused when main
        holds both folders, or the checkout keeps files under the old one."""
        old, new = OLD_HARNESS_FOLDER, HARNESS_FOLDER
        if self.git.present([(MAIN_REF, old), (MAIN_REF, new)]) == {(MAIN_REF, old),
                                                                    (MAIN_REF, new)}:
            raise EvoError(
                f"main holds both {old}/ and {new}/",
                where=f"main:{old}",
                hint=f"move each file of {old}/ into {new}/ by hand (git mv), then commit; "
                "nothing was changed",
            )
        moved = self.git.move_folder(
            "main", old, new, f"Move {old}/ to {new}/, where evotrainer reads harness revisions",
            {"Action": "migrate"},
        )
        left = self._old_harness_files()
        if left:
            shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
            raise EvoError(
                f"the checkout still holds {old}/ after main moved it: {shown}",
                where=str(self.root / old),
                hint=f"check out main (`git checkout main`); move a file main does not track "
                f"into {new}/, then remove {old}/",
            )
        return moved

    def _old_harness_files(self) -> list[str]:
        """The files under harness_versions/ in the checkout (an empty folder holds none)."""
        folder = self.root / OLD_HARNESS_FOLDER
        if not folder.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix()
                      for p in folder.rglob("*") if not p.is_dir())

    # ---- desired state -----------------------------------------------------------------

    @cached_property
    def project(self) -> dict:
        return specs.load(self.root / PROJECT_FILE, "Project", source=PROJECT_FILE).data

    def reload_project(self) -> None:
        """Read the project spec afresh next time: a commit on main changed it."""
        self.__dict__.pop("project", None)

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    @property
    def checked_dir(self) -> Path:
        """The documents checked valid before, by content digest (specs.cached_valid)."""
        return self.state_dir / "cache" / "checked"

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
        return self.root / HARNESS_FOLDER / f"{name}.yaml"

    def skill_path(self, name: str) -> Path:
        return self.root / "skills" / f"{name}.yaml"

    def harness_names(self) -> list[str]:
        return sorted(p.stem for p in (self.root / HARNESS_FOLDER).glob("*.yaml"))

    def skill_names(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "skills").glob("*.yaml"))

    def harness_in_force(self, version: VersionState | None = None) -> str:
        if version and version.spec and version.spec.get("harness"):
            return version.spec["harness"]
        return self.project.get("harness", "h0")

    # ---- recorded state ----------------------------------------------------------------

    def versions(self) -> dict[str, VersionState]:
        """Every version branch with its spec and records, read in batch. Branches whose tip
        this workspace already read (same commit, same record key) are not read again."""
        return self._states(self.git.version_branches())

    def reread(
        self, states: dict[str, VersionState], names: Iterable[str]
    ) -> dict[str, VersionState]:
        """`states` with the versions `names` read again at their branch tips (a version
        whose branch is gone drops out): what reconcile re-reads after acting on them, at a
        cost that does not grow with the number of branches."""
        names = list(names)
        tips = self.git.version_tips(names)
        fresh = self._states(tips)
        out = {name: state for name, state in states.items() if name not in names}
        out.update(fresh)
        return out

    def _states(self, branches: dict[str, str]) -> dict[str, VersionState]:
        """The states of `branches` (name → tip commit), each a fresh copy callers may
        change. A state read before is reused only for the same commit and the same record
        key: the commit fixes every byte read, the key every seal verdict."""
        key = self.record_key
        # main's tip too: whether a branch is rewound is read against what main holds.
        main = self.git.rev(MAIN_REF)
        stale = {name: sha for name, sha in branches.items()
                 if self._read.get(name, (None, None, None))[:2] != (sha, (key, main))}
        if stale:
            for name, state in self._read_states(stale).items():
                self._read[name] = (state.sha, (key, main), state)
        return {name: self._read[name][2].copy() for name in branches}

    def _read_states(self, branches: dict[str, str]) -> dict[str, VersionState]:
        """Read and check the specs and records of `branches` at exactly those commits."""
        # Most branches of a large lineage are proposals without records: their runs/
        # folder is looked up once, and only the files of those that have one are read.
        recorded = self.git.present((sha, f"runs/{name}") for name, sha in branches.items())
        wanted = []
        for name, sha in branches.items():
            wanted.append((sha, version_spec_path(name)))
            if (sha, f"runs/{name}") in recorded:
                wanted += [(sha, run_path(name, f))
                           for f in SEALED_AND_SEAL]
        # main's copy of each recorded version's records: a branch moved back behind what
        # main merged of it is rewound (`_check_rewound`).
        wanted += [(MAIN_REF, run_path(name, f)) for name, sha in branches.items()
                   if (sha, f"runs/{name}") in recorded
                   for f in SEALED_AND_SEAL]
        blobs = self.git.read_many(wanted)
        parents = self.git.first_parents(
            sha for name, sha in branches.items() if (sha, f"runs/{name}") in recorded)
        states = {}
        checked = self.checked_dir
        parses = _KeptParses(self.record_key, checked)
        for name, sha in branches.items():
            source = f"{branch_name(name)}:{version_spec_path(name)}"
            raw = blobs[(sha, version_spec_path(name))]
            state = states[name] = VersionState(name, sha, None, source, raw)
            state.checked = raw and specs.cached_valid(raw, source, "PolicyVersion",
                                                       checked) or None
        # The specs not found valid before, parsed as validation parses them, all at once
        # (None: a spec that does not parse).
        unchecked = [s for s in states.values() if s.checked is None and s.spec_raw is not None]
        for state, doc in zip(unchecked, specs.parse_many(
                [(s.spec_raw, s.spec_source) for s in unchecked]), strict=True):
            state.parsed = doc
        for name, sha in branches.items():
            state, ref = states[name], branch_name(name)
            # `validate` reports a broken spec; listing goes on
            # (the data is shared with `checked`: callers get copies of this state)
            known = state.checked or state.parsed
            spec = known.data if known else safe_yaml(state.spec_raw, state.spec_source)
            state.spec = spec if isinstance(spec, dict) else None
            files = dict.fromkeys(SEALED_AND_SEAL)
            on_main = dict.fromkeys(SEALED_AND_SEAL)
            if (sha, f"runs/{name}") in recorded:  # else no record file is there to read
                files = {f: blobs[(sha, run_path(name, f))] for f in SEALED_AND_SEAL}
                on_main = {f: blobs[(MAIN_REF, run_path(name, f))] for f in SEALED_AND_SEAL}
            for f in RECORD_FILES:
                kind, where = f.removesuffix(".yaml"), f"{ref}:{run_path(name, f)}"
                try:
                    state.records[kind] = parses.load(files[f], where)
                    # A record of the wrong shape (a list for `result`, text for `attempt`)
                    # belongs to this version too: read its typed view once here.
                    TYPED_RECORDS[kind].from_record(state.records[kind], where)
                except EvoError as err:
                    state.records[kind] = None
                    state.record_errors[kind] = err
            self._check_seal(state, files, parents.get(sha), on_main)
        parses.remember()
        return states

    def _check_seal(self, state: VersionState, files: dict[str, bytes | None],
                    parent: str | None = None,
                    on_main: dict[str, bytes | None] | None = None) -> None:
        """Trust the version's records and approval only as far as the controller's seal
        proves it wrote them: records that do not verify refuse the version (named as
        forged); an approval block that does not verify is not an approval. Records also
        hold their place in the branch's history: a seal standing on another commit than
        the one it was written onto is refused, a branch moved back behind the records main
        merged of it is named rewound, and files committed after the sealing commit are
        noted (`changed_after_record`). `parent`: the tip's first parent; `on_main`: main's
        copy of the version's record files."""
        key = self.record_key
        recorded = any(files[f] is not None for f in seal.SEALED_FILES)
        if key is None:  # a reader without the key (a fork's CI): nothing can be verified
            state.unverified = recorded or state.approved
            # ...and nothing is acted on: records no one here can check are read by no
            # reader (backtests, planners, lineage), as forged ones are not.
            if recorded:
                state.records = dict.fromkeys(state.records)
            return
        found = seal.read_seal(files[seal.SEAL_FILE])
        if state.approved:
            expected = seal.approval_mac(key, state.name, state.approval)
            state.approval_sealed = seal.same(found.get("approval"), expected)
        previous = found.get("previous")
        if not recorded and not previous:
            return  # no records, and no seal to hold a place (most proposals: no MAC to compute)
        genuine = seal.same(found.get("records"),
                            seal.records_mac(key, state.name, files, previous))
        if not recorded and not genuine:
            return  # no records, and no seal of the controller's to hold a place
        if not genuine:
            written = ", ".join(run_path(state.name, f) for f in seal.SEALED_FILES
                                if files[f] is not None)
            # Nothing forged is read as evidence by anyone (lineage, report, backtests).
            state.records = dict.fromkeys(state.records)
            state.record_errors["seal"] = EvoError(
                f"forged records: {written} on {branch_name(state.name)} were not written "
                "by this controller (their seal does not verify)",
                where=f"{branch_name(state.name)}:{run_path(state.name, seal.SEAL_FILE)}",
                hint="nothing is launched, diagnosed, gated or promoted from them; remove "
                f"runs/{state.name}/ from the branch (a reviewer then approves it), or set "
                f"{seal.KEY_ENV} to the key of the controller that wrote them",
            )
            return
        branch = branch_name(state.name)
        seal_path = run_path(state.name, seal.SEAL_FILE)
        if previous is not None and parent != previous:  # the tip is not the sealing commit
            sealed_at, sealed_onto = self.git.last_change(state.sha, seal_path)
            if sealed_at is None or sealed_onto != previous:
                self._refuse_records(state, EvoError(
                    f"records out of place: {seal_path} on {branch} was sealed onto commit "
                    f"{previous[:12]}, not where it stands now (records restored or "
                    "replayed from elsewhere in the version's history)",
                    where=f"{branch}:{seal_path}",
                    hint="nothing is launched, diagnosed, gated or promoted from them; "
                    f"restore {branch} to the commit the controller wrote (git reflog "
                    f"{branch}) or remove runs/{state.name}/ from the branch",
                ))
                return
            state.changed_after_record = self.git.changed_paths(sealed_at, state.sha)
        self._check_rewound(state, files, on_main or {}, key)

    def _check_rewound(self, state: VersionState, files: dict[str, bytes | None],
                       on_main: dict[str, bytes | None], key: bytes) -> None:
        """A branch whose tip main already contains, while main holds later records of the
        version (sealed by this controller), was moved back: named rewound, read as
        nothing (its older records would be re-collected, re-gated, re-merged)."""
        main_seal = on_main.get(seal.SEAL_FILE)
        if main_seal is None or main_seal == files[seal.SEAL_FILE]:
            return
        found = seal.read_seal(main_seal)
        genuine = seal.same(found.get("records"), seal.records_mac(
            key, state.name, on_main, found.get("previous")))
        if not genuine or not self.git.is_ancestor(state.sha, MAIN_REF):
            return
        branch = branch_name(state.name)
        seal_path = run_path(state.name, seal.SEAL_FILE)
        latest, _ = self.git.last_change(MAIN_REF, seal_path)
        self._refuse_records(state, EvoError(
            f"rewound: {branch} was moved back behind its own records (main holds later "
            f"records of {state.name}, sealed by this controller)",
            where=branch,
            hint="nothing is launched, diagnosed, gated or promoted from it; restore the "
            f"branch: git branch -f {branch} {(latest or 'main')[:12]}",
        ))

    @staticmethod
    def _refuse_records(state: VersionState, error: EvoError) -> None:
        """The version's records are read as nothing, and `error` refuses it."""
        state.records = dict.fromkeys(state.records)
        state.record_errors["seal"] = error

    def refuse_unverified(self, states: dict[str, VersionState], doing: str) -> None:
        """Raise when `states` hold versions this reader cannot verify (it holds no record
        key): a command that would act on recorded evidence (`doing`) acts on nothing it
        cannot check, and says so in one line."""
        unverified = sorted(name for name, state in states.items() if state.unverified)
        if not unverified:
            return
        shown = ", ".join(unverified[:5]) + (f" and {len(unverified) - 5} more"
                                             if len(unverified) > 5 else "")
        raise EvoError(
            f"nothing could be verified: this machine holds no record key, so the records "
            f"and approvals of {shown} cannot be checked and {doing} acts on none of them",
            where=str(self.root),
            hint=f"run it where the controller's key is (set {seal.KEY_ENV} to it); "
            "`evotrainer plan` lists what cannot be verified",
        )

    @property
    def record_key(self) -> bytes | None:
        """The controller's key, or None where there is none (only writers make one)."""
        if self._record_key is None:
            self._record_key = seal.record_key(self.state_dir, create=False)
        return self._record_key

    def commit_records(
        self,
        name: str,
        files: dict[str, bytes | None],
        message: str,
        trailers: dict[str, str],
        approval: dict | None = None,
        sign: bool = False,
    ) -> str:
        """The one way the controller writes a version's records (and its approval):
        `files` (runs/<name>/… and, with `approval`, the spec carrying that block) committed
        with a fresh seal over the records as this commit leaves them, onto exactly the tip
        they were read from (compare-and-swap: a concurrent commit makes this fail)."""
        key = self._record_key = seal.record_key(self.state_dir, create=True)
        branch = branch_name(name)
        tip = self.git.rev(f"refs/heads/{branch}")
        paths = {f: run_path(name, f) for f in (*seal.SEALED_FILES, seal.SEAL_FILE)}
        current = self.git.read_many([(tip, p) for p in paths.values()]) if tip else {}
        before = {f: current.get((tip, p)) for f, p in paths.items()}
        sealed = seal.read_seal(before[seal.SEAL_FILE])
        if any(before[f] is not None for f in seal.SEALED_FILES) and not seal.same(
            sealed.get("records"), seal.records_mac(key, name, before, sealed.get("previous"))
        ):  # never seal over what someone else wrote
            raise EvoError(
                f"forged records on {branch}: the controller did not write runs/{name}/",
                where=f"{branch}:{paths[seal.SEAL_FILE]}",
                hint=f"remove runs/{name}/ from the branch; nothing was committed",
            )
        after = {f: files.get(p, before[f]) for f, p in paths.items()}
        # Bound to the commit it is written onto: its place in the version's history.
        sealed["previous"] = tip
        sealed["records"] = seal.records_mac(key, name, after, tip)
        if approval is not None:
            sealed["approval"] = seal.approval_mac(key, name, approval)
        files = {**files, paths[seal.SEAL_FILE]: seal.seal_text(sealed)}
        return self.git.commit_files(branch, files, message, trailers, expect=tip, sign=sign)

    def version(self, name: str, states: dict[str, VersionState] | None = None) -> VersionState:
        states = states if states is not None else self.versions()
        if name not in states:
            known = ", ".join(sorted(states)) or "none yet"
            similar = [known for known in states if known.lower() == name.lower()]
            raise EvoError(f"no version {name!r} (no branch {branch_name(name)})",
                           hint=f"did you mean {similar[0]}?" if similar
                           else f"known versions: {known}")
        state = states[name]
        if state.spec is None:
            raise EvoError("missing or unreadable version spec", where=state.spec_source,
                           hint="run `evotrainer validate` for details")
        return state

    def chain(self, name: str, states: dict[str, VersionState]) -> list[VersionState]:
        """Root → `name` along parent links."""
        return self._links_above(name, states, {})

    def _links_above(
        self, name: str, states: dict[str, VersionState], known: dict[str, str]
    ) -> list[VersionState]:
        """The chain root → `name`, cut below the nearest version in `known` (that one and
        its ancestors left out): what is still to be resolved."""
        out: list[VersionState] = []
        seen: set[str] = set()
        current: str | None = name
        while current is not None and current not in known:
            if current in seen:
                raise EvoError(f"parent cycle through {current!r}",
                               where=states[current].spec_source, field="parent")
            seen.add(current)
            state = self.version(current, states)
            out.append(state)
            current = state.parent
        return out[::-1]

    def resolved_recipe(
        self, name: str, states: dict[str, VersionState] | None = None, *, shared: bool = False
    ) -> dict:
        """The project's recipe with every override root → `name` merged in. Each link is
        resolved once from its parent's result, remembered under everything it is resolved
        from (the project's recipe and each override on the way), so a tree of thousands of
        versions costs one merge per version, not one per ancestor. `shared`: the
        remembered recipe itself, for a reader that changes nothing (validation's checks);
        otherwise a copy of it."""
        states = states if states is not None else self.versions()
        recipe = self._recipes[self._recipe_key(name, states)]
        return recipe if shared else copy_tree(recipe)

    def _recipe_key(self, name: str, states: dict[str, VersionState]) -> str:
        """The key `name`'s resolved recipe is remembered under, resolving what is not yet:
        each version's key is its parent's chained with its own spec, and is kept for the
        `states` mapping it was read from, so resolving every version of a chain N deep
        walks N links, not N × depth. (A caller that changes a version gets a new mapping
        from `versions` / `reread`; `states` is read as the snapshot it is.)"""
        project = self.project.get("recipe") or {}
        if self._project_key[0] is not project:  # the digest once per project document
            self._project_key = (project, _link_key("project", project))
        project_key = self._project_key[1]
        if self._keyed[0] is not states or self._keyed[1] != project_key:
            self._keyed, self._version_keys = (states, project_key), {}
        if project_key not in self._recipes:
            self._recipes[project_key] = recipes.resolve(project, [])
        known = self._version_keys
        links = self._links_above(name, states, known)
        parent = links[0].parent if links else None
        key = known[parent] if parent is not None else project_key
        for state in links:
            overrides = state.spec.get("recipe") or {}
            # The spec's bytes stand for its overrides where it was parsed from them (every
            # state read from git, or from the working tree by `validate`). One flat digest
            # a link, so a chain thousands of versions deep keys in constant size.
            link = state.spec_raw if state.spec_raw is not None else _link_key(
                "overrides", overrides).encode()
            parent_key, key = key, hashlib.sha256(key.encode() + b"\0" + link).hexdigest()
            if key not in self._recipes:
                self._recipes[key] = recipes.deep_merge(self._recipes[parent_key], overrides,
                                                        share_base=True)
            known[state.name] = key
        return known[name]

    # ---- approvals ---------------------------------------------------------------------

    def approval_digest(self, name: str, states: dict[str, VersionState] | None = None) -> str:
        """What an approval of `name` binds to: its spec without the approval block, the
        recipe it resolves to (so an inherited change, from an ancestor or the project,
        makes an earlier approval stale too) and every other file of the branch's tree but
        the controller's own records — the whole content promotion would merge."""
        states = states if states is not None else self.versions()
        state = self.version(name, states)
        spec = {k: v for k, v in state.spec.items() if k != "approval"}
        return recipes.digest({
            "spec": spec,
            "recipe": self.resolved_recipe(name, states),
            "tree": self.git.tree_digest(state.sha, self.unbound_paths(name)),
        })

    @staticmethod
    def unbound_paths(name: str) -> frozenset[str]:
        """The files of a version's branch an approval does not bind: the spec (whose
        approval block changes when it is approved; the rest of it is bound as data) and
        the records the controller writes and seals after the approval."""
        return frozenset({version_spec_path(name), *(
            run_path(name, f) for f in (*seal.SEALED_FILES, seal.SEAL_FILE))})

    def approval_status(
        self, state: VersionState, states: dict[str, VersionState] | None = None
    ) -> str:
        """`approved` (the approval is the controller's and its digest matches the content
        now), `unapproved`, `unbound` (an approval block without a digest), `forged` (an
        approval block the controller did not write: its seal does not verify),
        `unverified` (this reader holds no record key to check it), `stale`
        (the content changed since it was approved) or `unsigned` (main keeps allowed
        signers, and no allowed key signed the approval commit)."""
        if not state.approved:
            return "unapproved"
        recorded = state.approval.get("digest")
        if not isinstance(recorded, str) or not recorded:
            return "unbound"
        if state.unverified:
            return "unverified"
        if not state.approval_sealed:
            return "forged"
        try:
            current = self.approval_digest(state.name, states)
        except EvoError:
            return "stale"  # the lineage no longer resolves: nothing it approved holds
        if recorded != current:
            return "stale"
        if self.allowed_signers is not None and self.approval_signer(state) is None:
            return "unsigned"
        return "approved"

    @cached_property
    def allowed_signers(self) -> bytes | None:
        """main's allowed-signers file: when present, an approval must also be a commit
        signed by one of its keys (`evotrainer approve` signs with git's signing setup)."""
        return self.git.read("refs/heads/main", ALLOWED_SIGNERS)

    def spec_commit(self, state: VersionState) -> str:
        """The commit that last changed the version's spec ("" for none): the approval
        commit when it is approved, what its worktree trains from and its trackers name."""
        return self.git.repo.git.log("-1", "--format=%H", state.sha, "--",
                                     version_spec_path(state.name)).strip()

    def approval_signer(self, state: VersionState) -> str | None:
        """Who signed the commit that wrote `state`'s approval (the last commit of its
        spec), if an allowed signer did."""
        commit = self.spec_commit(state)
        if not commit or self.allowed_signers is None:
            return None
        return self.git.signed_by(commit, self.allowed_signers)

    def merge_changes(
        self, state: VersionState, states: dict[str, VersionState]
    ) -> list[tuple[str, str]]:
        """(status, path) of every file that merging the version's branch into main would
        bring (`git diff main...evo/<v>`: from their merge base, so files pushed onto a
        parent after it ran show too), less the records of the version and of its
        ancestors that stand there as the controller sealed them on their own branches.
        This, not the diff against the parent, is what an approval lets into main."""
        base = MAIN_REF if self.git.rev(MAIN_REF) else None
        kept = self.sealed_record_paths(state, states)
        args = ["--name-status", "-z", "--no-renames", *DIFF_SAFETY]
        if base is None:
            out = self.git.repo.git.show("--format=", *args, state.sha, "--")
        else:
            out = self.git.repo.git.diff(*args, f"{base}...{state.sha}", "--")
        fields = [f for f in out.split("\0") if f]
        pairs = list(zip(fields[::2], fields[1::2], strict=False))
        return [(status, path) for status, path in pairs if path not in kept]

    def sealed_record_paths(
        self, state: VersionState, states: dict[str, VersionState]
    ) -> set[str]:
        """The record files of `state` and its ancestors that `state`'s tree holds exactly
        as the controller sealed them on the owning version's branch (verified there)."""
        owners = {}
        for link in self.chain(state.name, states):
            if "seal" in link.record_errors or link.unverified:
                continue
            for f in (*seal.SEALED_FILES, seal.SEAL_FILE):
                owners[run_path(link.name, f)] = link.sha
        blobs = self.git.read_many([(ref, p) for p, ref in owners.items()]
                                   + [(state.sha, p) for p in owners])
        return {p for p, ref in owners.items()
                if blobs[(state.sha, p)] is not None and blobs[(state.sha, p)] == blobs[(ref, p)]}

    def unapproved_changes(self, state: VersionState) -> list[str]:
        """The files the branch changed since its approval commit (the last commit of its
        spec), records of the controller's aside: what a stale approval did not see."""
        approved = self.spec_commit(state)
        if not approved:
            return []
        unbound = self.unbound_paths(state.name)
        return [p for p in self.git.changed_paths(approved, state.sha) if p not in unbound]


def _link_key(kind: str, overrides: Any) -> str:
    """The digest of recipe overrides (any YAML value: one a schema would refuse still gets
    a key of its own)."""
    text = json.dumps([kind, overrides], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


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


class _KeptParses:
    """Record files' data, read back from the checked folder where this controller kept the
    data it parsed from the very same bytes (a MAC under its key over both verifies), else
    parsed and kept: a diagnosis record holding thousands of series points takes 30 ms to
    parse and 1 ms to read back. A reader without the key parses every time."""

    _KIND = "ParsedRecord"

    def __init__(self, key: bytes | None, folder: Path) -> None:
        self.key, self.folder = key, folder
        self.fresh: list[tuple[specs.Document, bytes]] = []

    def load(self, blob: bytes | None, source: str) -> dict | None:
        """load_record's answer for `blob`."""
        if blob is None or self.key is None:
            return load_record(blob, source)
        kept = specs.cached_valid(blob, source, self._KIND, self.folder)
        if kept is not None and isinstance(kept.data, dict):
            record = kept.data.get("record")
            if isinstance(record, dict) and seal.same(
                    kept.data.get("mac"), seal.parsed_mac(self.key, blob, specs.json_text(record))):
                return record
        data = load_record(blob, source)
        try:
            text = specs.json_text(data)
        except TypeError:  # not JSON (a mapping keyed by a number): parsed every time
            return data
        self.fresh.append((specs.Document({"record": data, "mac": seal.parsed_mac(
            self.key, blob, text)}, source, None, blob), blob))
        return data

    def remember(self) -> None:
        """Keep what was parsed, in one pack (specs.remember_valid_many keeps only what JSON
        gives back exactly)."""
        if self.fresh:
            specs.remember_valid_many(self.fresh, self._KIND, self.folder)


def safe_yaml(blob: bytes | None, source: str = "<yaml>") -> Any:
    """The data of a YAML blob, or None when absent or unreadable (broken, an alias bomb,
    too large): `validate` reports why, listing goes on."""
    if blob is None:
        return None
    try:
        return specs.load_yaml(blob, source)
    except EvoError:
        return None
