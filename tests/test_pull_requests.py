"""The pull-request story end to end against a fake GitHub REST API on loopback and a local
bare repository as `origin`: a version's PR opens with its intervention, a trusted review on
its head becomes the approval commit, promotion shows it merged, pruning closes it with the
decision; a harness PR gets its backtest in the job summary and a comment."""

from __future__ import annotations

import subprocess

import git
import pytest
import yaml
from fake_github import FakeGitHub
from standin import converge, standin_settings
from standin import propose as train

from evotrainer.control import github_client
from evotrainer.control.pull_requests import DECISION_MARKER, HARNESS_MARKER, STATUS_MARKER
from evotrainer.control.versions import new_version
from evotrainer.store.workspace import PROJECT_FILE, Workspace

pytestmark = pytest.mark.usefixtures("standin")
SLUG, TOKEN = "acme/rl-runs", "test-token-not-a-secret"


@pytest.fixture
def github(workspace, tmp_path, monkeypatch):
    """`origin` is a bare repository; GitHub is the fake, reached through the environment."""
    bare = tmp_path / "origin.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    # Main lists who may approve (approvals count from that list only).
    project = (workspace.root / PROJECT_FILE).read_text() + "reviewers: [alice, bob, carol]\n"
    workspace.git.commit_files("main", {PROJECT_FILE: project.encode()}, "reviewers")
    repo = git.Repo(workspace.root)
    repo.create_remote("origin", str(bare))
    repo.git.push("origin", "main", "evo/v0")
    monkeypatch.setattr(github_client, "WRITE_PACING_S", 0)
    with FakeGitHub(bare, SLUG, TOKEN) as fake:
        monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
        monkeypatch.setenv("GITHUB_REPOSITORY", SLUG)
        monkeypatch.setenv("GITHUB_API_URL", fake.url)
        monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
        monkeypatch.delenv("GITHUB_EVENT_PATH", raising=False)
        yield fake


def origin_file(fake: FakeGitHub, ref: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{ref}:{path}"], cwd=fake.bare, check=True,
                          capture_output=True, text=True).stdout


def origin_refs(fake: FakeGitHub) -> set[str]:
    out = subprocess.run(["git", "for-each-ref", "--format=%(refname)"], cwd=fake.bare,
                         check=True, capture_output=True, text=True).stdout
    return set(out.split())


def ours(fake: FakeGitHub, number: int, marker: str) -> list[dict]:
    return [c for c in fake.pr_comments(number)
            if c["user"]["login"] == fake.bot_login and c["body"].startswith(marker)]


