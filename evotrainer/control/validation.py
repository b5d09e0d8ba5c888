"""Whole-workspace validation: every document against its schema, then cross-references.

Version specs are read at the tip of every `evo/*` branch straight from git, so nothing is
checked out; the specs in the working tree (or at a ref: a pull request's head) are checked
too where they differ from the branch tips. Problems are collected, not raised: `validate`
reports all of them at once, and `plan` / `reconcile` refuse exactly the versions that have
one (or whose ancestor has one: they inherit its recipe).

CEL expressions are checked here too, so a syntax error or a misspelt metric is refused
before anything trains instead of reading later as "a metric it reads is null": every harness
revision through its own loader (CEL syntax, bounds and metric names of alerts, gate rules
and early-stop rules; SQL), then each expression of a revision and each version's criterion
evaluated once over stand-in values of the right types (metrics and Δ are doubles, alert
counts ints, `alerts` a list of names, `parent` / `latest` maps of metrics), which catches
a type error (`delta > 'high'`, `2 * delta`) or an expression that is not a condition. A
criterion reads only the metrics of the harness in force and the gate's variables.
"""

from __future__ import annotations

import copy
import difflib
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.store import specs
from evotrainer.store.builtin import HARNESS_FOLDER
from evotrainer.store.git import branch_name
from evotrainer.store.lineage import tree_order
from evotrainer.store.workspace import (
    PROJECT_FILE,
    VersionState,
    Workspace,
    safe_yaml,
)

# Recipe fields that name files: they must stay inside the workspace or a data root.
PATH_FIELDS = (("model", "path"), ("domain", "data", "train"), ("domain", "data", "val"))
LIBRARY_FOLDERS = ((HARNESS_FOLDER, "HarnessRevision"), ("skills", "Skill"))
CRITERION = ("intervention", "hypothesis", "criterion")
# Stand-in values of each type for the one evaluation that type-checks an expression: away
# from 0 and 1, so no division by zero or boundary case is mistaken for a type error.
STAND_IN_DOUBLE = 0.5
STAND_IN_COUNT = 2
# One row of the gate's `strata` (gate/rules.py): what a rule's `s.field` reads.
STAND_IN_STRATUM = {"data_source": "stand-in", "n_tasks": STAND_IN_COUNT,
                    "delta": STAND_IN_DOUBLE, "ci_low": STAND_IN_DOUBLE,
                    "ci_high": STAND_IN_DOUBLE, "p_value": STAND_IN_DOUBLE}
TYPE_HINT = ("metrics, delta and its CI are doubles (compare with 0.0, write 2.0 * x), alert "
             "counts are ints, alerts is a list of names, strata a list of {data_source, "
             "n_tasks, delta, ci_low, ci_high, p_value}")


@dataclass
class Validation:
    """Problems of the workspace-wide files, each once, and of each version."""

    workspace: list[EvoError] = field(default_factory=list)
    versions: dict[str, list[EvoError]] = field(default_factory=dict)
    # Each distinct resolved recipe's verdict from its backend's checks (None: it passed),
    # by its pickle: most versions of a large lineage resolve to a few recipes, and a launch
    # of a recipe checked here is not checked again (`recipe_problem`). A pickle keeps every
    # type and value exactly (NaN, a date) at a fifth of canonical JSON's cost, paid once a
    # version; the same recipe built in another key order is only checked twice.
    recipe_verdicts: dict[bytes, EvoError | None] = field(default_factory=dict)
    # version → the nearest version at or above it with a problem (None: none), filled as
    # `refusal` is asked: `versions` is complete when check_workspace returns it.
    _invalid_above: dict[str, str | None] = field(default_factory=dict, repr=False)

    def recipe_problem(self, recipe: dict, backend: Any = None) -> EvoError | None:
        """The backend's first problem with `recipe` (None: none), checked once."""
        key = pickle.dumps(recipe)
        if key not in self.recipe_verdicts:
            self.recipe_verdicts[key] = recipe_problem(recipe, backend)
        return self.recipe_verdicts[key]

    def problems(self) -> list[EvoError]:
        out = list(self.workspace)
        for name in sorted(self.versions):
            out += self.versions[name]
        return _unique(out)

    def refusal(self, name: str, states: dict[str, VersionState]) -> str | None:
        """Why `name` must not run: its own first problem, or an invalid ancestor's."""
        if self.versions.get(name):
            return str(self.versions[name][0])
        ancestor = self._nearest_invalid(states[name].parent if name in states else None,
                                         states)
        if ancestor is None:
            return None
        return f"ancestor {ancestor} is invalid (its recipe is inherited): " + str(
            self.versions[ancestor][0])

    def _nearest_invalid(self, start: str | None, states: dict[str, VersionState]) -> str | None:
        """The nearest version at or above `start` with a problem (None: none up to a root,
        a missing parent or a cycle), remembered for each version walked, so asking it of
        every version of a chain N deep walks N links, not N × depth."""
        memo, walked = self._invalid_above, []
        found, current = None, start
        while current is not None and current in states:
            if current in memo:
                found = memo[current]
                break
            if self.versions.get(current):
                found = current
                break
            if current in walked:  # a parent cycle: `validate` names it at each member
                break
            walked.append(current)
            current = states[current].parent
        for name in walked:
            memo[name] = found
        return found


