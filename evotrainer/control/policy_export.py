"""`evotrainer export V --to DIR`: a version's trained policy as a plain Hugging Face directory.

The recorded checkpoint (weights, config, tokenizer, chat template) is copied as is, checked
against its recorded digest both before and after the copy, with a model card (README.md)
that says what it is: the version, its lineage, the recipe digest, and the gate's verdict,
Δ and CI against its parent. The directory appears only once complete (written beside it,
then renamed), and an existing non-empty directory is never written into.

The card quotes spec text (the rationale, the project name) that an author or a planner
wrote: it goes in as literal Markdown text, capped, so nothing in it becomes HTML, a link or
front matter on a model hub's page.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from evotrainer.contract.model_start import base_model
from evotrainer.errors import EvoError
from evotrainer.stats import confidence_label
from evotrainer.store.checkpoints import (
    directory_digest,
    init_mode,
    is_dropped,
    recorded_policy,
    verify_directory,
)
from evotrainer.store.workspace import VersionState, Workspace

CARD = "README.md"
# The most characters of spec text one card field quotes; the rest is cut with a pointer to
# the spec (a card is a summary, and a hub renders it on the model's front page).
MAX_QUOTED_CHARS = 2_000


def export_policy(
    ws: Workspace, name: str, target: Path, states: dict[str, VersionState] | None = None
) -> Path:
    """Write `name`'s recorded policy and its model card to `target`; return it."""
    states = states if states is not None else ws.versions()
    state = ws.version(name, states)
    run = state.run
    if run is None or not run.succeeded:
        raise EvoError(f"{name} has no finished run, so no trained policy",
                       where=state.spec_source, hint="export a version `evotrainer lineage` "
                       "shows as trained")
    source, artifact = recorded_policy(ws, name, state.records["run"])
    if is_dropped(artifact):
        dropped = artifact["dropped"]
        raise EvoError(
            f"the policy of {name} was dropped by the retention policy on {dropped.get('at')} "
            f"({dropped.get('reason')}); its rollouts and records remain",
            hint=f"retrain it (re-approve {name}) to get its weights back",
        )
    verify_directory(source, artifact, name)
    target = target.resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise EvoError(f"{target} exists and is not an empty directory", field="--to",
                       hint="export into a new directory")
    partial = target.with_name(f".{target.name}.partial")
    _remove_leftover(partial)
    shutil.copytree(source, partial, symlinks=True)
    _readable_like_the_rest(partial)
    # What was copied is what was recorded (the source could change while it was read).
    if directory_digest(partial)[0] != artifact["digest"]:
        shutil.rmtree(partial)
        raise EvoError(f"the policy of {name} changed while it was exported", where=str(source),
                       hint="export again once nothing writes to the artifact folder")
    (partial / CARD).write_text(model_card(ws, state, states, artifact))
    if target.exists():
        target.rmdir()  # empty, checked above
    partial.rename(target)
    return target


def _remove_leftover(partial: Path) -> None:
    """Clear what an interrupted export left at the staging path: its folder, or whatever
    else sits there (a file, a link: removed, never followed)."""
    if partial.is_symlink() or (partial.exists() and not partial.is_dir()):
        partial.unlink()
    elif partial.exists():
        shutil.rmtree(partial)


def _readable_like_the_rest(folder: Path) -> None:
    """Give every copied file and folder the modes the user's umask gives new files:
    safetensors writes its weights 0600, which left model.safetensors private in an export
    that is otherwise 0644 (copytree keeps modes)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def model_card(
    ws: Workspace, state: VersionState, states: dict[str, VersionState], artifact: dict
) -> str:
    run, decision = state.run, state.decision
    comparison = (decision.comparison if decision else None) or {}
    recipe = ws.resolved_recipe(state.name, states)
    model = recipe.get("model") or {}
    start = base_model(model)
    base = start.source if start.kind != "tiny" else "a tiny model built from model.tiny"
    lineage = " → ".join(s.name for s in ws.chain(state.name, states))
    result = run.result if run else {}
    project = quoted(ws.project.get("name", "evotrainer"), state.name)
    lines = [
        f"# {project} {state.name}",
        "",
        f"A policy trained with EvoTrainer: version `{state.name}` of project "
        f"{project}, domain {quoted(recipe['domain']['name'], state.name)}.",
        "",
        "| | |",
        "|---|---|",
        f"| version | `{state.name}` |",
        f"| lineage | {lineage} |",
        f"| base model | {quoted(base, state.name)} |",
        f"| started from | {_start(state, recipe)} |",
        f"| recipe digest | `{(run.recipe_digest if run else None) or ''}` |",
        f"| training steps (this version) | {result.get('steps_done', recipe['grpo']['steps'])} |",
        f"| seeds | {', '.join(str(s) for s in result.get('seeds') or recipe.get('seeds') or [])} "
        "(these weights: the first) |",
        f"| val avg@{result.get('eval_k', '?')} | {_number(result.get('val_avg'), '.4f')} |",
        f"| verdict | {decision.verdict if decision else 'not gated yet'} |",
        f"| Δ vs parent | {_number(comparison.get('delta'), '+.4f')} |",
        f"| {confidence_label(comparison)} of Δ | {_ci(comparison)} |",
        f"| weights digest | `{artifact['digest']}` |",
        "",
    ]
    if decision and decision.reason:
        lines += [f"Gate: {quoted(decision.reason, state.name)}", ""]
    intervention = (state.spec or {}).get("intervention") or {}
    if intervention.get("rationale"):
        lines += [f"Intervention: {quoted(intervention['rationale'], state.name)}", ""]
    return "\n".join(lines)


def quoted(text: object, version: str) -> str:
    """Spec text as one line of literal Markdown, at most MAX_QUOTED_CHARS of it."""
    from evotrainer.control.pull_requests import md_text  # the PR body's escaping

    text = " ".join(str(text).split())
    if len(text) <= MAX_QUOTED_CHARS:
        return md_text(text)
    return (md_text(text[:MAX_QUOTED_CHARS]) + " … (cut: the full text is in "
            f"spec/versions/{version}.yaml on evo/{version})")


def _start(state: VersionState, recipe: dict) -> str:
    if init_mode(recipe) == "parent" and state.parent:
        return f"the trained policy of `{state.parent}` (model.init: parent)"
    return "the base model (model.init: base)"


def _number(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "—"


def _ci(comparison: dict) -> str:
    if "ci_low" not in comparison:
        return "—"
    return f"[{comparison['ci_low']:.4f}, {comparison['ci_high']:.4f}]"
