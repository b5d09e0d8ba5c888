"""The pull request as the review surface of a version's lifecycle, level-triggered.

A version's PR is `evo/<v> → main`, its body the intervention. `sync` (run in CI after
`reconcile`) re-derives everything from git and GitHub on each pass, like reconcile:

- an approving review by a reviewer main lists (`reviewers:` in spec/project.yaml on
  main; never the PR's author) on the branch's current tip becomes the approval commit
  (`control.versions.approve`, which binds the digest of exactly that content) naming the
  reviewer; a later push makes it stale;
- promotion is reconcile's merge of `evo/<v>` into main. Pushing main makes GitHub mark
  the PR merged (its head commit is in the base branch). The merge API is not used: it
  would write a second, different merge commit on GitHub's main and the next push of the
  promoted lineage would be rejected;
- a pruned version's PR is closed with the decision as a comment; its branch and its
  `pruned/<v>` tag stay as negative evidence;
- one status comment per PR (approval, run, diagnosis, verdict) is edited in place.

Without GitHub nothing here is needed: `git diff`, `evotrainer approve` and reconcile's
merge are the same story by hand.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import git

from evotrainer.control.github_client import GitHubRepo
from evotrainer.control.versions import approve
from evotrainer.diagnosis.harness import HarnessRevision, parse_harness_text, resolve_harness
from evotrainer.errors import EvoError
from evotrainer.gate.harness_backtest import backtest_harness
from evotrainer.store.builtin import HARNESS_FOLDER, harness_file
from evotrainer.store.git import BRANCH_PREFIX, DIFF_SAFETY, PRUNED_TAG_PREFIX, branch_name
from evotrainer.store.specs import load_yaml
from evotrainer.store.workspace import (
    PROJECT_FILE,
    VersionState,
    Workspace,
    version_spec_path,
)

STATUS_MARKER = "<!-- evotrainer:status -->"
DECISION_MARKER = "<!-- evotrainer:decision -->"
HARNESS_MARKER = "<!-- evotrainer:harness-backtest -->"
# Whose review is an approval: only the logins main's project spec lists under `reviewers:`.
# GitHub's author association is no answer: pushing an `evo/*` branch already makes a person
# a COLLABORATOR, and MEMBER is anyone in the organisation.
REVIEWERS_FIELD = "reviewers"
# GitHub refuses a PR body or comment over 65,536 characters.
MAX_DIFF_CHARS = 50_000


# ---- markdown --------------------------------------------------------------------------------

_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|#!~])")
# `@name` and `@org/team` notify people; a word joiner after the `@` keeps the text and
# drops the notification.
_MENTION = re.compile(r"@(?=[A-Za-z0-9])")
# One spec field in a PR body or comment (a rationale may be any length).
MAX_FIELD_CHARS = 4_000
# GitHub refuses a body or comment over 65,536 characters; the body stays well under it.
MAX_BODY_CHARS = 60_000


def md_text(value: object) -> str:
    """Spec text (a planner may have written it) as literal markdown: no links, no HTML,
    no mention, no forged evotrainer marker, one line of bounded length."""
    text = " ".join(str(value).split())
    if len(text) > MAX_FIELD_CHARS:
        text = text[:MAX_FIELD_CHARS] + f" … ({len(text) - MAX_FIELD_CHARS} more characters)"
    return _MENTION.sub("@\u2060", _MARKDOWN_SPECIAL.sub(r"\\\1", text))


def md_code(text: str, language: str = "") -> str:
    """A fenced block no backtick run inside `text` can close."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def _number(value: Any) -> str:
    return f"{value:+.4f}" if isinstance(value, float) else md_text(value)


# ---- the intervention ------------------------------------------------------------------------


def spec_diff(ws: Workspace, state: VersionState,
              states: dict[str, VersionState] | None = None) -> str:
    """`git diff main...evo/<v>`: everything merging the branch into main would bring (the
    project, workflows, code, files pushed onto a parent after it ran — not only the
    spec), less the records the controller wrote and sealed (`Workspace.merge_changes`)."""
    states = states if states is not None else ws.versions()
    target = branch_name(state.name)
    kept = [f":!{path}" for path in sorted(ws.sealed_record_paths(state, states))]
    if ws.git.rev("refs/heads/main") is None:
        return ws.git.repo.git.show(*DIFF_SAFETY, "--format=", "--patch", target, "--", ".",
                                    *kept)
    return ws.git.repo.git.diff(*DIFF_SAFETY, f"main...{target}", "--", ".", *kept)