def validate_workspace(ws: Workspace, ref: str | None = None) -> list[EvoError]:
    """Every problem: the branch tips, plus the working tree (or `ref`, e.g. a pull
    request's head) where its files differ from them. Each problem once."""
    states = ws.versions()
    problems = check_workspace(ws, dict(states), remember=True).problems()
    overlay = _tree_specs(ws, ref)
    changed = {
        name: (source, raw)
        for name, (source, raw) in overlay.items()
        if name not in states or states[name].spec_raw != raw
    }
    if ref is not None or changed:
        tree_ws = ws if ref is None else _workspace_at(ws, ref, problems)
        for name, (source, raw) in changed.items():
            old = states.get(name)
            states[name] = VersionState(
                name, old.sha if old else "", None, source, raw, dict(old.records) if old else {}
            )
            parsed = safe_yaml(raw)
            states[name].spec = parsed if isinstance(parsed, dict) else None
        if tree_ws is not None:
            problems += check_workspace(tree_ws, states, library_ref=ref,
                                        remember=True).problems()
    return _unique(problems)


def check_workspace(
    ws: Workspace,
    states: dict[str, VersionState] | None = None,
    library_ref: str | None = None,
    backends: dict | None = None,
    remember: bool = False,
) -> Validation:
    """The checks `validate` runs, grouped: plan and reconcile refuse invalid versions.
    `backends` (name → backend) check the recipes they will run; default: by name.
    `remember`: record the version specs found valid by their content digest, so the next
    run reads them without parsing and checking them again (`plan`, read-only, does not)."""
    result = Validation()
    problems = result.workspace
    project_doc = _check_bytes(
        _library_read(ws, library_ref, PROJECT_FILE), PROJECT_FILE, "Project", problems,
        _source(library_ref, PROJECT_FILE),
    )
    names: dict[str, set[str]] = {}
    revisions: dict[str, Any] = {}  # harness name → its HarnessRevision, when it loads
    for folder, kind in LIBRARY_FOLDERS:
        files = _library_files(ws, library_ref, folder)
        names[folder] = {Path(path).stem for path in files}
        for path, raw in sorted(files.items()):
            doc = _check_bytes(raw, path, kind, problems, _source(library_ref, path))
            if doc is not None:
                _check_name(
                    doc,
                    Path(path).stem,
                    f"rename the file to {doc.data.get('name')}.yaml or fix `name`",
                    problems,
                )
            if doc is not None and kind == "HarnessRevision":
                revision = _check_harness(doc, problems)
                if revision is not None:
                    revisions[Path(path).stem] = revision
    harnesses, skills = names[HARNESS_FOLDER], names["skills"]
    project = project_doc.data if project_doc is not None else ws.project
    if project_doc is not None:
        _check_harness_ref(project_doc, ("harness",), harnesses, problems)
        _check_paths(ws, project_doc, ("recipe",), problems)
        _check_controller_fields(project_doc, problems)

    states = states if states is not None else ws.versions()
    # Each version's spec: found valid before, or to be checked (all at once, below).
    known: dict[str, tuple[specs.Document, bool]] = {}
    checked = ws.checked_dir
    for name, state in sorted(states.items()):
        result.versions[name] = []
        doc, checked_before = _version_document(state, result.versions[name], checked)
        if doc is not None:
            known[name] = (doc, checked_before)
    unchecked = [name for name, (_, checked_before) in known.items() if not checked_before]
    checks = specs.check_many([known[name][0] for name in unchecked], "PolicyVersion")
    found_by_check = dict(zip(unchecked, checks, strict=True))
    docs: dict[str, specs.Document] = {}
    # Specs found valid here are recorded together at the end, in one file.
    valid: list[tuple[specs.Document, bytes]] = []
    for name, (doc, checked_before) in known.items():
        found = result.versions[name]
        found += found_by_check.get(name, [])
        if found:
            continue
        if not checked_before:
            valid.append((doc, states[name].spec_raw))
        _check_name(
            doc,
            name,
            f"the branch is {branch_name(name)}: set `name: {name}`, or rename the branch",
            found,
        )
        docs[name] = doc
    if remember and valid:
        specs.remember_valid_many(valid, "PolicyVersion", checked)
    cycling = _into_cycles(docs)
    for name, doc in docs.items():
        found = result.versions[name]
        _check_parent(name, doc, name in cycling, states, found)
        _check_harness_ref(doc, ("harness",), harnesses, found)
        for i, skill in enumerate((doc.data.get("intervention") or {}).get("skills") or []):
            if skill not in skills:
                found.append(
                    EvoError(
                        f"unknown skill {skill!r}",
                        where=doc.where(("intervention", "skills", i)),
                        field=f"intervention.skills[{i}]",
                        hint=f"known skills: {', '.join(sorted(skills)) or 'none'}",
                    )
                )
        _check_paths(ws, doc, ("recipe",), found)
        _check_controller_fields(doc, found)
        _check_approval(doc, name, found)
        in_force = doc.data.get("harness") or project.get("harness") or "h0"
        if in_force in revisions:
            found += criterion_problems(doc, revisions[in_force])
    _check_recipes(ws, docs, states, result, backends or {})
    return result


