"""Retrieval over recorded knowledge and the skill library shared across
workspaces (C8): two workspaces of two domains (swe, arith) and one library repository;
evidence gathered in swe is proposed back to the library on a branch, and once a reviewer
merges it the arith workspace retrieves it when it asks about dead groups. Hostile library
repositories (bad YAML, a link, a 10 MB file) are refused with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import git
import pytest
import yaml
from sealing import controller_commit

from evotrainer.agent.retrieval import Query, SearchTrace, query_for, retrieve
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import new_version
from evotrainer.errors import EvoError
from evotrainer.skills.library import (
    record_evidence,
    share_evidence,
    shared_library,
    workspace_library,
)
from evotrainer.store import specs
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.workspace import Workspace

ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@t"}


def library_repo(path: Path, *names: str) -> git.Repo:
    """A library repository whose main holds these built-in skills."""
    (path / "skills").mkdir(parents=True)
    repo = git.Repo.init(path, initial_branch="main")
    for name in names:
        shutil.copy(builtin_dir("skills") / f"{name}.yaml", path / "skills" / f"{name}.yaml")
    commit_all(repo, "the library")
    return repo


def commit_all(repo: git.Repo, message: str) -> None:
    repo.git.add("-A")
    repo.git.commit("-m", message, env=ENV)


def use_library(ws_root: Path, **block) -> Workspace:
    """Add `skill_library` to the project spec, committed on the workspace's main."""
    project = ws_root / "spec" / "project.yaml"
    project.write_text(project.read_text() + yaml.safe_dump({"skill_library": block}))
    commit_all(git.Repo(ws_root), "use the shared skill library")
    return Workspace(ws_root)


def decision(version: str, parent: str, verdict: str, delta: float) -> dict:
    return {"apiVersion": "evotrainer/v1", "kind": "Decision", "version": version,
            "parent": parent, "verdict": verdict, "reason": "test",
            "harness": {"name": "h0", "digest": "sha256:x"}, "blocked_by": [],
            "comparison": {"delta": delta, "ci_low": delta - 0.02, "ci_high": delta + 0.02,
                           "p_bootstrap": 0.01}}


def diagnosis(version: str, *alerts: str) -> dict:
    return {"apiVersion": "evotrainer/v1", "kind": "Diagnosis", "version": version,
            "harness": {"name": "h0", "digest": "sha256:x"},
            "metrics": {"dead_group_ratio": {"value": 0.6, "layer": "signal"}},
            "alerts": [{"name": a, "severity": "critical", "metric": "dead_group_ratio",
                        "value": 0.6, "layer": "signal"} for a in alerts]}


def record(ws: Workspace, version: str, parent: str | None, *alerts: str,
           verdict: str | None = None, delta: float = 0.0) -> None:
    files = {f"runs/{version}/diagnosis.yaml":
             specs.dump(diagnosis(version, *alerts)).encode()}
    if verdict:
        files[f"runs/{version}/decision.yaml"] = specs.dump(
            decision(version, parent or "", verdict, delta)).encode()
    controller_commit(ws, version, files)


@pytest.fixture
def two_domains(tmp_path):
    """A library with StdGroupFilter; an swe workspace where it rescued dead groups (v1
    promoted, gate evidence recorded on main); an arith workspace."""
    library = library_repo(tmp_path / "library", "std-group-filter")
    swe = use_library(init_workspace(tmp_path / "swe", "swe"), repo="../library")
    record(swe, "v0", None, "dead_groups")
    new_version(swe, "v1", "v0", rationale="dead groups: filter them",
                skills=["std-group-filter"])
    record(swe, "v1", "v0", verdict="promote", delta=0.05)
    record_evidence(swe, "v1", swe.version("v1").records["decision"])
    arith = use_library(init_workspace(tmp_path / "arith", "arith"), repo="../library")
    return library, swe, arith


