"""`evotrainer pr open|sync|body|harness-summary`: pull requests as the review surface."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from evotrainer.control.github_client import GitHubRepo
from evotrainer.control.pull_requests import (
    HARNESS_MARKER,
    harness_summary,
    intervention_body,
    open_pull_request,
    sync,
)
from evotrainer.errors import EvoError
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console, safe

NO_GITHUB_HINT = ("set GITHUB_TOKEN and GITHUB_REPOSITORY (GitHub Actions sets both); without "
                  "GitHub, review with `evotrainer pr body V` or `git diff` and approve with "
                  "`evotrainer approve V`")


def github(repo: str | None) -> GitHubRepo:
    found = GitHubRepo.from_env(repo)
    if found is None:
        raise EvoError("no GITHUB_TOKEN in the environment", field="GITHUB_TOKEN",
                       hint=NO_GITHUB_HINT)
    return found


def event_pull_number() -> int | None:
    """The PR number of the GitHub Actions event being handled, if any."""
    path = os.environ.get("GITHUB_EVENT_PATH")
    if not path or not Path(path).is_file():
        return None
    event = json.loads(Path(path).read_text())
    number = (event.get("pull_request") or {}).get("number")
    return number if isinstance(number, int) else None


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Pull requests: a version's PR follows its lifecycle; a "
                        "harness PR shows its backtest.", no_args_is_help=True)
    app.add_typer(group, name="pr")
    repo_option = typer.Option(None, "--repo", help="OWNER/NAME (default: GITHUB_REPOSITORY).")

    @group.command("open")
    def open_(
        name: str = typer.Argument(..., help="Version whose branch evo/NAME to propose."),
        base: str = typer.Option("main", "--base", help="Branch the PR targets."),
        remote: str = typer.Option("origin", "--remote", help="Remote to push evo/NAME to."),
        repo: str = repo_option,
    ) -> None:
        """Push evo/NAME and open its PR with the intervention as the body (rationale,
        hypothesis, criterion, the spec's diff, what triggered it). An open PR is updated."""
        pull = open_pull_request(Workspace.find(), github(repo), name, base, remote)
        console().print(f"PR #{pull.number} {safe(pull.html_url or '')}: evo/{safe(name)} → "
                        f"{safe(base)}. An approving review on its head is the approval.")

    @group.command("body")
    def body(name: str = typer.Argument(..., help="Version.")) -> None:
        """Print the PR body of a version (markdown), no GitHub needed."""
        print(intervention_body(Workspace.find(), name), end="")

    @group.command("sync")
    def sync_(
        base: str = typer.Option("main", "--base", help="The promoted lineage's branch."),
        remote: str = typer.Option("origin", "--remote", help="Remote to push records to."),
        push: bool = typer.Option(True, "--push/--no-push",
                                  help="Push evo/*, BASE and pruned/* tags (atomically)."),
        repo: str = repo_option,
    ) -> None:
        """Run in CI after `reconcile`: approving reviews on the current head become approval
        commits naming the reviewer; pushing the promoted BASE shows its PR merged; a pruned
        version's PR is closed with the decision (branch and tag kept); each PR's status
        comment is edited in place."""
        out = console()
        report = sync(Workspace.find(), github(repo), base, remote if push else None,
                      log=lambda line: out.print(safe(line)))
        for name, why in sorted(report.waiting.items()):
            out.print(f"{safe(name)}: {safe(why)}")
        out.print(f"approved {len(report.approved)}, merged {len(report.merged)}, closed "
                  f"{len(report.closed)}, status updated {len(report.status_updated)}")

    @group.command("harness-summary")
    def harness_summary_(
        base: str = typer.Option(None, "--base", help="Ref the PR is compared with (default: "
                                 "origin/$GITHUB_BASE_REF, else main)."),
        pull: int = typer.Option(None, "--pr", help="PR to comment on (default: the "
                                 "Actions event's)."),
        summary: Path = typer.Option(None, "--summary", help="Markdown file to append to "
                                     "(default: $GITHUB_STEP_SUMMARY, else stdout)."),
        repo: str = repo_option,
    ) -> None:
        """Backtest the harness revisions this checkout adds or switches to against the
        base's revision in force: the alerts and verdicts that flip, and the cases, to the
        job summary and (with GITHUB_TOKEN) one PR comment. Exit 1 when a case fails."""
        ws = Workspace.find()
        base_ref = base or (f"origin/{os.environ['GITHUB_BASE_REF']}"
                            if os.environ.get("GITHUB_BASE_REF") else "main")
        text, passed = harness_summary(ws, base_ref)
        target = summary or (Path(os.environ["GITHUB_STEP_SUMMARY"])
                             if os.environ.get("GITHUB_STEP_SUMMARY") else None)
        if target is None:
            print(text, end="")
        else:
            with target.open("a") as stream:
                stream.write(text + "\n")
        number = pull or event_pull_number()
        gh = GitHubRepo.from_env(repo)
        if gh is not None and number is not None:
            gh.upsert_comment(gh.pull(number), HARNESS_MARKER, text)
        if not passed:
            raise typer.Exit(1)
