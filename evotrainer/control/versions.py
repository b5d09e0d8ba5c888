"""Creating and approving version specs: each one a commit on its own branch."""

from __future__ import annotations

import contextlib
from typing import Any

from evotrainer import API_VERSION
from evotrainer.control.validation import (
    check_criterion,
    check_spec_recipe,
    check_workspace,
    declared_data_roots,
)
from evotrainer.errors import EvoError
from evotrainer.skills.library import workspace_library
from evotrainer.skills.skill import skill_overrides
from evotrainer.store import specs
from evotrainer.store.clock import now_iso
from evotrainer.store.git import branch_name
from evotrainer.store.recipe import deep_merge, set_dotted
from evotrainer.store.workspace import Workspace, version_spec_path


def parse_assignment(text: str) -> tuple[str, Any]:
    """`grpo.lr=3e-4` → ("grpo.lr", 0.0003); the value is read as a YAML scalar."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise EvoError(
            f"--set {text!r} is not KEY=VALUE", field="--set", hint="e.g. --set grpo.lr=3e-4"
        )
    value = specs.load_yaml(raw, f"--set {key}")
    if isinstance(value, str):
        # YAML 1.1 reads `3e-4` as a string; every RL engineer means the number.
        with contextlib.suppress(ValueError):
            value = float(value)
    return key.strip(), value


def spec_text(spec: dict) -> str:
    path = version_spec_path(spec["name"])
    return specs.schema_modeline(path, "PolicyVersion") + specs.dump(spec)


def new_version(
    ws: Workspace,
    name: str,
    parent: str,
    *,
    rationale: str,
    skills: list[str] = (),
    bindings: dict[str, dict[str, Any]] | None = None,
    settings: list[str] = (),
    hypothesis: str | None = None,
    criterion: str | None = None,
    proposal: dict | None = None,
) -> dict:
    """Write `spec/versions/<name>.yaml` on a new branch forked from the parent's tip.
    `bindings` ({skill: {variable: value}}) binds the skills whose mechanism names what their
    trigger bound (Skill.bind); the spec records them under `intervention.bindings`."""
    bindings = {s: dict(b) for s, b in (bindings or {}).items() if b}
    states = ws.versions()
    if name in states:
        raise EvoError(
            f"version {name!r} already exists",
            field="NAME",
            hint="pick a new name; versions are never overwritten",
        )
    ws.version(parent, states)  # the parent must exist and have a readable spec
    # The library the planners read: the workspace's skills with the shared library's.
    library = workspace_library(ws) if skills else {}
    for skill in skills:
        if skill not in library:
            raise EvoError(
                f"unknown skill {skill!r}",
                field="--skill",
                hint=f"known skills: {', '.join(library) or 'none'}",
            )
    # A skill's patch is relative (x2, at most a ceiling): resolved against the parent's
    # recipe into the concrete values this spec records.
    for skill in bindings:
        if skill not in skills:
            raise EvoError(f"bindings for {skill!r}, which the version does not apply",
                           field="bindings", hint=f"skills applied: {', '.join(skills)}")
    bound = [library[s].bound(bindings[s]) if s in bindings else library[s] for s in skills]
    overrides = skill_overrides(bound, ws.resolved_recipe(parent, states))
    for setting in settings:
        key, value = parse_assignment(setting)
        set_dotted(overrides, key, value)
    intervention: dict = {
        "skills": list(skills),
        **({"bindings": bindings} if bindings else {}),
        "factors": len(skills) + len(settings),
        "rationale": rationale,
    }
    if hypothesis or criterion:
        intervention["hypothesis"] = {
            k: v for k, v in (("statement", hypothesis), ("criterion", criterion)) if v
        }
    spec = {
        "apiVersion": API_VERSION,
        "kind": "PolicyVersion",
        "name": name,
        "parent": parent,
        "intervention": intervention,
        "recipe": overrides,
        "approval": {"approved": False},
    }
    if proposal:
        spec["proposal"] = proposal
    text = spec_text(spec)
    source = f"{branch_name(name)}:{version_spec_path(name)}"
    doc = specs.load_text(text, source, "PolicyVersion")  # a bad --set fails here, unwritten
    check_criterion(ws, doc)  # its names against the harness in force, as validate does
    with declared_data_roots(ws):
        check_spec_recipe(deep_merge(ws.resolved_recipe(parent, states), overrides), doc)
    ws.git.commit_files(
        branch_name(name),
        {version_spec_path(name): text.encode()},
        f"Propose {name} from {parent}: {rationale}",
        {"Action": "propose", "Version": name, "Parent": parent},
        start=branch_name(parent),
    )
    return spec


def _refusal(ws: Workspace, name: str, states: dict) -> str | None:
    """Why `name` must not be approved: what plan and reconcile would refuse it for, except
    a digest-less approval block (the very thing approving replaces)."""
    validation = check_workspace(ws, states)
    if validation.workspace:
        return str(validation.workspace[0])
    own = validation.versions.get(name, [])
    validation.versions[name] = [p for p in own if p.field != "approval"]
    return validation.refusal(name, states)


def approve(ws: Workspace, name: str, by: str | None = None) -> dict:
    """Commit the approval of `name` as it is now: the approval records the digest of the
    spec, of the recipe it resolves to and of the rest of the branch's tree, so any later
    change makes it stale, and the controller's seal. A version whose approval still holds
    is left as it is."""
    states = ws.versions()
    state = ws.version(name, states)
    if ws.approval_status(state, states) == "approved":
        return state.spec  # nothing new to approve
    refused = _refusal(ws, name, states)
    if refused:
        raise EvoError(
            f"{name} cannot be approved: {refused}",
            hint="fix it (`evotrainer validate` lists every problem), then approve again",
        )
    approval_digest = ws.approval_digest(name, states)  # raises for a broken lineage
    spec = dict(state.spec)
    spec["approval"] = {
        "approved": True,
        "by": by or ws.git.user(),
        "at": now_iso(),
        "digest": approval_digest,
    }
    # Sealed with the controller's key: an approval block an author commits by hand, with
    # the same (public) digest, is not an approval.
    ws.commit_records(
        name,
        {version_spec_path(name): spec_text(spec).encode()},
        f"Approve {name}",
        {"Action": "approve", "Version": name, "Digest": approval_digest},
        approval=spec["approval"],
        sign=ws.allowed_signers is not None,
    )
    return spec