def merge_files_lines(changes: list[tuple[str, str]], name: str) -> list[str]:
    """The files list of the body: every path the merge brings into main, the version's own
    spec apart from the rest (which a reviewer must see: workflows, code, parents' pushes)."""
    own = version_spec_path(name)
    others = [(s, p) for s, p in changes if p != own]
    lines = [f"Merging `{branch_name(md_text(name))}` brings {len(changes)} file(s) into "
             f"`main`" + (f", {len(others)} besides its spec:" if others else
                         ": its spec only.")]
    kinds = {"A": "added", "M": "changed", "D": "deleted", "T": "type changed"}
    lines += [f"- `{md_text(p)}` ({kinds.get(s[:1], md_text(s))})" for s, p in others[:200]]
    if len(others) > 200:
        lines.append(f"- … and {len(others) - 200} more")
    return lines


def records_line(state: VersionState) -> str:
    """Whether the branch's runs/<v>/ is the controller's (its seal verifies)."""
    if "seal" in state.record_errors:
        return (f"**Forged records:** `runs/{md_text(state.name)}/` on this branch was not "
                "written by the controller; nothing is trained, gated or merged from it.")
    if state.records.get("run") is None:
        return "**Records.** none yet (the controller writes them after the approval)."
    return (f"**Records.** `runs/{md_text(state.name)}/` written and sealed by the "
            "controller.")


def intervention_title(state: VersionState) -> str:
    rationale = " ".join(str((state.spec.get("intervention") or {}).get("rationale", "")).split())
    short = rationale if len(rationale) <= 80 else rationale[:79] + "…"
    title = f"{state.name} (from {state.parent}): {short}" if state.parent else state.name
    return _MENTION.sub("@\u2060", title)


def intervention_body(ws: Workspace, name: str) -> str:
    """The PR body: rationale, hypothesis, criterion, the diff of the spec, and what the
    planner saw (triggering diagnosis, backtest numbers)."""
    states = ws.versions()
    state = ws.version(name, states)
    intervention = state.spec.get("intervention") or {}
    hypothesis = intervention.get("hypothesis") or {}
    lines = [
        f"## Version `{name}` ← `{state.parent}`",
        "",
        f"**Rationale.** {md_text(intervention.get('rationale', '—'))}",
    ]
    if intervention.get("skills"):
        lines.append(f"**Skills.** {', '.join(md_text(s) for s in intervention['skills'])}")
    if hypothesis.get("statement"):
        lines.append(f"**Hypothesis.** {md_text(hypothesis['statement'])}")
    if hypothesis.get("criterion"):
        lines += ["**Criterion** (falsifiable; the gate records whether it held):",
                  md_code(str(hypothesis["criterion"]))]
    proposal = state.spec.get("proposal") or {}
    if proposal:
        lines += ["", "### Why it was proposed", ""] + _proposal_lines(proposal)
    diff = spec_diff(ws, state, states)
    if len(diff) > MAX_DIFF_CHARS:
        diff = diff[:MAX_DIFF_CHARS] + f"\n… (cut; run git diff main...{branch_name(name)})"
    lines += ["", f"### What merging brings into `main`: `git diff main...{branch_name(name)}`",
              "", *merge_files_lines(ws.merge_changes(state, states), name), "",
              md_code(diff or "(no change)", "diff"), ""]
    if state.parent:
        lines += [f"Its own change against its parent alone: `git diff "
                  f"{branch_name(state.parent)}...{branch_name(name)}`; an approval covers "
                  "everything above.", ""]
    lines += [records_line(state), "",
              "### Review", "",
              f"An **approving review** on this head from a reviewer listed under "
              f"`{REVIEWERS_FIELD}:` in `main`'s `{PROJECT_FILE}` (never the PR's author) "
              f"is the approval: CI commits it to `{branch_name(name)}` (bound to "
              "the reviewed content; a later push needs a new review), then reconcile "
              "trains, diagnoses and gates. **Promote** merges this branch into `main` "
              "(this PR shows merged); **prune** closes it with the decision, keeping the "
              f"branch and the tag `{PRUNED_TAG_PREFIX}{name}`. Do not merge by hand: "
              "`main` is the promoted lineage."]
    body = "\n".join(lines) + "\n"
    if len(body) > MAX_BODY_CHARS:  # fields are capped; this bounds their number too
        body = body[:MAX_BODY_CHARS] + "\n\n… (cut at GitHub's size limit)\n"
    return body