def test_evidence_from_swe_goes_to_a_library_branch_and_arith_retrieves_it_once_merged(
        two_domains):
    library, swe, arith = two_domains
    main_before = library.commit("main").hexsha
    dead = Query(alerts=("dead_groups",), domain="arith")

    def transferred() -> list:
        return [r for r in retrieve(arith, dead, limit=50)
                if r.kind == "skill-evidence" and r.version == "swe-demo/v1"]

    assert transferred() == []  # nothing shared yet

    shared = share_evidence(swe)
    assert shared["branch"] == "evidence/swe-demo" and shared["new"]
    assert library.commit("main").hexsha == main_before  # never straight to main
    proposed = yaml.safe_load(library.git.show("evidence/swe-demo:skills/std-group-filter.yaml"))
    [entry] = [e for e in proposed["evidence"] if e["version"] == "swe-demo/v1"]
    assert entry["domain"] == "swe" and entry["delta"] == pytest.approx(0.05)
    assert entry["source"] == "swe-demo gate (h0)"
    assert "Evotrainer-Action: share-evidence" in library.commit("evidence/swe-demo").message
    assert share_evidence(swe)["new"] is False  # the same evidence is proposed once
    # Unreviewed: the branch is not the library, so arith does not see it yet.
    assert transferred() == []

    library.git.merge("evidence/swe-demo", env=ENV)  # the reviewer merges it
    [found] = transferred()
    assert found.domain == "swe" and "dead_groups" in found.alerts
    cite = found.cite()
    assert cite.startswith("skill library ../library@main, skill std-group-filter, evidence "
                           "swe-demo/v1 @ " + library.commit("main").hexsha[:12])
    # The arith planner's library carries it too, beside its own copy's evidence.
    merged = workspace_library(arith)["std-group-filter"]
    assert "swe-demo/v1" in [e["version"] for e in merged.evidence]
    assert merged.source == "skills/std-group-filter.yaml"  # arith's reviewed copy


def test_other_workspaces_decisions_and_recurring_cases_are_retrieved_with_a_trace(
        two_domains, tmp_path):
    _, swe, _ = two_domains
    new_version(swe, "v2", "v0", rationale="dead groups again: lower the lr",
                settings=["grpo.lr=1e-5"])
    record(swe, "v2", "v0", verdict="prune", delta=-0.03)
    arith = Workspace(init_workspace(tmp_path / "arith2", "arith"))
    trace = SearchTrace()
    query = query_for(diagnosis("v0", "dead_groups"), domain="arith", text="dead groups")
    assert query.alerts == ("dead_groups",) and query.metrics == ("dead_group_ratio",)
    found = retrieve(arith, query, limit=40, workspaces=(str(swe.root),), trace=trace)
    kinds = {(r.kind, r.version) for r in found}
    assert {("decision", "v1"), ("decision", "v2"), ("case", "v1,v2"),
            ("diagnosis", "v0")} <= kinds
    seen = next(r for r in found if r.kind == "diagnosis")
    assert seen.text == ("v0 diagnosed by h0: dead_groups (critical) on dead_group_ratio "
                         "= 0.6.")
    case = next(r for r in found if r.kind == "case")
    assert case.alerts == ("dead_groups",)
    assert set(case.data["versions"]) == {"v1", "v2"}
    assert "v1 std-group-filter → promote Δ +0.0500" in case.text
    assert "v2 grpo.lr → prune Δ -0.0300" in case.text
    v1 = next(r for r in found if (r.kind, r.version) == ("decision", "v1"))
    # Read with swe's own record key (its .evotrainer/): verified as swe verifies them.
    assert v1.cite() == (f"workspace swe-demo, version v1 @ {swe.version('v1').sha[:12]} "
                         "(runs/v1/decision.yaml)")
    assert v1.data["verdict"] == "promote" and v1.data["skills"] == ["std-group-filter"]
    # In-domain knowledge first at equal relevance; the trace records the search.
    [entry] = trace.as_list()
    assert entry["query"]["alerts"] == ["dead_groups"]
    assert entry["sources"] == ["workspace arith-demo", "workspace swe-demo"]
    assert entry["retrieved"] == [r.cite() for r in found]
    assert [r.score for r in found] == sorted((r.score for r in found), reverse=True)
    # A query that matches nothing retrieves nothing.
    assert retrieve(arith, Query(text="zzzz"), workspaces=(str(swe.root),)) == []


