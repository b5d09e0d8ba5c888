"""The paper's recorded decisions, replayed (tests/paper_lineages.py): each lineage's versions
train through reconcile (a stand-in engine writing rollouts at the paper's figures), the
built-in harness diagnoses and gates each, the rules planner proposes the next step at the
points where the paper records one, and `evotrainer harness backtest` replays the record with
the paper's verdicts as backtest cases. Where the project decides otherwise on purpose, the
case says why (EXPECTED)."""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import git
import pytest
import typer
import yaml
from paper_lineages import LINEAGES, PaperBackend
from typer.testing import CliRunner

from evotrainer.agent.planners.base import PlannerResult, View
from evotrainer.agent.planners.rules import RulesPlanner
from evotrainer.backends import BACKEND_TYPES
from evotrainer.commands.harness import register
from evotrainer.control.reconcile import Reconciler
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import approve, new_version
from evotrainer.diagnosis.catalogue import catalogue
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import parse_harness
from evotrainer.evidence.io import read_rollouts
from evotrainer.report import build_report
from evotrainer.skills.replay import version_rollouts
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.lineage import lineage_rows
from evotrainer.store.workspace import Workspace

# The paper's verdict at each version, as the built-in gate records it: (verdict, why) where
# `why` is None when it is the paper's decision and otherwise says why the project differs.
# "block": pruned by a critical behaviour alert whatever the score.
WITHIN_CI = ("the paper promoted it on one seed; its gain is inside the paired CI the "
             "paper's own reported interval implies (about ±1.9pp over 77 tasks), so the "
             "gate waits for more evidence and keeps the parent as the reference")
EXPECTED: dict[str, dict[str, tuple[str, str | None]]] = {
    "swe9b": {
        "v1-leak": ("block", None),  # rejected: it read the fix through git history
        "v1": ("inconclusive", "the paper kept the clean re-run as its baseline; +0.85pp over "
               "the base model is no evidence that it beats it, so v0 stays the reference"),
        "v2": ("inconclusive", WITHIN_CI),
        "v3": ("inconclusive", "the paper's saturating score-only path (+0.44pp); "
               + WITHIN_CI),
        "v4": ("promote", None),  # kept despite DGR 50%: dead groups name the next fix
        "v8": ("inconclusive", "+1.86pp over v4 on one seed; the paper's significant claims "
               "for v8 are against the base model and human RL, not against v4"),
    },
    "swe4b": {
        "v4": ("promote", None),
        # Recorded under h1 the echo-trapped branch is promoted, as the paper's score-only
        # reading would; h2's behaviour audit prunes it (test below).
        "v5-echo": ("promote", "recorded under h1, whose echo-trap alert is a warning; "
                    "h2 prunes it (behaviour_degeneration)"),
        "v9": ("block", None),  # the efficiency branch collapses: abandonment
        "v10": ("block", None),  # so does the second one
        "v11": ("inconclusive", None),  # the control survives: not pruned
    },
    "math": {
        "v2": ("inconclusive", "the length-budget repair took truncation from 18% to 2%; "
               "+1.6pp is inside the CI, so the paper's kept step is a reference the gate "
               "does not promote"),
        "v5": ("promote", None),
        "v7": ("inconclusive", "third parties dispute the Math StdGroupFilter gain: +0.96pp "
               "is inside the CI"),
    },
    "coding": {
        "v3": ("inconclusive", "the measurement repair moved the score -1.2pp, inside the CI"),
        "v8": ("inconclusive", "its parent v3 never reached main, so v8 is decided against "
               "main's v0 with the family correction: +2.3pp, its 97.5% CI touching 0; the "
               "paper built on v3 by judgment"),
        "v9": ("promote", None),  # the line v3 -> v8 -> v9 lands: +3.5pp over main's v0
        "v10": ("inconclusive", "+1.08pp; the paper's own test of the final Coding version "
                "against human RL is not significant either (p = 0.142)"),
    },
}

