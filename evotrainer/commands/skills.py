"""`evotrainer skills list|show|search|match`: the skill library and what fires for a version."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from evotrainer.diagnosis.skills import (
    Match,
    Skill,
    get_skill,
    match_version,
    search,
    workspace_library,
)
from evotrainer.errors import EvoError
from evotrainer.store.specs import dump
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import clean, console, safe


def _library() -> dict[str, Skill]:
    """The workspace's library when run inside one, the built-in library otherwise."""
    try:
        ws = Workspace.find()
    except EvoError:
        ws = None
    return workspace_library(ws)


def _summary(skill: Skill) -> dict:
    return {"name": skill.name, "title": skill.title, "category": skill.category,
            "domains": skill.domains, "negative": skill.negative,
            "evidence": len(skill.evidence), "negative_evidence": len(skill.negative_evidence)}


def _skills_table(rows: list[tuple[Skill, str | None]], extra: str | None = None) -> Table:
    table = Table()
    for column in ("name", "category", "title", "domains", "evidence +/−"):
        table.add_column(column)
    if extra:
        table.add_column(extra, justify="right")
    # Skills are files anyone can propose: every field through safe().
    for skill, value in rows:
        name = f"[red]{safe(skill.name)}[/] (known to hurt)" if skill.negative else safe(skill.name)
        cells = [name, safe(skill.category), safe(skill.title), safe(", ".join(skill.domains)),
                 f"{len(skill.evidence)}/{len(skill.negative_evidence)}"]
        table.add_row(*cells, *([value] if extra else []))
    return table


def _values(m: Match) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in m.values.items() if k not in ("trend",))


def _change(m: Match) -> str:
    """What the skill's patch sets on the recipe (concrete values), or why it sets nothing."""
    if m.no_change:
        return f"none: {m.no_change}"
    return ", ".join(str(c) for c in m.resolution.changes) if m.resolution else ""


def register(app: typer.Typer) -> None:
    skills_app = typer.Typer(help="The skill library: list, show, search, match.",
                             no_args_is_help=True)
    app.add_typer(skills_app, name="skills")

    @skills_app.command("list")
    def list_(
        category: str = typer.Option(None, "--category", help="Only this category."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """Every skill: category, domains and how much evidence it has (for/against)."""
        skills = [s for s in _library().values() if category in (None, s.category)]
        if as_json:
            print(json.dumps([_summary(s) for s in skills], indent=2))
            return
        console().print(_skills_table([(s, None) for s in skills]))

    @skills_app.command("show")
    def show(
        name: str = typer.Argument(..., help="Skill name."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """One skill in full: trigger, mechanism, criterion, evidence."""
        skill = get_skill(_library(), name)
        if as_json:
            print(json.dumps(skill.data, indent=2))
        else:  # YAML as written, without control bytes that would drive the terminal
            print(clean(dump(skill.data)), end="")

    @skills_app.command("search")
    def search_(
        text: str = typer.Argument(..., help="Words to look for, e.g. 'dead groups'."),
        limit: int = typer.Option(10, "--limit", min=1, help="Show at most this many."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """Skills ranked by text relevance (name, title, description, trigger, domains)."""
        ranked = search(_library(), text)[:limit]
        if as_json:
            print(json.dumps([{**_summary(s), "score": round(score, 4)} for s, score in ranked],
                             indent=2))
            return
        if not ranked:
            console().print(f"no skill mentions {safe(repr(text))}")
            return
        console().print(_skills_table([(s, f"{score:.2f}") for s, score in ranked], "score"))

    @skills_app.command("match")
    def match_(
        version: str = typer.Argument(..., help="A diagnosed version."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """Skills whose trigger fires on VERSION's diagnosis, best evidence first. Known-harmful
        skills never match; they are listed as refused."""
        matches, refused = match_version(Workspace.find(), version)
        if as_json:
            print(json.dumps({"matches": [m.as_dict() for m in matches],
                              "refused": [m.as_dict() for m in refused]}, indent=2))
            return
        out = console()
        if not matches:
            out.print(f"no skill's trigger fires on {safe(version)}'s diagnosis")
        else:
            table = Table(title=f"skills matching {safe(version)}")
            for column in ("name", "category", "fired on", "evidence (domain/all/against)",
                           "mean Δ", f"change on {safe(version)}'s recipe"):
                table.add_column(column)
            for m in matches:
                delta = "" if m.mean_delta is None else f"{m.mean_delta:+.4f}"
                table.add_row(safe(m.skill.name), safe(m.skill.category), safe(_values(m)),
                              f"{m.in_domain}/{m.support}/{m.against}", delta,
                              safe(_change(m)))
            out.print(table)
        for m in refused:
            why = "; ".join(e.get("note") or e["version"] for e in m.skill.negative_evidence)
            out.print(f"[red]refused[/] {safe(m.skill.name)}: known to hurt ({safe(why)})")