def test_retrieval_scores_are_deterministic_and_in_domain_first(two_domains):
    _, swe, arith = two_domains
    query = Query(alerts=("dead_groups",), domain="arith")
    first = [(r.cite(), r.score) for r in retrieve(arith, query, limit=30)]
    assert first == [(r.cite(), r.score) for r in retrieve(arith, query, limit=30)]
    skills = [r for r in retrieve(arith, query, limit=30) if r.kind == "skill"]
    assert skills[0].title in ("std-group-filter", "zero-std-filter")
    unrelated = retrieve(arith, Query(alerts=("no_such_alert",)), limit=30)
    assert all(r.kind != "decision" for r in unrelated)


# ---------------------------------------------------------------- hostile library repository


@pytest.fixture
def hostile(tmp_path):
    repo = library_repo(tmp_path / "library", "kl-cap")
    ws = use_library(init_workspace(tmp_path / "ws", "arith"), repo="../library")
    return repo, Path(repo.working_dir), ws


def refused(ws: Workspace) -> EvoError:
    with pytest.raises(EvoError) as caught:
        shared_library(ws)
    return caught.value


def test_bad_yaml_in_the_library_names_repo_path_and_field(hostile, cli):
    repo, root, ws = hostile
    (root / "skills" / "broken.yaml").write_text("name: [unclosed\n")
    commit_all(repo, "broken")
    err = refused(ws)
    assert err.where.startswith("skill library ../library@main:skills/broken.yaml:")
    assert err.field == "(YAML document)" and "malformed YAML" in err.message

    (root / "skills" / "broken.yaml").write_text(
        (builtin_dir("skills") / "kl-cap.yaml").read_text().replace("name: kl-cap",
                                                                    "name: broken")
        .replace("category: stability", "category: nonsense"))
    commit_all(repo, "wrong field")
    err = refused(ws)
    assert err.where.startswith("skill library ../library@main:skills/broken.yaml:")
    assert err.field == "category"
    out = cli("skills", "list", cwd=ws.root)  # the user sees one line, no traceback
    assert out.code == 1 and "Traceback" not in out.output
    assert "skills/broken.yaml" in out.err and "category" in out.err


def test_a_link_out_of_the_library_is_refused_not_followed(hostile, tmp_path):
    repo, root, ws = hostile
    secret = tmp_path / "secret.yaml"
    secret.write_text((builtin_dir("skills") / "kl-cap.yaml").read_text()
                      .replace("name: kl-cap", "name: escape"))
    (root / "skills" / "escape.yaml").symlink_to(secret)
    commit_all(repo, "a link")
    err = refused(ws)
    assert (err.where, err.field) == ("skill library ../library@main:skills/escape.yaml",
                                      "mode")
    assert "symbolic link" in err.message

    (root / "skills" / "escape.yaml").unlink()
    shutil.rmtree(root / "skills")
    (root / "skills").symlink_to(tmp_path)  # the whole folder a link
    commit_all(repo, "skills is a link")
    err = refused(ws)
    assert (err.where, err.field) == ("skill library ../library@main:skills", "mode")


def test_a_10_mb_skill_is_refused_before_it_is_read(hostile):
    repo, root, ws = hostile
    (root / "skills" / "huge.yaml").write_bytes(b"# " + b"x" * (10 << 20) + b"\n")
    commit_all(repo, "huge")
    err = refused(ws)
    assert (err.where, err.field) == ("skill library ../library@main:skills/huge.yaml", "size")
    assert str((10 << 20) + 3) in err.message


def test_only_the_reviewed_branch_is_read(hostile):
    repo, root, ws = hostile
    repo.git.checkout("-b", "proposal")
    shutil.copy(builtin_dir("skills") / "clip-higher.yaml", root / "skills")
    commit_all(repo, "unreviewed")
    assert set(shared_library(ws).skills) == {"kl-cap"}
    missing = use_library(init_workspace(root.parent / "ws2", "arith"), repo="../library",
                          ref="release")
    err = refused(missing)
    assert (err.field, "no branch 'release'" in err.message) == ("skill_library.ref", True)


