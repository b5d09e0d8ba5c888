"""A skill library shared by several workspaces: a git repository of `skills/*.yaml`.

`skill_library: {repo: PATH, ref: main}` in the project spec makes the skills committed on
that repository's `ref` part of the workspace's library (`workspace_library` merges
them). They are read from git objects — never checked out, never executed — and only from
`ref`, the library's reviewed branch: a skill proposed on another branch is not trusted
until a reviewer merges it there.

The library repository is input nobody here reviewed, so every file is checked before it
is parsed: a skill is a regular blob (a symbolic link could point anywhere once checked
out), at most MAX_SKILL_BYTES, valid against skill.schema.json, named as its file. Each
error is one line naming the repository, the path and the field.

Evidence flows back by review too: `share_evidence` writes the gate outcomes this workspace
recorded on its skills (and the skills it created) as one commit on the library's branch
`evidence/<project name>`, never on `ref`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.skills.skill import (
    EVIDENCE_LISTS,
    SKILL_MODELINE,
    Match,
    Skill,
    check_operations,
    evidence_entry,
    load_library,
    match,
    refusals,
    version_domain,
    with_evidence,
)
from evotrainer.store import specs
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.git import GitStore
from evotrainer.store.workspace import PROJECT_FILE

DEFAULT_REF = "main"
SKILLS_DIR = "skills"
# A skill is a page of YAML; the spec loader's own bound (1 MiB) is for every document.
MAX_SKILL_BYTES = 256 * 1024
EVIDENCE_BRANCH_PREFIX = "evidence/"
_BLOB_MODES = ("100644", "100755")


@dataclass(frozen=True)
class SharedLibrary:
    """The skills committed on a library repository's reviewed branch."""

    repo: str  # as configured, for messages and citations
    ref: str
    commit: str
    skills: dict[str, Any]  # name → skill.Skill

    def where(self, path: str) -> str:
        return f"skill library {self.repo}@{self.ref}:{path}"


def library_config(ws: Any) -> dict[str, Any]:
    """The project's `skill_library` block (empty when absent)."""
    return ws.project.get("skill_library") or {}


def library_store(ws: Any, repo: str) -> GitStore:
    """The library repository `repo` (a path relative to the workspace, or a file:// URL)."""
    if "://" in repo and not repo.startswith("file://"):
        raise EvoError(
            f"skill library {repo!r} is a remote URL", where=PROJECT_FILE,
            field="skill_library.repo",
            hint="clone the library and point repo at the clone (a path or file:// URL): "
            "evotrainer reads it offline",
        )
    path = ws.root / Path(repo.removeprefix("file://"))
    if not path.is_dir():
        raise EvoError(f"skill library repository {repo!r} does not exist", where=PROJECT_FILE,
                       field="skill_library.repo", hint="fix the path, or remove skill_library")
    try:
        return GitStore(path)
    except EvoError:
        raise EvoError(f"skill library {repo!r} is not a git repository", where=PROJECT_FILE,
                       field="skill_library.repo",
                       hint="point repo at a git repository with skills/*.yaml") from None


def shared_library(ws: Any) -> SharedLibrary | None:
    """The shared library the project names, or None when it names none."""
    config = library_config(ws)
    if not config.get("repo"):
        return None
    repo, ref = config["repo"], config.get("ref") or DEFAULT_REF
    store = library_store(ws, repo)
    commit = store.rev(f"refs/heads/{ref}")
    if commit is None:
        raise EvoError(f"skill library {repo!r} has no branch {ref!r}", where=PROJECT_FILE,
                       field="skill_library.ref",
                       hint="name the library's reviewed branch (default main)")
    return SharedLibrary(repo, ref, commit, read_skills(store, commit, repo, ref))


def _tree(store: GitStore, treeish: str) -> list[tuple[str, str, str, int | None, str]]:
    """(mode, type, object, size, name) of each entry of one tree, sizes from git itself."""
    out = store.repo.git.ls_tree("-l", "-z", treeish)
    entries = []
    for record in filter(None, out.split("\0")):
        meta, name = record.split("\t", 1)
        mode, kind, sha, size = meta.split()
        entries.append((mode, kind, sha, None if size == "-" else int(size), name))
    return entries