def _check_harness(doc: specs.Document, problems: list) -> Any:
    """The HarnessRevision of a schema-valid document, or None after recording why not:
    its loader's checks, then each expression type-checked against its variables."""
    from evotrainer.diagnosis.harness import build_harness

    try:
        revision = build_harness(doc)
    except EvoError as err:
        problems.append(err)
        return None
    found = []
    for path, expr, variables in _harness_expressions(doc, revision):
        problem = type_problem(expr, variables)
        if problem:
            found.append(EvoError(problem, where=doc.where(path), field=specs.dotted_field(path),
                                  hint=TYPE_HINT))
    problems += found
    return None if found else revision


def criterion_problems(doc: specs.Document, harness: Any) -> list[EvoError]:
    """A version's criterion against the harness in force: every name it reads is one of the
    harness's metrics or the gate's variables ("did you mean"), and it type-checks as a
    condition. Its syntax and bounds were checked with the spec (store/specs.py)."""
    from evotrainer.store import cel

    expr = ((doc.data.get("intervention") or {}).get("hypothesis") or {}).get("criterion")
    if not isinstance(expr, str):
        return []
    where, field_name = doc.where(CRITERION), specs.dotted_field(CRITERION)
    variables = _gate_stand_ins(harness)
    allowed = sorted(set(variables) - {"params"})  # a decision records no params
    problems = []
    for unknown in sorted(cel.names(expr) - set(allowed)):
        close = difflib.get_close_matches(unknown, allowed, n=1)
        problems.append(EvoError(
            f"criterion {expr!r} reads {unknown!r}, which harness {harness.name} does not "
            "define",
            where=where, field=field_name,
            hint=(f"did you mean {close[0]!r}? " if close else "")
            + f"a criterion reads the metrics of {harness.name} and delta, ci_low, ci_high, "
            "p_value, p_wilcoxon, strata, parent.<metric>, alpha, min_delta, critical_alerts, "
            "critical_behavior_alerts, warning_alerts, alerts",
        ))
    problem = None if problems else type_problem(expr, variables)
    if problem:
        problems.append(EvoError(problem, where=where, field=field_name, hint=TYPE_HINT))
    return problems


def check_criterion(ws: Workspace, doc: specs.Document) -> None:
    """`version new`'s check of a new spec's criterion against the harness in force, the one
    `validate` and `plan` run through check_workspace; raises the first problem."""
    from evotrainer.diagnosis.harness import resolve_harness

    in_force = doc.data.get("harness") or ws.project.get("harness") or "h0"
    problems = criterion_problems(doc, resolve_harness(in_force, ws.root))
    if problems:
        raise problems[0]


def type_problem(expr: str, variables: dict[str, Any]) -> str | None:
    """Why `expr` is not a condition over `variables` (stand-ins of the right types), or None:
    one evaluation finds an operator applied to the wrong types, or a number where a
    true/false is needed."""
    from evotrainer.store import cel

    try:
        value = cel.evaluate(expr, variables)
    except EvoError as err:
        return f"{err.message} (evaluated with stand-in values of each variable's type)"
    if not isinstance(value, bool):
        return f"CEL expression {expr!r} is not a condition: it gives {value!r}, not true/false"
    return None