# Where the paper records the next intervention: (after which version, the skill the rules
# planner proposes, whether it is its first skill proposal, why not when it is not). After
# the root (the base model, untrained) the planner first proposes training its recipe as
# is, as the paper's first versions did; its first skill proposal is the paper's step.
NEXT: dict[str, list[tuple[str, str, bool, str | None]]] = {
    "swe9b": [("v1-leak", "close-leak", True, None),
              ("v4", "instruction-following-judge", True, None)],
    "swe4b": [],
    "math": [("v0", "raise-length-budget", True, None),
             ("v5", "std-group-filter", True, None)],
    "coding": [("v0", "raise-length-budget", True, None),
               ("v3", "shaped-correctness", True, None),
               ("v8", "std-group-filter", False,
                "v8 is inconclusive against main's v0, so proposals fork from v0, where "
                "shaped-correctness comes first again; std-group-filter follows it"),
               ("v9", "dual-level-filter", True, None)],
}


@dataclass
class Replay:
    ws: Workspace
    plans: dict[str, PlannerResult] = field(default_factory=dict)


def _project(root: Path, name: str) -> None:
    """The lineage's domain (and, for SWE-9B, its declared IF judge) on main, harness h1."""
    lineage = LINEAGES[name]
    path = root / "spec" / "project.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["harness"] = "h1"
    doc["recipe"]["domain"] = {"name": lineage.domain, "train_size": 8, "val_size": 4}
    doc["recipe"]["grpo"].update(steps=1, eval_k=8)
    if name == "swe9b":
        doc["recipe"]["reward"] = {
            "components": [{"name": "correctness", "weight": 1.0}],
            "judges": [{"name": "if", "preset": "instruction_following",
                        "endpoint": "http://127.0.0.1:9/v1", "model": "judge"}]}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    repo = git.Repo(root)
    repo.git.add("spec/project.yaml")
    repo.git.commit("-m", f"the paper's {name} setting", env={
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})


def _replay(tmp: Path, name: str) -> Replay:
    lineage = LINEAGES[name]
    checkpoints = {after for after, *_ in NEXT[name]}
    root = init_workspace(tmp / name, "arith")
    _project(root, name)
    ws = Workspace(root)
    approve(ws, "v0", by="tester")
    replay = Replay(ws)

    def converge_and_plan(version: str) -> None:
        Reconciler(ws, log=lambda _: None, backends={"local": PaperBackend()}).run(
            wait=True, poll_s=0.05)
        if version in checkpoints:
            replay.plans[version] = RulesPlanner().propose(View.load(ws), 4)

    converge_and_plan("v0")
    for version, case in lineage.versions.items():
        if case.parent is None:
            continue
        new_version(ws, version, case.parent, rationale=case.note, skills=list(case.skills),
                    settings=list(case.settings))
        approve(ws, version, by="tester")
        converge_and_plan(version)
    return replay


@pytest.fixture(scope="module")
def replays(tmp_path_factory) -> dict[str, Replay]:
    tests = str(Path(__file__).resolve().parent)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(
            [tests, *filter(None, [os.environ.get("PYTHONPATH")])]))
        mp.setitem(BACKEND_TYPES, "local", PaperBackend)
        for name in LINEAGES:
            mp.setenv("PAPER_LINEAGE", name)
            out[name] = _replay(tmp_path_factory.mktemp("paper"), name)
    return out


def _metrics(ws: Workspace, version: str) -> dict:
    return {k: (v or {}).get("value")
            for k, v in ws.version(version).records["diagnosis"]["metrics"].items()}


