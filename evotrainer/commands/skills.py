"""`evotrainer skills list|show|search|match|retrieve|propose|share`: the skill library, what
fires for a version, what the project's memory holds, and new knowledge proposed for review."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from evotrainer.agent.retrieval import Query, query_for, retrieve
from evotrainer.agent.skill_creation import propose_skill
from evotrainer.errors import EvoError
from evotrainer.skills.library import match_version, share_evidence, workspace_library
from evotrainer.skills.skill import Match, Skill, get_skill, search, version_domain
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
    skills_app = typer.Typer(help="The skill library: list, show, search, match, retrieve, "
                             "propose, share.",
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

    @skills_app.command("retrieve")
    def retrieve_(
        text: str = typer.Argument("", help="Words to look for, e.g. 'dead groups'."),
        alert: list[str] = typer.Option([], "--alert", help="A fired alert name (repeat)."),
        metric: list[str] = typer.Option([], "--metric", help="A metric name (repeat)."),
        version: str = typer.Option(None, "--version", help="Ask what VERSION's diagnosis "
                                    "asks: its alerts and domain."),
        domain: str = typer.Option(None, "--domain", help="The asking domain (ranks first)."),
        workspace: list[Path] = typer.Option([], "--workspace", help="Another workspace to "
                                             "read (repeat; besides skill_library.workspaces)."),
        limit: int = typer.Option(10, "--limit", min=1, help="Show at most this many."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """What the project's memory holds on a question: recorded decisions of this and the
        listed workspaces, recurring alert patterns, skills and their cited evidence
        (workspace and shared library), each with where it came from."""
        ws = Workspace.find()
        alerts, metrics = tuple(alert), tuple(metric)
        if version:
            state = ws.version(version)
            asked = query_for(state.records.get("diagnosis"),
                              version_domain(ws, version))
            alerts, metrics = alerts + asked.alerts, metrics + asked.metrics
            domain = domain or asked.domain
        query = Query(text=text, alerts=alerts, metrics=metrics, domain=domain)
        if not (text or alerts or metrics):
            raise EvoError("nothing to look for", field="TEXT",
                           hint="give words, --alert, --metric or --version")
        found = retrieve(ws, query, limit, workspaces=tuple(str(p) for p in workspace))
        if as_json:
            print(json.dumps([r.as_dict() for r in found], indent=2, default=str))
            return
        if not found:
            console().print("nothing recorded matches")
            return
        table = Table(title="retrieved")
        for column in ("score", "kind", "domain", "what", "from"):
            table.add_column(column, overflow="fold")
        # Records of other workspaces and libraries are anyone's text: all through safe().
        for r in found:
            table.add_row(f"{r.score:.2f}", r.kind, safe(r.domain or ", ".join(r.domains)),
                          safe(r.text if r.kind == "case" else r.title), safe(r.cite()))
        console().print(table)

    @skills_app.command("propose")
    def propose_(
        version: str = typer.Argument(..., help="A promoted version that applied no skill."),
        name: str = typer.Option(None, "--name", help="The new skill's name."),
        category: str = typer.Option(None, "--category", help="Its category (default: "
                                     "from the recipe section it changes)."),
        trigger: str = typer.Option(None, "--trigger", help="CEL over a diagnosis (default: "
                                    "the parent's alerts the version removed)."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """Turn VERSION's promoted intervention into a new skill (trigger from the alerts
        that motivated it, patch from its recipe diff, evidence from its gate), committed
        on the branch skill/NAME for review: merge it into main to adopt it."""
        result = propose_skill(Workspace.find(), version, name=name, category=category,
                               trigger=trigger)
        if as_json:
            print(json.dumps(result, indent=2, default=str))
            return
        branch = safe(result["branch"])
        console().print(f"Proposed skill {safe(result['name'])} on {branch} "
                        f"({result['commit'][:12]}). Review: git diff main...{branch}; "
                        f"adopt: git merge {branch}")

    @skills_app.command("share")
    def share_(as_json: bool = typer.Option(False, "--json", help="Machine-readable.")) -> None:
        """Propose the gate evidence this workspace recorded on its skills (and the skills
        it created) back to the shared library (`skill_library.repo`): one commit on the
        library's branch evidence/PROJECT, never on its reviewed branch."""
        result = share_evidence(Workspace.find())
        if as_json:
            print(json.dumps(result, indent=2))
            return
        if result is None:
            console().print("the library already holds this workspace's evidence")
            return
        state = "proposed" if result["new"] else "already proposed"
        console().print(f"{state} on the library's {safe(result['branch'])} "
                        f"({result['commit'][:12]}): {safe(', '.join(result['skills']))}. "
                        "A library reviewer merges it to share it.")