def test_a_version_pr_follows_its_lifecycle(workspace, github, cli):
    ws = workspace
    new_version(ws, "v1", "v0", rationale="GRPO with the tool that reveals the answer",
                hypothesis="More steps raise Avg@k", criterion="delta >= 0.05",
                settings=standin_settings(standin_skill=0.8, standin_leak=True))
    new_version(ws, "v2", "v0", rationale="GRPO without the leak",
                settings=standin_settings(standin_skill=0.65))
    for name in ("v1", "v2"):
        opened = cli("pr", "open", name, cwd=ws.root)
        assert opened.code == 0, opened.output
    first, second = github.pull(1), github.pull(2)
    assert (first["head"]["ref"], first["base"]["ref"]) == ("evo/v1", "main")
    assert first["title"].startswith("v1 (from v0): GRPO with the tool")
    for text in ("GRPO with the tool that reveals the answer", "More steps raise Avg@k",
                 "delta >= 0.05", "+    params:", "standin_leak: true",
                 "git diff evo/v0...evo/v1"):
        assert text in first["body"], text
    assert "standin_leak" not in second["body"]  # each body is its own intervention

    # Reviewers approve the heads they saw; CI turns that into approval commits, pushed.
    github.review(1, "bob", "APPROVED", first["head"]["sha"], "MEMBER")
    github.review(2, "alice", "APPROVED", second["head"]["sha"], "OWNER")
    synced = cli("pr", "sync", cwd=ws.root)
    assert synced.code == 0, synced.output
    assert "approved 2" in synced.out
    ws = Workspace(ws.root)
    states = ws.versions()
    for name, reviewer in (("v1", "bob"), ("v2", "alice")):
        assert ws.approval_status(states[name], states) == "approved"
        assert states[name].approval["by"].startswith(f"{reviewer} (GitHub review of ")
        pushed = yaml.safe_load(origin_file(github, f"evo/{name}",
                                            f"spec/versions/{name}.yaml"))
        assert pushed["approval"]["digest"] == states[name].approval["digest"]
    assert "approved by alice" in ours(github, 2, STATUS_MARKER)[0]["body"]

    converge(ws)
    states = ws.versions()
    assert states["v1"].records["decision"]["verdict"] == "prune"
    assert states["v2"].records["decision"]["verdict"] == "promote"

    synced = cli("pr", "sync", cwd=ws.root)
    assert synced.code == 0, synced.output
    merged, closed = github.pull(2), github.pull(1)
    assert merged["merged"] and merged["state"] == "closed"
    assert closed["state"] == "closed" and not closed["merged"]
    [decision] = ours(github, 1, DECISION_MARKER)
    assert "pruned by the gate" in decision["body"] and "leak" in decision["body"]
    assert {"refs/heads/evo/v1", "refs/tags/pruned/v1"} <= origin_refs(github)
    for number, verdict in ((1, "prune"), (2, "promote")):
        [status] = ours(github, number, STATUS_MARKER)  # one comment, edited in place
        assert f"**{verdict}**" in status["body"] and "launched" in status["body"]
    assert "merged 1, closed 1" in synced.out

    again = cli("pr", "sync", cwd=ws.root)  # level-triggered: nothing left to do
    assert again.code == 0 and "approved 0, merged 0, closed 0, status updated 0" in again.out


def test_reviews_that_do_not_approve(workspace, github, cli):
    """Attacks on the approval: an outsider's approving review, an approval of a commit the
    branch has moved past, and a forged status comment."""
    ws = workspace
    new_version(ws, "v1", "v0", rationale="harmless-looking",
                settings=standin_settings(standin_skill=0.5))
    assert cli("pr", "open", "v1", cwd=ws.root).code == 0
    reviewed = github.pull(1)["head"]["sha"]
    github.review(1, "alice", "APPROVED", reviewed, "MEMBER")
    # After the review, the branch gets a change nobody reviewed, and is pushed.
    spec = yaml.safe_load(ws.git.read("evo/v1", "spec/versions/v1.yaml"))
    spec["recipe"]["domain"]["params"]["standin_leak"] = True
    ws.git.commit_files("evo/v1", {"spec/versions/v1.yaml": yaml.safe_dump(spec).encode()},
                        "sneak in a leak")
    git.Repo(ws.root).git.push("origin", "evo/v1")
    head = github.pull(1)["head"]["sha"]
    assert head != reviewed
    github.review(1, "mallory", "APPROVED", head, "NONE")  # anyone can review a public repo
    github.comment_as(1, "mallory", STATUS_MARKER + "\napproved by the maintainers")

    synced = cli("pr", "sync", cwd=ws.root)
    assert synced.code == 0, synced.output
    assert "approved 0" in synced.out and "older commit" in synced.out
    ws = Workspace(ws.root)
    states = ws.versions()
    assert ws.approval_status(states["v1"], states) == "unapproved"
    assert yaml.safe_load(origin_file(github, "evo/v1", "spec/versions/v1.yaml"))[
        "approval"] == {"approved": False}
    forged = [c for c in github.pr_comments(1) if c["user"]["login"] == "mallory"]
    assert forged[0]["body"].endswith("approved by the maintainers")  # not taken over
    [status] = ours(github, 1, STATUS_MARKER)
    assert "unapproved" in status["body"]

    # A trusted request for changes outweighs an approval of the current head.
    github.review(1, "bob", "CHANGES_REQUESTED", head, "COLLABORATOR")
    github.review(1, "carol", "APPROVED", head, "MEMBER")
    synced = cli("pr", "sync", cwd=ws.root)
    assert "approved 0" in synced.out and "changes requested by bob" in synced.out