def _proposal_lines(proposal: dict) -> list[str]:
    lines = []
    if proposal.get("planner"):
        lines.append(f"- planner: {md_text(proposal['planner'])}, tokens "
                     f"{md_text(proposal.get('tokens', 0))}")
    if proposal.get("evidence_version"):
        lines.append(f"- diagnosis of: `{md_text(proposal['evidence_version'])}`")
    trigger = proposal.get("trigger") or {}
    if trigger:
        alerts = ", ".join(md_text(a) for a in trigger.get("alerts") or []) or "none"
        lines.append(f"- trigger of skill {md_text(trigger.get('skill', '?'))}: "
                     f"`{md_text(trigger.get('expression', ''))}`; alerts: {alerts}")
        for metric, value in (trigger.get("values") or {}).items():
            lines.append(f"  - {md_text(metric)} = {_number(value)}")
    backtest = proposal.get("backtest")
    if isinstance(backtest, dict):
        lines.append("- backtest on stored rollouts:")
        for key, value in backtest.items():
            if not isinstance(value, (dict, list)):
                lines.append(f"  - {md_text(key)}: {_number(value)}")
    for key in ("subtracts", "move", "frontier"):
        if proposal.get(key):
            lines.append(f"- {key}: {md_text(proposal[key])}")
    return lines


# ---- status ----------------------------------------------------------------------------------


def status_markdown(ws: Workspace, state: VersionState, states: dict[str, VersionState],
                    waiting: str | None = None) -> str:
    """The one status comment: approval, run, diagnosis and alerts, verdict, outcome."""
    rows: list[tuple[str, str]] = []
    approval = state.approval
    status = ws.approval_status(state, states)
    if status == "approved":
        rows.append(("approval", f"approved by {md_text(approval.get('by'))} at "
                     f"{md_text(approval.get('at'))} (digest `{str(approval['digest'])[:19]}`)"))
    else:
        rows.append(("approval", md_text(status) + (f": {md_text(waiting)}" if waiting else "")))
    run, diagnosis, decision = state.run, state.diagnosis, state.decision
    if run:
        rows.append(("run", f"launched {md_text(run.created_at)} as {md_text(run.job_id)} "
                     f"(attempt {run.attempt}, {md_text(run.backend)}): {md_text(run.state)}"))
    if diagnosis:
        alerts = ", ".join(f"{md_text(a.get('name'))} ({md_text(a.get('severity'))})"
                           for a in diagnosis.alerts) or "none"
        rows.append(("diagnosis", f"harness {md_text(diagnosis.harness_name)}; alerts: {alerts}"))
    if decision:
        rows.append(("verdict", f"**{md_text(decision.verdict)}**: {md_text(decision.reason)}"))
        criterion = decision.criterion
        if criterion:
            rows.append(("criterion", f"{md_text(criterion.get('expression'))} held: "
                         f"{md_text(criterion.get('held'))}"))
    if state.name in ws.git.tags(PRUNED_TAG_PREFIX):
        rows.append(("outcome", f"pruned: PR closed, branch and tag `{PRUNED_TAG_PREFIX}"
                     f"{state.name}` kept as negative evidence"))
    elif decision and decision.verdict == "promote":
        rows.append(("outcome", "promoted: merged into `main`"))
    table = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join([f"### evotrainer: `{state.name}`", "", *table]) + "\n"