# Variables (besides the metrics) whose values are counts, lists of alert names or maps of
# metrics: every other variable an expression may read is a double.
COUNT_VARIABLES = frozenset(
    {"critical_alerts", "critical_behavior_alerts", "warning_alerts", "rows", "val_rows", "step",
     "steps"})
ALERT_LIST_VARIABLES = frozenset({"alerts", "critical"})
METRIC_MAP_VARIABLES = frozenset({"parent", "latest"})


def _stand_ins(harness: Any, names: frozenset[str]) -> dict[str, Any]:
    """Each metric of `harness` and each of `names` (the gate's or the live diagnosis's
    variables, diagnosis/harness.py) as a value of its type."""
    metrics = {metric.name: STAND_IN_DOUBLE for metric in harness.metrics}
    fixed = {"params": harness.params, "alpha": harness.alpha, "min_delta": harness.min_delta}
    out: dict[str, Any] = dict(metrics)
    for name in names:
        if name in fixed:
            out[name] = fixed[name]
        elif name in COUNT_VARIABLES:
            out[name] = STAND_IN_COUNT
        elif name in ALERT_LIST_VARIABLES:
            out[name] = [alert.name for alert in harness.alerts]
        elif name in METRIC_MAP_VARIABLES:
            out[name] = metrics
        elif name == "strata":
            out[name] = [STAND_IN_STRATUM]
        else:
            out[name] = STAND_IN_DOUBLE
    return out


def _gate_stand_ins(harness: Any) -> dict[str, Any]:
    from evotrainer.diagnosis.harness import GATE_VARIABLES

    return _stand_ins(harness, GATE_VARIABLES)


def _harness_expressions(doc: specs.Document, harness: Any) -> Iterator[tuple]:
    """(path, expression, stand-in variables) of every CEL expression of a revision: alerts
    see the metrics and params, gate rules the gate's variables, early-stop rules the live
    diagnosis (control/live.py)."""
    from evotrainer.diagnosis.harness import EARLY_STOP_VARIABLES

    alert_vars = _stand_ins(harness, frozenset({"params"}))
    for i, alert in enumerate(doc.data.get("alerts") or []):
        if "when" in alert:
            yield ("alerts", i, "when"), alert["when"], alert_vars
        for j, level in enumerate(alert.get("levels") or []):
            yield ("alerts", i, "levels", j, "when"), level["when"], alert_vars
    gate_vars = _gate_stand_ins(harness)
    for i, rule in enumerate((doc.data.get("gate") or {}).get("rules") or []):
        yield ("gate", "rules", i, "when"), rule["when"], gate_vars
    stop_vars = _stand_ins(harness, EARLY_STOP_VARIABLES)
    for i, rule in enumerate(doc.data.get("early_stop") or []):
        yield ("early_stop", i, "when"), rule["when"], stop_vars


def _check_controller_fields(doc: specs.Document, problems: list) -> None:
    """`model.init_checkpoint` names the weights a job starts from; only reconcile sets it (the
    parent's recorded policy, for `model.init: parent`). Written in a spec it would load any
    checkpoint its author names, from anywhere, its digest computed by that author."""
    path = ("recipe", "model", "init_checkpoint")
    if ((doc.data.get("recipe") or {}).get("model") or {}).get("init_checkpoint") is not None:
        problems.append(EvoError(
            "model.init_checkpoint is set by reconcile, never in a spec",
            where=doc.where(path), field=specs.dotted_field(path),
            hint="remove it; `model.init: parent` starts from the parent's recorded policy",
        ))


def _check_approval(doc: specs.Document, name: str, problems: list) -> None:
    approval = doc.data.get("approval") or {}
    if approval.get("approved") is True and not approval.get("digest"):
        problems.append(
            EvoError(
                "approval block without a digest is not an approval",
                where=doc.where(("approval",)),
                field="approval",
                hint=f"approve with `evotrainer approve {name}`: it records the digest of "
                "what it approves",
            )
        )


def _tree_specs(ws: Workspace, ref: str | None) -> dict[str, tuple[str, bytes]]:
    """{version name: (source, bytes)} of spec/versions/*.yaml in the working tree or at ref."""
    folder = "spec/versions"
    if ref is None:
        return {
            path.stem: (f"{folder}/{path.name}", path.read_bytes())
            for path in sorted((ws.root / folder).glob("*.yaml"))
            if path.is_file()
        }
    return {
        Path(path).stem: (_source(ref, path), raw)
        for path, raw in _library_files(ws, ref, folder).items()
    }