def test_without_github_the_plain_flow_stays(workspace, cli, monkeypatch):
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    new_version(workspace, "v1", "v0", rationale="plain git", criterion="delta >= 0.0")
    body = cli("pr", "body", "v1", cwd=workspace.root)
    assert body.code == 0 and "plain git" in body.out and "delta >= 0.0" in body.out
    refused = cli("pr", "sync", cwd=workspace.root)
    assert refused.code == 1 and "Traceback" not in refused.output
    assert "no GITHUB_TOKEN" in refused.output and "evotrainer approve" in refused.output


def test_a_harness_pr_shows_the_verdicts_it_flips(workspace, github, cli, tmp_path,
                                                   monkeypatch):
    train(workspace, "v1", standin_skill=0.65)
    converge(workspace)
    assert workspace.version("v1").records["decision"]["verdict"] == "promote"
    # The PR's branch: a stricter gate under which v1's gain no longer counts.
    repo = git.Repo(workspace.root)
    repo.git.checkout("-q", "-b", "harness-h1")
    doc = yaml.safe_load((workspace.root / "harness_revisions" / "h0.yaml").read_text())
    rules = [{"name": "significant_gain", "when": "ci_low > 0.5", "verdict": "promote"},
             *[r for r in doc["gate"]["rules"] if r["name"] != "significant_gain"]]
    doc.update(name="h1", parent="h0", gate={**doc["gate"], "rules": rules},
               backtest_cases=[{"version": "v1", "expect": "inconclusive"}])
    (workspace.root / "harness_revisions" / "h1.yaml").write_text(yaml.safe_dump(doc))
    repo.git.add("harness_revisions/h1.yaml")
    repo.git.commit("-q", "-m", "h1: a stricter gate", env={
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    repo.git.push("origin", "harness-h1")
    with github.lock:
        status, pull = github.handle("POST", f"/repos/{SLUG}/pulls", {
            "head": "harness-h1", "base": "main", "title": "h1", "body": ""})
    assert status == 201
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))

    shown = cli("pr", "harness-summary", "--base", "main", "--pr", str(pull["number"]),
                cwd=workspace.root)
    assert shown.code == 0, shown.output
    text = summary.read_text()
    assert "Harness backtest: `h1` against `h0`" in text and "1 verdict(s) flip" in text
    assert "| v1 | promote | promote | **inconclusive** |" in text
    assert "| v1 | inconclusive | inconclusive | pass |" in text
    [comment] = ours(github, pull["number"], HARNESS_MARKER)
    assert "**inconclusive**" in comment["body"]


def test_the_scaffolded_workflow_gives_each_job_least_permissions(workspace):
    workflow = yaml.safe_load((workspace.root / ".github/workflows/evotrainer.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert "pull_request_target" not in triggers and workflow["permissions"] == {}
    jobs = workflow["jobs"]
    assert set(jobs) == {"validate-and-plan", "harness-backtest", "approve", "reconcile"}
    assert jobs["validate-and-plan"]["permissions"] == {"contents": "read"}
    for name in ("harness-backtest", "approve"):  # tokens with write scopes: never for forks
        assert "head.repo.full_name == github.repository" in jobs[name]["if"]
    assert jobs["harness-backtest"]["permissions"]["contents"] == "read"
    runs = {name: " ".join(s.get("run", "") for s in job["steps"]) for name, job in jobs.items()}
    assert "evotrainer pr harness-summary" in runs["harness-backtest"]
    assert "evotrainer pr sync" in runs["approve"]
    assert runs["reconcile"].index("evotrainer reconcile") < runs["reconcile"].index(
        "evotrainer pr sync")
    assert "pull_request_review" in triggers and jobs["reconcile"]["needs"] == ["approve"]