def read_skills(store: GitStore, commit: str, repo: str, ref: str) -> dict[str, Any]:
    """Every `skills/*.yaml` at `commit`, checked (see the module docstring), by name."""
    def where(path: str) -> str:
        return f"skill library {repo}@{ref}:{path}"

    top = {name: (mode, kind, sha) for mode, kind, sha, _, name in _tree(store, commit)}
    if SKILLS_DIR not in top:
        return {}
    _, kind, folder = top[SKILLS_DIR]
    if kind != "tree":
        raise EvoError("is not a folder (a link or a file): the library's skills must be "
                       "files in it", where=where(SKILLS_DIR), field="mode",
                       hint="commit the skills as files under skills/ on the library's "
                       f"{ref}")
    skills: dict[str, Any] = {}
    for mode, kind, sha, size, name in _tree(store, folder):
        path = f"{SKILLS_DIR}/{name}"
        if not name.endswith(".yaml"):
            continue
        if kind != "blob" or mode not in _BLOB_MODES:
            raise EvoError(f"is a {'symbolic link' if mode == '120000' else kind}, not a "
                           "file: a library skill is read as data, never followed",
                           where=where(path), field="mode",
                           hint="replace it by the skill's YAML on the library's "
                           f"{ref}")
        if size is None or size > MAX_SKILL_BYTES:
            raise EvoError(f"is {size} bytes, more than the {MAX_SKILL_BYTES} a skill may be",
                           where=where(path), field="size",
                           hint="a skill is a short YAML page; move data out of it")
        raw = store.repo.odb.stream(bytes.fromhex(sha)).read()
        try:
            doc = specs.load_text(raw, where(path), "Skill")
            skill = Skill(doc.data, where(path))
            check_operations(skill)
        except EvoError as err:
            raise EvoError(err.message, where=err.where or where(path),
                           field=err.field or "(YAML document)",
                           hint=err.hint or "fix the skill on the library's "
                           f"{ref}; nothing was read from it") from None
        if skill.name != name.removesuffix(".yaml"):
            raise EvoError(f"name {skill.name!r} does not match the file name",
                           where=where(path), field="name",
                           hint=f"rename the file to {skill.name}.yaml or fix `name`")
        skills[skill.name] = skill
    return skills


def entry_key(entry: dict[str, Any]) -> tuple:
    """What makes two evidence entries the same record (one version's gate, once)."""
    return (entry.get("version"), entry.get("domain"), entry.get("source"))


def merged(local: dict[str, Any], shared: SharedLibrary | None) -> dict[str, Any]:
    """The workspace's skills with the shared library's: a skill in both keeps the
    workspace's copy (reviewed here) plus the library's evidence entries it lacks; a skill
    only in the library joins as it is there."""
    if shared is None:
        return local
    out = {**shared.skills}
    for name, skill in local.items():
        theirs = shared.skills.get(name)
        if theirs is None:
            out[name] = skill
            continue
        data = dict(skill.data)
        for key in ("evidence", "negative_evidence"):
            ours = list(data.get(key) or [])
            seen = {entry_key(e) for e in ours}
            data[key] = ours + [e for e in theirs.data.get(key) or []
                                if entry_key(e) not in seen]
        out[name] = Skill(data, skill.source)
    return dict(sorted(out.items()))


# ------------------------------------------------------------------- evidence, proposed back


def recorded_here(entry: dict[str, Any]) -> bool:
    """An entry this workspace's gate wrote (skills.evidence_entry), not a cited one."""
    return str(entry.get("source") or "").startswith("gate")


def as_library_entry(entry: dict[str, Any], workspace: str) -> dict[str, Any]:
    """A workspace's gate entry as the library keeps it: the version named with its
    workspace (`swe-ws/v3`, as the built-in entries name `swe-9b/v4`), the source too."""
    return {**entry, "version": f"{workspace}/{entry['version']}",
            "source": f"{workspace} {entry['source']}"}


def share_evidence(ws: Any) -> dict[str, Any] | None:
    """Propose the gate evidence this workspace recorded on its skills (and the skills it
    has that the library lacks and that carry such evidence) back to the shared library:
    one commit on the library's `evidence/<project name>` branch, from its reviewed `ref`.
    Returns {branch, commit, skills}, or None when the library already holds it all."""
    shared = shared_library(ws)
    if shared is None:
        raise EvoError("the project names no shared skill library", where=PROJECT_FILE,
                       field="skill_library.repo",
                       hint="add skill_library: {repo: PATH} to the project spec")
    workspace = ws.project["name"]
    store = library_store(ws, shared.repo)
    branch = f"{EVIDENCE_BRANCH_PREFIX}{workspace}"
    files: dict[str, bytes] = {}
    for name in ws.skill_names():
        raw = ws.git.read("main", f"{SKILLS_DIR}/{name}.yaml")
        if raw is None:
            continue  # not committed on main: not reviewed here either
        ours = specs.load_text(raw, f"main:{SKILLS_DIR}/{name}.yaml", "Skill").data
        gathered = {key: [as_library_entry(e, workspace) for e in ours.get(key) or []
                          if recorded_here(e)]
                    for key in ("evidence", "negative_evidence")}
        if not any(gathered.values()):
            continue
        theirs = shared.skills.get(name)
        base = dict(theirs.data) if theirs else {
            **ours, "evidence": [e for e in ours.get("evidence") or [] if not recorded_here(e)],
            "negative_evidence": [e for e in ours.get("negative_evidence") or []
                                  if not recorded_here(e)]}
        updated = dict(base)
        for key, entries in gathered.items():
            present = {entry_key(e): e for e in base.get(key) or []}
            # A re-gated version moves between the lists: drop its entry from the other one.
            other = "negative_evidence" if key == "evidence" else "evidence"
            moved = {e["version"] for e in gathered[other]}
            kept = [e for e in base.get(key) or [] if e.get("version") not in moved]
            updated[key] = kept + [e for e in entries if entry_key(e) not in present]
        if updated == base:
            continue
        text = SKILL_MODELINE + specs.dump(updated)
        specs.load_text(text, f"{branch}:{SKILLS_DIR}/{name}.yaml", "Skill")  # never invalid
        files[f"{SKILLS_DIR}/{name}.yaml"] = text.encode()
    if not files:
        return None
    tip = store.rev(f"refs/heads/{branch}")
    if tip is not None and all(store.read(tip, path) == body for path, body in files.items()):
        return {"branch": branch, "commit": tip, "skills": sorted(files), "new": False}
    names = ", ".join(Path(p).stem for p in sorted(files))
    commit = store.commit_files(
        branch, files,
        f"Evidence from workspace {workspace}: {names}\n\nProposed for review: merge into "
        f"{shared.ref} to share it with every workspace of the library.",
        {"Action": "share-evidence", "Workspace": workspace},
        start=shared.commit if tip is None else None,
    )
    return {"branch": branch, "commit": commit, "skills": sorted(files), "new": True}