def decision_markdown(state: VersionState) -> str:
    decision = state.decision
    blocked = ", ".join(md_text(b) for b in decision.blocked_by) if decision else ""
    verdict, reason = (decision.verdict, decision.reason) if decision else (None, None)
    return "\n".join([
        f"### `{state.name}` pruned by the gate",
        "",
        f"**Verdict:** {md_text(verdict)}. {md_text(reason)}",
        *([f"**Blocked by:** {blocked}"] if blocked else []),
        "",
        f"Closed without merging: `main` is the promoted lineage. The branch "
        f"`{branch_name(state.name)}` and the tag `{PRUNED_TAG_PREFIX}{state.name}` are kept "
        "as negative evidence (`runs/" + state.name + "/decision.yaml`).",
    ]) + "\n"


# ---- opening ---------------------------------------------------------------------------------


def push(ws: Workspace, remote: str, refspecs: list[str]) -> None:
    """Push atomically: all refs move or none does (a rejected main leaves no half state)."""
    try:
        ws.git.repo.git.push("--atomic", remote, *refspecs)
    except git.GitCommandError as exc:
        detail = " ".join((exc.stderr or "").split())[-300:]
        raise EvoError(f"git push to {remote} failed: {detail}", where=remote,
                       hint=f"fetch ({remote}'s evo/* branches, main and tags), rerun "
                       "reconcile if needed, then rerun") from None


def open_pull_request(ws: Workspace, gh: GitHubRepo, name: str, base: str = "main",
                      remote: str = "origin") -> Any:
    """Push `evo/<name>` and open its PR into `base` with the intervention as its body (an
    open PR gets its title and body refreshed instead)."""
    states = ws.versions()
    state = ws.version(name, states)
    branch = branch_name(name)
    push(ws, remote, [f"refs/heads/{branch}:refs/heads/{branch}"])
    title, body = intervention_title(state), intervention_body(ws, name)
    existing = gh.pull_for_branch(branch, base)
    if existing is None:
        return gh.create_pull(branch, base, title, body)
    if existing.body != body or existing.title != title:
        gh.edit_pull(existing, title=title, body=body)
    return existing


# ---- approvals from reviews ------------------------------------------------------------------


def main_reviewers(ws: Workspace, base: str = "main") -> frozenset[str]:
    """The logins whose review approves, as `base` (main) lists them under `reviewers:` in
    its project spec, lower-cased (GitHub logins are case-insensitive). A branch's own list
    is never read: the people who may approve are chosen by review on main."""
    ref = f"refs/heads/{base}" if ws.git.rev(f"refs/heads/{base}") else base
    raw = ws.git.read(ref, PROJECT_FILE)
    try:
        doc = load_yaml(raw, f"{base}:{PROJECT_FILE}") if raw else None
    except EvoError:
        doc = None  # `validate` reports it; an unreadable list approves nobody
    listed = doc.get(REVIEWERS_FIELD) if isinstance(doc, dict) else None
    if not isinstance(listed, list):
        return frozenset()
    return frozenset(str(login).strip().lower() for login in listed
                     if isinstance(login, str) and login.strip())


def approving_review(reviews: list[Any], head_sha: str, reviewers: frozenset[str],
                     author: str | None = None) -> tuple[Any | None, str]:
    """The approving review that counts on `head_sha`, or None and why not.

    Each reviewer's latest approve/request-changes counts (a comment-only review does not
    replace it; a dismissed one removes it). Only `reviewers` (main's list) count, and never
    the PR's `author`; a listed reviewer's request for changes blocks; the approval must be
    of exactly `head_sha`.
    """
    latest: dict[str, Any] = {}
    for review in reviews:
        login = review.user.login if review.user else None
        if login is None:
            continue
        if review.state == "DISMISSED":
            latest.pop(login, None)
        elif review.state in ("APPROVED", "CHANGES_REQUESTED"):
            latest[login] = review
    own = (author or "").lower()
    trusted = {login: r for login, r in latest.items()
               if login.lower() in reviewers and login.lower() != own}
    blocking = sorted(login for login, r in trusted.items() if r.state == "CHANGES_REQUESTED")
    if blocking:
        return None, f"changes requested by {', '.join(blocking)}"
    on_head = [r for r in trusted.values() if r.state == "APPROVED" and r.commit_id == head_sha]
    if on_head:
        return on_head[0], ""
    if any(r.state == "APPROVED" for r in trusted.values()):
        return None, f"the approving review is of an older commit; review {head_sha[:12]}"
    if not reviewers:
        return None, (f"no reviewers: main lists none under `{REVIEWERS_FIELD}:` in "
                      f"{PROJECT_FILE}, so no review approves; add the maintainers' GitHub "
                      "logins there on main")
    if latest:
        return None, (f"approving reviews only from people not listed under "
                      f"`{REVIEWERS_FIELD}:` in main's {PROJECT_FILE} (or from the PR's "
                      "author); a listed reviewer must approve")
    return None, f"waiting for an approving review of {head_sha[:12]}"