def _workspace_at(ws: Workspace, ref: str, problems: list) -> Workspace | None:
    """`ws` reading the project spec at `ref` (a pull request's project changes count)."""
    if ws.git.rev(ref) is None:
        problems.append(
            EvoError(f"no such ref {ref!r}", field="--ref", hint="a branch, tag or commit")
        )
        return None
    raw = ws.git.read(ref, PROJECT_FILE)
    project = safe_yaml(raw)
    at_ref = copy.copy(ws)
    at_ref.__dict__["project"] = project if isinstance(project, dict) else {}
    return at_ref


def _source(ref: str | None, path: str) -> str:
    return f"{ref}:{path}" if ref else path


def _library_read(ws: Workspace, ref: str | None, path: str) -> bytes | None:
    if ref is None:
        file = ws.root / path
        return file.read_bytes() if file.is_file() else None
    return ws.git.read(ref, path)


def _library_files(ws: Workspace, ref: str | None, folder: str) -> dict[str, bytes]:
    if ref is None:
        return {
            f"{folder}/{path.name}": path.read_bytes()
            for path in sorted((ws.root / folder).glob("*.yaml"))
            if path.is_file()
        }
    if ws.git.rev(ref) is None:
        return {}
    listing = ws.git.repo.git.ls_tree("--name-only", ref, folder + "/").splitlines()
    paths = [p for p in listing if p.endswith(".yaml")]
    blobs = ws.git.read_many((ref, p) for p in paths)
    return {p: blob for (_, p), blob in blobs.items() if blob is not None}


def _unique(problems: list[EvoError]) -> list[EvoError]:
    seen: set[str] = set()
    out = []
    for problem in problems:
        if str(problem) not in seen:
            seen.add(str(problem))
            out.append(problem)
    return out


def _check_recipes(
    ws: Workspace, docs: dict, states: dict, result: Validation, backends: dict
) -> None:
    """Each version's resolved recipe through its backend's own checks (group size, clip
    range, domain, checkpoint path, verl keys...), reported at the version that sets it."""
    with declared_data_roots(ws):
        _check_each_recipe(ws, docs, states, result, backends)


def _check_each_recipe(
    ws: Workspace, docs: dict, states: dict, result: Validation, backends: dict
) -> None:
    project_problem = _project_recipe_problem(ws, backends, result)
    # Parents first, so a version whose lineage has no resolved recipe (it, or an ancestor,
    # invalid or missing) is known from its parent's verdict: one look a version.
    broken: dict[str, bool] = {}
    for name in tree_order(states):
        parent = states[name].parent
        doc = docs.get(name)
        broken[name] = (doc is None or bool(result.versions.get(name))
                        or parent is not None and broken.get(parent, True))
        if broken[name]:
            continue  # a broken lineage has no resolved recipe
        try:
            recipe = ws.resolved_recipe(name, states, shared=True)
            problem = result.recipe_problem(recipe, backends.get(recipe.get("backend", "local")))
            if problem is not None:
                raise located_in_spec(problem, doc)
        except EvoError as err:
            if project_problem is None or (err.field, err.message.split(" (inherited")[0]) != (
                f"recipe.{project_problem.field}" if project_problem.field else None,
                project_problem.message,
            ):
                result.versions[name].append(err)
            else:  # the project's own problem, located there: `validate` shows it once
                result.versions[name].append(project_problem)
            broken[name] = True


def _project_recipe_problem(
    ws: Workspace, backends: dict, result: Validation
) -> EvoError | None:
    """The backend's checks of the project recipe alone (every version inherits it), located
    in the project file; a version without overrides resolves to the same recipe, whose
    verdict `result` keeps."""
    from evotrainer.store.recipe import resolve

    try:
        recipe = resolve(ws.project.get("recipe") or {}, [])
    except EvoError as err:
        problem: EvoError | None = err
    else:
        problem = result.recipe_problem(recipe, backends.get(recipe.get("backend", "local")))
    if problem is None:
        return None
    return EvoError(problem.message, where=PROJECT_FILE, field=problem.field, hint=problem.hint)


def _check_bytes(
    raw: bytes | None, path: str, kind: str, problems: list, source: str
) -> specs.Document | None:
    if raw is None:
        problems.append(EvoError("file not found", where=source))
        return None
    try:
        doc = specs.parse(raw, source)
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


