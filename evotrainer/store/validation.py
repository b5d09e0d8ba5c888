"""Whole-workspace validation: every document against its schema, then cross-references.

Version specs are read at the tip of every `evo/*` branch straight from git, so nothing is
checked out. Problems are collected, not raised: `validate` reports all of them at once.
"""

from __future__ import annotations

from pathlib import Path

from evotrainer.errors import EvoError
from evotrainer.store import specs
from evotrainer.store.git import branch_name
from evotrainer.store.workspace import PROJECT_FILE, VersionState, Workspace

# Recipe fields that name files: they must stay inside the workspace or a data root.
PATH_FIELDS = (("model", "path"), ("domain", "data", "train"), ("domain", "data", "val"))


def validate_workspace(ws: Workspace) -> list[EvoError]:
    problems: list[EvoError] = []
    project_doc = _check_file(ws.root / PROJECT_FILE, PROJECT_FILE, "Project", problems)
    for folder, kind in (("harness_versions", "HarnessRevision"), ("skills", "Skill")):
        for path in sorted((ws.root / folder).glob("*.yaml")):
            doc = _check_file(path, f"{folder}/{path.name}", kind, problems)
            if doc is not None:
                _check_name(
                    doc,
                    path.stem,
                    f"rename the file to {doc.data.get('name')}.yaml or fix `name`",
                    problems,
                )

    states = ws.versions()
    docs: dict[str, specs.Document] = {}
    for name, state in sorted(states.items()):
        doc = _check_version(state, problems)
        if doc is not None:
            docs[name] = doc

    harnesses, skills = set(ws.harness_names()), set(ws.skill_names())
    if project_doc is not None:
        _check_harness_ref(project_doc, ("harness",), harnesses, problems)
        _check_paths(ws, project_doc, ("recipe",), problems)
    for name, doc in docs.items():
        _check_parent(name, doc, docs, states, problems)
        _check_harness_ref(doc, ("harness",), harnesses, problems)
        for i, skill in enumerate((doc.data.get("intervention") or {}).get("skills") or []):
            if skill not in skills:
                problems.append(
                    EvoError(
                        f"unknown skill {skill!r}",
                        where=doc.where(("intervention", "skills", i)),
                        field=f"intervention.skills[{i}]",
                        hint=f"known skills: {', '.join(sorted(skills)) or 'none'}",
                    )
                )
        _check_paths(ws, doc, ("recipe",), problems)
    _check_recipes(ws, docs, states, problems)
    return problems


def _check_recipes(ws: Workspace, docs: dict, states: dict, problems: list) -> None:
    """Each version's resolved recipe through its backend's own checks (group size, clip
    range, domain, checkpoint path, verl keys...), reported at the version that sets it."""
    if any(p.field == "parent" for p in problems):
        return  # a broken lineage has no resolved recipes
    for name, doc in docs.items():
        try:
            check_spec_recipe(ws.resolved_recipe(name, states), doc)
        except EvoError as err:
            problems.append(err)


def _check_file(path: Path, source: str, kind: str, problems: list) -> specs.Document | None:
    try:
        doc = specs.parse(path.read_bytes(), source)
    except EvoError as err:
        problems.append(err)
        return None
    found = specs.check(doc, kind)
    problems.extend(found)
    return None if found else doc


def _check_name(doc: specs.Document, expected: str, hint: str, problems: list) -> None:
    if doc.data.get("name") != expected:
        problems.append(
            EvoError(
                f"name {doc.data.get('name')!r} does not match {expected!r}",
                where=doc.where(("name",)),
                field="name",
                hint=hint,
            )
        )


def _check_version(state: VersionState, problems: list) -> specs.Document | None:
    if state.spec_raw is None:
        problems.append(
            EvoError(
                f"branch {branch_name(state.name)} has no spec/versions/{state.name}.yaml",
                where=branch_name(state.name),
                hint="the spec file must be named after the branch; commit it, or rename "
                "the branch",
            )
        )
        return None
    try:
        doc = specs.parse(state.spec_raw, state.spec_source)
    except EvoError as err:
        problems.append(err)
        return None
    found = specs.check(doc, "PolicyVersion")
    problems.extend(found)
    if found:
        return None
    _check_name(
        doc,
        state.name,
        f"the branch is {branch_name(state.name)}: set `name: {state.name}`, or rename the branch",
        problems,
    )
    return doc


def _check_parent(name: str, doc: specs.Document, docs: dict, states: dict, problems: list) -> None:
    parent = doc.data.get("parent")
    if parent is None:
        return
    if parent not in states:
        problems.append(
            EvoError(
                f"parent {parent!r} does not exist (no branch {branch_name(parent)})",
                where=doc.where(("parent",)),
                field="parent",
                hint=f"known versions: {', '.join(sorted(states))}",
            )
        )
        return
    seen, current = {name}, parent
    while current is not None and current in docs:
        if current in seen:
            problems.append(
                EvoError(
                    f"parent cycle: {name} → … → {current} → … → {name}",
                    where=doc.where(("parent",)),
                    field="parent",
                    hint="point `parent` at an older version so lineage is a tree",
                )
            )
            return
        seen.add(current)
        current = docs[current].data.get("parent")


def _check_harness_ref(doc: specs.Document, path: tuple, harnesses: set, problems: list) -> None:
    value = doc.data.get(path[0])
    if value is not None and value not in harnesses:
        problems.append(
            EvoError(
                f"unknown harness revision {value!r}",
                where=doc.where(path),
                field=".".join(path),
                hint="known revisions in harness_versions/: "
                + (", ".join(sorted(harnesses)) or "none"),
            )
        )


def _check_paths(ws: Workspace, doc: specs.Document, base: tuple, problems: list) -> None:
    recipe = doc.data
    for part in base:
        recipe = (recipe or {}).get(part)
    for fieldpath in PATH_FIELDS:
        value = recipe
        for part in fieldpath:
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str):
            problem = check_path(ws, value)
            if problem:
                full = base + fieldpath
                problems.append(
                    EvoError(
                        problem,
                        where=doc.where(full),
                        field=".".join(full),
                        hint="use a path inside the workspace, or declare its "
                        "folder in the project's `data_roots`",
                    )
                )


def allowed_roots(ws: Workspace) -> list[Path]:
    roots = [ws.root]
    for root in ws.project.get("data_roots") or []:
        roots.append((ws.root / root).resolve())
    return roots


def check_path(ws: Workspace, value: str) -> str | None:
    """None when `value` stays inside the workspace or a data root, else the problem."""
    resolved = (ws.root / value).resolve()
    if any(resolved.is_relative_to(root) for root in allowed_roots(ws)):
        return None
    return f"path {value!r} leaves the workspace and every declared data root"


def check_spec_recipe(recipe: dict, doc: specs.Document) -> None:
    """The backend's own checks of a resolved recipe, located in the version spec."""
    from evotrainer.backends import get_backend

    try:
        get_backend(recipe.get("backend", "local")).check(recipe)
    except EvoError as err:
        field = tuple(err.field.split(".")) if err.field else ()
        inherited = bool(field) and ("recipe", *field) not in doc.marks
        raise EvoError(
            err.message + (" (inherited: set in the project or an ancestor)" if inherited else ""),
            where=doc.where(("recipe", *field)),
            field=f"recipe.{err.field}" if err.field else None,
            hint=err.hint,
        ) from None