def _passes(expect: str, decision: dict) -> bool:
    if expect == "block":
        return decision["verdict"] == "prune" and bool(decision["blocked_by"])
    return decision["verdict"] == expect and not decision["blocked_by"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_recorded_decision_is_the_papers_or_says_why(replays, name):
    ws = replays[name].ws
    for version, (expect, why) in EXPECTED[name].items():
        decision = ws.version(version).records["decision"]
        assert _passes(expect, decision), (name, version, decision["verdict"], decision["reason"])
        assert why is None or len(why) > 20  # a divergence is explained, not waved through


def test_the_report_labels_each_interval_at_its_recorded_confidence(replays, tmp_path):
    """Coding v8 is decided against main's v0 beside its parent, two comparisons at alpha/2:
    its lineage row and the report's table call its interval 97.5%, and v3's, one comparison,
    95%."""
    ws = replays["coding"].ws
    rows = {row.name: row for row in lineage_rows(ws)}
    assert rows["v8"].against == "v0" and rows["v8"].confidence == pytest.approx(0.975)
    assert rows["v3"].confidence == pytest.approx(0.95)
    table = build_report(ws, tmp_path / "report").read_text()
    table = table[table.index("<h2>Versions</h2>"):]
    for name, label in (("v8", "97.5% CI"), ("v3", "95% CI")):
        cells = re.search(rf'versions/{name}\.html.*?</tr>', table, re.S)
        assert cells is not None and label in cells.group(0), name


def test_the_rollouts_read_the_papers_figures(replays):
    swe9b, swe4b = replays["swe9b"].ws, replays["swe4b"].ws
    assert _metrics(swe9b, "v1")["dead_group_ratio"] == pytest.approx(0.55)
    assert _metrics(swe9b, "v1-leak")["leak_ratio"] > 0
    assert _metrics(swe9b, "v4")["dead_group_ratio"] == pytest.approx(0.5)
    assert _metrics(swe9b, "v8")["dead_group_ratio"] == pytest.approx(0.275)
    echo, parent = _metrics(swe4b, "v5-echo"), _metrics(swe4b, "v4")
    assert echo["turns_mean"] == pytest.approx(76.3, abs=0.05)
    assert parent["turns_mean"] == pytest.approx(36.5, abs=0.05)
    assert echo["echo_trap_ratio"] == pytest.approx(0.25)
    assert echo["echo_trap_ratio"] / parent["echo_trap_ratio"] == pytest.approx(194 / 23, rel=0.1)
    assert _metrics(swe4b, "v9")["turns_mean"] < 5
    math = replays["math"].ws
    assert _metrics(math, "v0")["truncation_rate"] == pytest.approx(0.18)
    assert _metrics(math, "v5")["dead_group_ratio"] == pytest.approx(0.21)
    assert _metrics(math, "v7")["dead_group_ratio"] == pytest.approx(0.13)
    # MidBand and ADiv are catalogue metrics: read with h2 plus the two entries.
    doc = yaml.safe_load((builtin_dir("harness_revisions") / "h2.yaml").read_text())
    doc["metrics"] += [copy.deepcopy(e.metric) for e in catalogue()
                       if e.metric["name"] in ("mid_band_mass", "advantage_diversity")]
    glossary = parse_harness(doc, source="h2+glossary")
    coding = replays["coding"].ws

    def read(version: str) -> dict:
        table = read_rollouts(version_rollouts(coding, version).parent)
        return diagnose(table, None, glossary)["metrics"]

    v8, v10 = read("v8"), read("v10")
    assert (v8["mid_band_mass"], v8["dead_group_ratio"]) == (pytest.approx(0.34),
                                                             pytest.approx(0.31))
    assert (v10["dead_group_ratio"], v10["advantage_diversity"]) == (pytest.approx(0.18),
                                                                     pytest.approx(0.63))


@pytest.mark.parametrize("name", [n for n in sorted(NEXT) if NEXT[n]])
def test_the_rules_planner_proposes_the_papers_next_step(replays, name):
    for after, skill, first, why in NEXT[name]:
        proposals = replays[name].plans[after].proposals
        if LINEAGES[name].versions[after].parent is None:
            assert (proposals[0].skills, proposals[0].settings) == ([], [])
            assert "untrained" in proposals[0].rationale
        proposed = [p.skills for p in proposals if p.skills]
        if first:
            assert proposed[0] == [skill], (name, after, proposed)
        else:
            assert [skill] in proposed and why, (name, after, proposed)


def test_the_if_judge_is_proposed_from_its_backtest(replays):
    plan = replays["swe9b"].plans["v4"]
    judge = plan.proposals[0]
    backtest = judge.proposal["backtest"]
    assert backtest["component"] == "judge:if" and backtest["weight"] == pytest.approx(0.1)
    # The paper's backtest on v4 data: 20 of 40 groups CR-dead, 9 of them rescued (45%).
    assert (backtest["groups"], backtest["dead_groups_before"]) == (40, 20)
    assert backtest["rescued_groups"] == 9 and backtest["rescue_ratio"] == pytest.approx(0.45)
    assert judge.proposal["changes"] == [{"key": "reward.components[judge:if].weight",
                                          "before": None, "after": 0.1, "direction": "raise"}]


def test_coding_shaped_correctness_patches_pass_fraction(replays):
    shaped = replays["coding"].plans["v3"].proposals[0]
    keys = {c["key"]: c["after"] for c in shaped.proposal["changes"]}
    assert keys == {"reward.components[correctness].weight": 0.5,
                    "reward.components[pass_fraction].weight": 0.5}
    assert shaped.proposal["backtest"]["component"] == "pass_fraction"
    assert shaped.proposal["backtest"]["rescued_groups"] > 0


def test_the_echo_branch_declines_the_toxic_efficiency_reward(replays):
    # The paper's counterfactual: both efficiency branches collapse (v9, v10: abandonment,
    # blocked), the control survives; the library holds the efficiency factor as negative.
    plan = RulesPlanner().propose(View.load(replays["swe4b"].ws), 3)
    assert any("declined efficiency-multiplier" in note for note in plan.notes)
    assert all("efficiency-multiplier" not in p.skills for p in plan.proposals)


@pytest.fixture(scope="module")
def harness_cli():
    app = typer.Typer()
    register(app)
    runner = CliRunner()

    def run(ws: Workspace, *args: str):
        cwd = os.getcwd()
        os.chdir(ws.root)
        try:
            return runner.invoke(app, ["harness", *args], env={"COLUMNS": "200"})
        finally:
            os.chdir(cwd)

    return run


def _with_cases(ws: Workspace, name: str, lineage: str) -> None:
    """h2 with the lineage's decisions as backtest cases, in the workspace."""
    doc = yaml.safe_load((builtin_dir("harness_revisions") / "h2.yaml").read_text())
    cases = dict(EXPECTED[lineage])
    if lineage == "swe4b":
        cases["v5-echo"] = ("prune", None)  # the behaviour audit's verdict: the paper's
    doc.update(name=name, parent="h2", backtest_cases=[
        {"version": v, "expect": e, **({"why": why} if why else {})}
        for v, (e, why) in cases.items()])
    (ws.root / "harness_revisions" / f"{name}.yaml").write_text(yaml.safe_dump(doc))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_lineage_replays_through_harness_backtest(replays, harness_cli, name):
    ws = replays[name].ws
    _with_cases(ws, f"paper-{name}", name)
    shown = harness_cli(ws, "backtest", f"paper-{name}", "--against", "h1", "--json")
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.output)
    assert report["passed"] and len(report["cases"]) == len(EXPECTED[name])
    flipped = [(r["version"], r["verdict_before"], r["verdict_after"])
               for r in report["versions"] if r["flip"]]
    assert flipped == ([("v5-echo", "promote", "prune")] if name == "swe4b" else [])


def test_harness_diff_shows_the_echo_branch_is_the_one_decision_h2_flips(replays, harness_cli):
    ws = replays["swe4b"].ws
    for old in ("h0", "h1"):
        shown = harness_cli(ws, "diff", old, "h2", "--json")
        assert shown.exit_code == 0, shown.output
        diff = json.loads(shown.output)
        assert "behaviour_degeneration" in diff["gate_rules"]["added"]
        [flip] = diff["changed_verdicts"]
        assert (flip["version"], flip["verdict_before"], flip["verdict_after"]) == (
            "v5-echo", "promote", "prune")
        assert flip["after"]["rule"] == "behaviour_degeneration"