# ------------------------------------------------------------------- the workspace's library


def workspace_library(ws: Any | None) -> dict[str, Skill]:
    """The workspace's `skills/` when it holds any skill, else the built-in library; with
    the shared library the project names (`skill_library`) merged in."""
    if ws is None:
        return load_library()
    local = load_library(ws.root / "skills") if ws.skill_names() else load_library()
    return merged(local, shared_library(ws))


def pending_evidence(
    ws: Any, version: str, decision: dict[str, Any], states: dict | None = None
) -> dict[str, bytes]:
    """The skill files on `main` that still lack `version`'s gated outcome: {path: new text}.

    promote → `evidence`, prune/revert → `negative_evidence`; other verdicts record nothing.
    Empty once recorded, so reconcile can tell (level-triggered) whether it is still to do.
    """
    if decision.get("verdict") not in EVIDENCE_LISTS:
        return {}
    states = states if states is not None else ws.versions()
    state = ws.version(version, states)
    applied = list(((state.spec or {}).get("intervention") or {}).get("skills") or [])
    if not applied:
        return {}
    entry = evidence_entry(version, version_domain(ws, version, states), decision)
    builtin = builtin_dir("skills")
    files: dict[str, bytes] = {}
    for name in applied:
        path = f"skills/{name}.yaml"
        raw = ws.git.read("main", path)
        if raw is None and (builtin / f"{name}.yaml").is_file():
            raw = (builtin / f"{name}.yaml").read_bytes()  # first evidence on a built-in skill
        if raw is None and name in (shared := _shared_skills(ws)):
            # First evidence on a shared library's skill: the workspace keeps its own copy.
            raw = (SKILL_MODELINE + specs.dump(shared[name].data)).encode()
        if raw is None:
            raise EvoError(
                f"version {version!r} applied skill {name!r}, which is neither in "
                "the workspace, its shared library nor built in",
                where=f"main:{path}",
                hint=f"restore {path} on main",
            )
        doc = specs.load_text(raw, f"main:{path}", "Skill")
        updated = with_evidence(doc.data, entry)
        if updated is None:
            continue
        text = _leading_comments(raw.decode()) + specs.dump(updated)
        specs.load_text(text, f"main:{path}", "Skill")  # never commit an invalid skill
        files[path] = text.encode()
    return files


def _shared_skills(ws: Any) -> dict[str, Skill]:
    shared = shared_library(ws)
    return shared.skills if shared else {}


def record_evidence(ws: Any, version: str, decision: dict[str, Any]) -> list[str]:
    """File `version`'s gated outcome on every skill it applied: one commit on `main`
    (trailer Action: evidence). Idempotent. Returns the names of the skills that changed."""
    files = pending_evidence(ws, version, decision)
    names = [Path(p).stem for p in files]
    if files:
        ws.git.commit_files(
            "main",
            files,
            f"Evidence from {version} ({decision['verdict']}): {', '.join(names)}",
            {"Action": "evidence", "Version": version},
        )
    return names


def _leading_comments(text: str) -> str:
    """The comment lines at the top of a file (the editor's schema modeline), kept on rewrite."""
    lines = []
    for line in text.splitlines(keepends=True):
        if not line.startswith("#"):
            break
        lines.append(line)
    return "".join(lines) or SKILL_MODELINE


def match_version(ws: Any, version: str) -> tuple[list[Match], list[Match]]:
    """(matches, refusals) for a version's recorded diagnosis, with the workspace library."""
    states = ws.versions()
    state = ws.version(version, states)
    diagnosis = state.records.get("diagnosis")
    if not diagnosis:
        raise EvoError(
            f"version {version!r} has no diagnosis yet",
            where=f"evo/{version}:runs/{version}/diagnosis.yaml",
            hint="run `evotrainer reconcile` to train and diagnose it",
        )
    recipe = ws.resolved_recipe(version, states)
    domain = recipe["domain"]["name"]
    skills = workspace_library(ws)
    return (
        match(skills, diagnosis, domain=domain, recipe=recipe),
        refusals(skills, diagnosis, domain=domain, recipe=recipe),
    )


# --------------------------------------------------------------------------------- evidence