# ---- sync ------------------------------------------------------------------------------------


@dataclass
class SyncReport:
    approved: list[tuple[str, str]] = field(default_factory=list)  # (version, reviewer)
    merged: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)  # version → why
    status_updated: list[str] = field(default_factory=list)


def record_refspecs(base: str) -> list[str]:
    return [f"refs/heads/{BRANCH_PREFIX}*:refs/heads/{BRANCH_PREFIX}*",
            f"refs/heads/{base}:refs/heads/{base}",
            f"refs/tags/{PRUNED_TAG_PREFIX}*:refs/tags/{PRUNED_TAG_PREFIX}*"]


def sync(ws: Workspace, gh: GitHubRepo, base: str = "main", remote: str | None = "origin",
         log: Callable[[str], None] = lambda _: None) -> SyncReport:
    """One level-triggered pass over the open version PRs (see the module docstring).
    `remote=None` skips the push (the caller pushes)."""
    report = SyncReport()
    pulls = [p for p in gh.pulls(base) if p.head.ref.startswith(BRANCH_PREFIX)
             and p.head.repo is not None and p.head.repo.full_name == gh.slug]
    states = ws.versions()
    reviewers = main_reviewers(ws, base)
    for pull in pulls:
        name = pull.head.ref.removeprefix(BRANCH_PREFIX)
        state = states.get(name)
        if state is None or state.spec is None:
            report.waiting[name] = f"no readable {branch_name(name)} here: fetch it"
            continue
        if ws.approval_status(state, states) == "approved":
            continue
        author = pull.user.login if getattr(pull, "user", None) else None
        review, why = approving_review(gh.reviews(pull), state.sha, reviewers, author)
        if review is None:
            report.waiting[name] = why
            continue
        by = (f"{review.user.login} (GitHub review of {state.sha[:12]} on PR "
              f"#{pull.number})")
        approve(ws, name, by)
        report.approved.append((name, review.user.login))
        log(f"approved {name}: review by {review.user.login} on {state.sha[:12]}")
    if remote:
        push(ws, remote, record_refspecs(base))
    states = ws.versions()
    pruned = ws.git.tags(PRUNED_TAG_PREFIX)
    on_base = ws.git.merged_versions(base)
    for pull in pulls:
        name = pull.head.ref.removeprefix(BRANCH_PREFIX)
        state = states.get(name)
        if state is None or state.spec is None:
            continue
        if gh.upsert_comment(pull, STATUS_MARKER,
                             status_markdown(ws, state, states, report.waiting.get(name))):
            report.status_updated.append(name)
        verdict = state.decision.verdict if state.decision else None
        if name in pruned:
            gh.upsert_comment(pull, DECISION_MARKER, decision_markdown(state))
            gh.edit_pull(pull, state="closed")
            report.closed.append(name)
            log(f"closed the PR of {name} (#{pull.number}): pruned")
        elif verdict == "promote" and name in on_base:
            if gh.pull(pull.number).merged:
                report.merged.append(name)
                log(f"the PR of {name} (#{pull.number}) shows merged: promoted")
            else:
                report.waiting[name] = (f"promoted into local {base}, but GitHub does not "
                                        f"show #{pull.number} merged: push {base}")
    return report