def _version_document(
    state: VersionState, problems: list, checked: Path
) -> tuple[specs.Document | None, bool]:
    """The version's spec document, and whether these bytes were found valid before (read
    from `checked`); (None, False) after appending why there is none (no spec, or one that
    does not parse). A document not found valid before is still to be checked."""
    if state.spec_raw is None:
        problems.append(
            EvoError(
                f"branch {branch_name(state.name)} has no spec/versions/{state.name}.yaml",
                where=branch_name(state.name),
                hint="the spec file must be named after the branch; commit it, or rename "
                "the branch",
            )
        )
        return None, False
    # What reading the branch found: the bytes checked valid before, or parsed (neither is
    # looked up or parsed again); a state made from other bytes (the working tree's) is.
    doc = state.checked if state.checked and state.checked.raw == state.spec_raw else None
    parsed = state.parsed if state.parsed and state.parsed.raw == state.spec_raw else None
    if doc is None and parsed is None:
        doc = specs.cached_valid(state.spec_raw, state.spec_source, "PolicyVersion", checked)
    if doc is not None:
        return doc, True
    try:
        return parsed or specs.parse(state.spec_raw, state.spec_source), False
    except EvoError as err:
        problems.append(err)
        return None, False


def _into_cycles(docs: dict[str, specs.Document]) -> set[str]:
    """The versions whose parent links (through valid specs) run into a cycle, found in one
    walk over all of them: each version is walked once, its verdict kept for those below."""
    verdict: dict[str, bool] = {}  # name → its links run into a cycle
    for start in docs:
        path: list[str] = []
        current, cycles = start, False
        while current is not None and current in docs:
            if current in verdict:
                cycles = verdict[current]
                break
            if current in path:
                cycles = True
                break
            path.append(current)
            current = docs[current].data.get("parent")
        for name in path:
            verdict[name] = cycles
    return {name for name, cycles in verdict.items() if cycles}


def _check_parent(
    name: str, doc: specs.Document, in_cycle: bool, states: dict, problems: list
) -> None:
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
    if in_cycle:
        problems.append(
            EvoError(
                f"parent cycle: {name}'s parent links ({name} → {parent} → …) never reach "
                "a root",
                where=doc.where(("parent",)),
                field="parent",
                hint="point `parent` at an older version so lineage is a tree",
            )
        )


def _check_harness_ref(doc: specs.Document, path: tuple, harnesses: set, problems: list) -> None:
    value = doc.data.get(path[0])
    if value is not None and value not in harnesses:
        problems.append(
            EvoError(
                f"unknown harness revision {value!r}",
                where=doc.where(path),
                field=".".join(path),
                hint="known revisions in harness_revisions/: "
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


def job_env(ws: Workspace) -> dict[str, str]:
    """What a job's process is told: the project's declared data roots (the only folders
    outside its worktree a dataset may resolve into)."""
    from evotrainer.domains.data import DATA_ROOTS_ENV

    return {DATA_ROOTS_ENV: os.pathsep.join(str(root) for root in allowed_roots(ws)[1:])}


@contextmanager
def declared_data_roots(ws: Workspace) -> Iterator[None]:
    """The backend's recipe checks, run here, see the data roots a job would be given."""
    env = job_env(ws)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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


def check_spec_recipe(recipe: dict, doc: specs.Document, backend=None) -> None:
    """The backend's own checks of a resolved recipe (by `backend`, default the recipe's
    backend by name), located in the version spec."""
    problem = recipe_problem(recipe, backend)
    if problem is not None:
        raise located_in_spec(problem, doc)


def recipe_problem(recipe: dict, backend=None) -> EvoError | None:
    """The first problem the backend's checks find in a resolved recipe, or None."""
    from evotrainer.backends import get_backend

    try:
        (backend or get_backend(recipe.get("backend", "local"))).check(recipe)
    except EvoError as err:
        return err
    return None


def located_in_spec(err: EvoError, doc: specs.Document) -> EvoError:
    """A recipe problem at the version spec's field that sets it, or said to be inherited."""
    field = tuple(err.field.split(".")) if err.field else ()
    inherited = bool(field) and ("recipe", *field) not in doc.marks
    return EvoError(
        err.message + (" (inherited: set in the project or an ancestor)" if inherited else ""),
        where=doc.where(("recipe", *field)),
        field=f"recipe.{err.field}" if err.field else None,
        hint=err.hint,
    )
