"""Skill creation: a promoted hand-made intervention becomes a skill spec on a
review branch — trigger from the alerts that motivated it, patch from its recipe diff,
evidence from its gate — and what the library already describes is refused."""

from __future__ import annotations

import json

import git
import pytest
import yaml
from test_retrieval import ENV, library_repo, record, use_library

from evotrainer.agent.retrieval import Query, retrieve
from evotrainer.agent.skill_creation import patch_from_overrides, propose_skill
from evotrainer.control.versions import new_version
from evotrainer.errors import EvoError
from evotrainer.skills.library import share_evidence, workspace_library
from evotrainer.skills.skill import load_skill, resolve_skill
from evotrainer.store import specs


@pytest.fixture
def promoted(workspace):
    """v0 fired dead_groups and weak_signal; hand-made v1 (lr 3e-4 → 1.5e-4) was promoted and
    no longer fires dead_groups."""
    record(workspace, "v0", None, "dead_groups", "weak_signal")
    new_version(workspace, "v1", "v0", rationale="dead groups: a smaller step",
                settings=["grpo.lr=1.5e-4"], hypothesis="a smaller step keeps groups alive",
                criterion="delta > 0.0")
    record(workspace, "v1", "v0", "weak_signal", verdict="promote", delta=0.04)
    return workspace


def test_a_promoted_hand_made_version_becomes_a_skill_on_a_review_branch(promoted, cli):
    main = promoted.git.rev("refs/heads/main")
    out = cli("skills", "propose", "v1", "--json", cwd=promoted.root)
    assert out.code == 0, out.output
    result = json.loads(out.output)
    assert (result["name"], result["branch"]) == ("v1-grpo-lr", "skill/v1-grpo-lr")
    assert promoted.git.rev("refs/heads/main") == main  # for review: main is untouched
    raw = promoted.git.read("skill/v1-grpo-lr", "skills/v1-grpo-lr.yaml")
    skill = specs.load_text(raw, "skills/v1-grpo-lr.yaml", "Skill").data  # the schema holds
    assert skill["trigger"] == '"dead_groups" in alerts'  # the alert it removed
    assert skill["category"] == "stability" and skill["domains"] == ["arith"]
    assert skill["mechanism"]["recipe_patch"] == {
        "grpo": {"lr": {"direction": "lower", "max": 1.5e-4}}}
    [entry] = skill["evidence"]
    assert entry["version"] == "v1" and entry["verdict"] == "promote"
    assert entry["delta"] == pytest.approx(0.04) and entry["ci"] == pytest.approx([0.02, 0.06])
    assert "motivated by dead_groups, weak_signal, gone after: dead_groups" in entry["note"]
    assert skill["criterion"] == "delta > 0.0"
    assert "Avg@k +0.0400" in skill["expected_effect"]
    message = promoted.git.repo.commit("skill/v1-grpo-lr").message
    assert "Evotrainer-Action: propose-skill" in message and "Evotrainer-Version: v1" in message

    # Merged, it is a library skill like any other: it resolves on v0's recipe to exactly
    # what v1 trained with, and it fires on the case that motivated it.
    repo = git.Repo(promoted.root)
    repo.git.merge("skill/v1-grpo-lr", env=ENV)
    created = workspace_library(promoted)["v1-grpo-lr"]
    resolution = resolve_skill(created, promoted.resolved_recipe("v0"))
    assert resolution.overrides == {"grpo": {"lr": 1.5e-4}}
    matched = json.loads(cli("skills", "match", "v0", "--json").output)["matches"]
    assert "v1-grpo-lr" in [m["name"] for m in matched]
    again = cli("skills", "propose", "v1")
    assert again.code == 1 and "what library skill 'v1-grpo-lr' makes" in again.err


def test_refused_when_not_promoted_when_a_skill_was_applied_or_the_library_has_it(
        promoted):
    new_version(promoted, "v2", "v0", rationale="kl by hand", settings=["grpo.kl_coef=0.002"])
    record(promoted, "v2", "v0", verdict="promote", delta=0.01)
    with pytest.raises(EvoError, match="what library skill 'kl-cap' makes") as err:
        propose_skill(promoted, "v2")
    assert err.value.field == "recipe"

    new_version(promoted, "v3", "v0", rationale="a filter", skills=["std-group-filter"])
    record(promoted, "v3", "v0", verdict="promote", delta=0.01)
    with pytest.raises(EvoError, match="applied library skill") as err:
        propose_skill(promoted, "v3")
    assert err.value.field == "intervention.skills"

    new_version(promoted, "v4", "v0", rationale="worse", settings=["grpo.top_p=0.9"])
    record(promoted, "v4", "v0", verdict="prune", delta=-0.05)
    with pytest.raises(EvoError, match="was not promoted") as err:
        propose_skill(promoted, "v4")

    record(promoted, "v0", None)  # a parent without alerts: nothing says when it applies
    with pytest.raises(EvoError, match="fired no alert") as err:
        propose_skill(promoted, "v1")
    assert err.value.field == "--trigger"
    made = propose_skill(promoted, "v1", name="gentle-lr", trigger="dead_group_ratio > 0.5")
    assert made["skill"]["trigger"] == "dead_group_ratio > 0.5"


def test_patches_move_numbers_relative_to_the_parent():
    parent = {"grpo": {"lr": 3e-4, "kl_coef": 0.0, "kl_estimator": "k3"},
              "reward": {"components": [{"name": "correctness", "weight": 1.0}]}}
    patch = patch_from_overrides(
        {"grpo": {"lr": 1e-4, "kl_coef": 0.01, "kl_estimator": "k1"},
         "reward": {"components": [{"name": "format", "weight": 0.1}]},
         "group_filter": {"name": "zero_std"}}, parent)
    assert patch == {
        "grpo": {"lr": {"direction": "lower", "max": 1e-4},
                 "kl_coef": {"direction": "raise", "min": 0.01}, "kl_estimator": "k1"},
        "reward": {"components": [{"name": "format",
                                   "weight": {"direction": "raise", "min": 0.1}}]},
        "group_filter": {"set": {"name": "zero_std"}}}


def test_a_created_skill_with_its_evidence_is_shared_and_retrieved_in_another_workspace(
        promoted, tmp_path):
    library = library_repo(tmp_path / "library", "kl-cap")
    ws = use_library(promoted.root, repo="../library")
    proposed = propose_skill(ws, "v1")
    git.Repo(ws.root).git.merge(proposed["branch"], env=ENV)
    shared = share_evidence(ws)
    assert shared["skills"] == ["skills/v1-grpo-lr.yaml"]
    library.git.merge(shared["branch"], env=ENV)
    lib_skill = yaml.safe_load((tmp_path / "library" / "skills" / "v1-grpo-lr.yaml").read_text())
    assert [e["version"] for e in lib_skill["evidence"]] == ["arith-demo/v1"]
    load_skill(tmp_path / "library" / "skills" / "v1-grpo-lr.yaml")  # a valid skill

    from evotrainer.control.scaffold import init_workspace
    other = use_library(init_workspace(tmp_path / "other", "arith"), repo="../library")
    found = retrieve(other, Query(alerts=("dead_groups",), domain="arith"), limit=50)
    assert any(r.kind == "skill" and r.title == "v1-grpo-lr" and
               r.cite().startswith("skill library ../library@main, skill v1-grpo-lr")
               for r in found)