# ---- harness PRs -----------------------------------------------------------------------------


def _harness_of(ws: Workspace, ref: str) -> str:
    raw = ws.git.read(ref, PROJECT_FILE)
    try:  # the PR's own project file: read within the bounds, as every spec is
        doc = load_yaml(raw, f"{ref}:{PROJECT_FILE}") if raw else None
    except EvoError:
        doc = None  # `validate --ref` reports it; the summary compares with h0
    return (doc or {}).get("harness", "h0") if isinstance(doc, dict) else "h0"


def harness_candidates(ws: Workspace, base: str) -> tuple[list[str], HarnessRevision]:
    """The harness revisions a PR (the checkout, against `base`) adds, changes or switches
    to, and the revision in force on `base` as `base` has it (a PR may edit that one too)."""
    if ws.git.rev(base) is None:
        raise EvoError(f"no {base} here to compare the pull request with", field="--base",
                       hint="fetch the base branch (e.g. --base origin/main)")
    changed = ws.git.repo.git.diff(*DIFF_SAFETY, "--name-only", "--diff-filter=AM",
                                   f"{base}...HEAD", "--",
                                   f"{HARNESS_FOLDER}/").split()
    candidates = [os.path.basename(p).removesuffix(".yaml") for p in changed
                  if p.endswith(".yaml")]
    name = _harness_of(ws, base)
    path = harness_file(name)
    text = ws.git.read(base, path)
    against = (parse_harness_text(text, f"{base}:{path}") if text is not None
               else resolve_harness(name, ws.root))  # built in, not in the repository
    in_force = ws.harness_in_force()
    if in_force not in candidates and in_force != name:
        candidates.append(in_force)  # the PR switches `harness:`
    return candidates, against


def harness_summary(ws: Workspace, base: str) -> tuple[str, bool]:
    """Backtest each candidate of a harness PR against the base's revision; the markdown
    (flipped alerts and verdicts, backtest cases) and whether every case passes."""
    candidates, against = harness_candidates(ws, base)
    if not candidates:
        return "### Harness backtest\n\nThis pull request changes no harness revision.\n", True
    parts, passed = [], True
    for name in candidates:
        report = backtest_harness(ws, name, against)
        passed &= bool(report["passed"])
        parts.append(_harness_section(report))
    return "\n".join(parts), passed


def _harness_section(report: dict) -> str:
    candidate, against = md_text(report["candidate"]), md_text(report["against"])
    flipped = [r for r in report["versions"] if r["verdict_before"] != r["verdict_after"]]
    changed = [r for r in report["versions"] if r["changed"]]
    lines = [f"### Harness backtest: `{candidate}` against `{against}`", "",
             f"Re-diagnosed and re-gated {len(report['versions'])} recorded version(s) from "
             f"their stored rollouts (no retraining): **{len(flipped)} verdict(s) flip**, "
             f"{len(changed)} version(s) change. Merging this PR adopts it.", ""]
    if changed:
        lines += ["| version | recorded | verdict " + against + " | verdict " + candidate
                  + " | alerts + | alerts − |", "|---|---|---|---|---|---|"]
        for row in changed:
            before, after = set(row["alerts_before"]), set(row["alerts_after"])
            verdict = md_text(row["verdict_after"] or "—")
            if row["verdict_before"] != row["verdict_after"]:
                verdict = f"**{verdict}**"
            lines.append(
                f"| {md_text(row['version'])} | {md_text(row['recorded'] or '—')} | "
                f"{md_text(row['verdict_before'] or '—')} | {verdict} | "
                f"{', '.join(md_text(a) for a in sorted(after - before))} | "
                f"{', '.join(md_text(a) for a in sorted(before - after))} |")
    cases = report["cases"]
    if cases:
        lines += ["", "| case | expect | verdict | result |", "|---|---|---|---|"]
        lines += [f"| {md_text(c['version'])} | {md_text(c['expect'])} | "
                  f"{md_text(c['verdict'] or '—')} | {'pass' if c['passed'] else '**FAIL**'} |"
                  for c in cases]
    return "\n".join(lines) + "\n"