def test_the_command_line_retrieves_shares_and_prints_library_text_safely(two_domains, cli):
    library, swe, arith = two_domains
    shared = cli("skills", "share", "--json", cwd=swe.root)
    assert shared.code == 0, shared.output
    assert json.loads(shared.out)["branch"] == "evidence/swe-demo"
    assert "already proposed" in cli("skills", "share").out
    library.git.merge("evidence/swe-demo", env=ENV)

    asked = cli("skills", "retrieve", "--version", "v0", "--json", cwd=swe.root)
    assert asked.code == 0, asked.output
    found = json.loads(asked.out)
    # v0's own diagnosis (dead_groups) is the closest match to the question it asks.
    assert found[0]["kind"] == "diagnosis"
    assert found[0]["cite"] == (f"workspace swe-demo, version v0 @ "
                                f"{swe.version('v0').sha[:12]} (runs/v0/diagnosis.yaml)")
    assert any(r["kind"] == "decision" and r["data"]["skills"] == ["std-group-filter"]
               for r in found)

    # Library text is anyone's: a terminal escape in an evidence entry is not passed through.
    path = Path(library.working_dir) / "skills" / "std-group-filter.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["evidence"].append({"version": "hostile\x1b[2J\x1b]0;owned\x07", "domain": "arith",
                            "verdict": "promote", "source": "someone"})
    path.write_text(yaml.safe_dump(doc))
    commit_all(library, "a hostile entry")
    table = cli("skills", "retrieve", "dead groups", "--alert", "dead_groups", "--limit",
                "60", cwd=arith.root)
    assert table.code == 0, table.output
    assert "hostile" in table.out and "\x1b" not in table.out
    nothing = cli("skills", "retrieve")
    assert nothing.code == 1 and "nothing to look for" in nothing.err


def test_a_forged_decision_in_a_listed_workspace_is_not_retrieved(two_domains, tmp_path):
    """A branch author commits a glowing decision without the controller's seal: the listed
    workspace's own reader drops it, so no planner elsewhere cites it."""
    _, swe, _ = two_domains
    new_version(swe, "v3", "v0", rationale="dead groups: the miracle", settings=["grpo.lr=2e-5"])
    swe.git.commit_files("evo/v3", {"runs/v3/decision.yaml": specs.dump(
        decision("v3", "v0", "promote", 0.9)).encode()}, "forged")
    arith = Workspace(init_workspace(tmp_path / "arith3", "arith"))
    found = retrieve(arith, Query(text="miracle dead groups", alerts=("dead_groups",)),
                     limit=50, workspaces=(str(swe.root),))
    assert "v1" in {r.version for r in found if r.kind == "decision"}
    assert "v3" not in {r.version for r in found}


def test_the_library_repositorys_own_config_and_hooks_never_run(two_domains, tmp_path):
    """The library's .git/config and hooks are not reviewed anywhere: reading its skills and
    committing evidence to it run neither its fsmonitor program nor its hooks."""
    library, swe, _ = two_domains
    marker = tmp_path / "ran"
    script = f"#!/bin/sh\ntouch {marker}\n"
    hooks = Path(library.git_dir) / "hooks"
    for hook in ("reference-transaction", "post-commit", "pre-commit", "post-checkout"):
        (hooks / hook).write_text(script)
        (hooks / hook).chmod(0o755)
    with library.config_writer() as config:
        config.set_value("core", "fsmonitor", f"touch {marker}; false")
    assert "std-group-filter" in shared_library(swe).skills
    assert share_evidence(swe)["new"]
    assert not marker.exists()


def test_a_version_may_apply_a_skill_only_the_shared_library_holds(tmp_path):
    """The planners see the merged library; `version new --skill` resolves the same one, so a
    skill reviewed on the library's main (not copied into the workspace) can be applied."""
    repo = library_repo(tmp_path / "library", "kl-cap")
    text = (builtin_dir("skills") / "kl-cap.yaml").read_text()
    (Path(repo.working_dir) / "skills" / "shared-kl.yaml").write_text(
        text.replace("name: kl-cap", "name: shared-kl"))
    commit_all(repo, "a skill only the library has")
    ws = use_library(init_workspace(tmp_path / "ws", "arith"), repo="../library")
    assert "shared-kl" not in ws.skill_names()
    new_version(ws, "v1", "v0", skills=["shared-kl"], rationale="KL cap from the library")
    spec = ws.version("v1").spec
    assert spec["intervention"]["skills"] == ["shared-kl"]
    assert spec["recipe"]["grpo"]["kl_coef"] == 0.002  # resolved against v0: raised to 0.002
    with pytest.raises(EvoError, match="unknown skill 'nowhere'"):
        new_version(ws, "v2", "v0", skills=["nowhere"], rationale="x")
