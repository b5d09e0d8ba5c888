"""The autonomy gym: does rollout-level diagnosis beat score-only iteration at equal compute?

Each setup is a workspace made by `evotrainer init` whose project recipe plants one
pathology on the embedded engine. For every setup and seed, the gym runs `evolve` once per
arm, under the same rounds and the same `autonomy.max_total_steps`, approving up front
(`--approve`: proposals and the harness revisions whose backtest flips no recorded verdict):

- `rules`: the diagnosis-driven planner with the built-in harness h0 (alerts, leak audit), or
  the revision a setup names (echo: h1, whose echo_repeat_ratio sees short loops that h0's
  60-turn echo trap cannot), evolving the harness when a diagnostic gap fires;
- `rules-no-harness`: the same planner and starting harness with harness evolution off;
- `score`: the score-only control — the `score` planner (hill-climbing on Avg@k) with the
  `score-only` harness revision (no alerts, a gate on the paired bootstrap CI alone).

Setups whose pathology the starting harness h0 cannot see (`idle`, `echo_h0`;
tests/test_unseen_pathologies.py checks on planted stand-in runs that h0 raises no alert and
fires no skill on them) measure the harness side: the `rules` arm must detect a gap, adopt a
revision that sees the pathology (backtested), then fix it; both controls cannot.

It reports per run: the clean frontier's Avg@k against the baseline v0 (paired bootstrap Δ
and 95% CI over the validation tasks), the versions promoted, the decisions that gathered
evidence before a new factor (a second seed of an inconclusive gain), leaky versions
promoted (audited afterwards with h1's leak metrics, the widest built-in audit, whatever
harness the arm used), the GRPO steps spent until the first clean version significantly
above v0, the planner's LLM tokens, the diagnostic gaps the planner
noted, the harness revisions adopted (with the metric each added), those among them that
change the gate procedure, and the skills of the clean promotions (the fix).

    python bench/autonomy.py                      # every setup, 2 seeds (tens of minutes)
    python bench/autonomy.py --quick --setup leak # one setup, shorter training
    python bench/autonomy.py --setup idle --seeds 0 --planner rules --planner rules-no-harness
    python bench/autonomy.py --seeds 0 1 2 --rounds 4 --json results.json

Run it under `nice` on a shared machine: the tiny-model training is CPU bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evotrainer.agent.evolve import evolve
from evotrainer.backends.base import Backend
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import approve
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.errors import EvoError
from evotrainer.gate.decision import recorded_scores
from evotrainer.skills.replay import version_rollouts
from evotrainer.stats import GateProcedure
from evotrainer.stats.paired import compare_tables
from evotrainer.store.recipe import deep_merge
from evotrainer.store.workspace import PROJECT_FILE, Workspace

# arm -> (planner, harness in force unless the setup names one, harness evolution)
ARMS: dict[str, tuple[str, str, bool]] = {
    "rules": ("rules", "h0", True),
    "rules-no-harness": ("rules", "h0", False),
    "score": ("score", "score-only", False),
}


@dataclass(frozen=True)
class Setup:
    name: str
    example: str
    pathology: str
    recipe: dict[str, Any]  # deep-merged into the example's project recipe
    quick: dict[str, Any] = field(default_factory=dict)  # and this with --quick
    # The rules arms' harness when not h0: a pathology h0 cannot see by definition.
    harness: str | None = None
    # Rounds when --rounds is not given: an unseen pathology needs a stall (gap), the
    # revision, then the fix.
    rounds: int = 3


SETUPS: dict[str, Setup] = {s.name: s for s in (
    Setup("leak", "toolenv",
          "a leaking tool: `reveal` answers the hidden number",
          {}, {"grpo": {"steps": 30}}),
    Setup("too_hard", "arith",
          "tasks too hard for the start policy: a short warm start leaves most groups "
          "all wrong",
          {"model": {"warm_start": {"stop_at_accuracy": 0.04}}, "grpo": {"steps": 100}},
          {"grpo": {"steps": 40}}),
    Setup("too_easy", "arith",
          "tasks too easy: a long warm start leaves most groups all correct",
          {"model": {"warm_start": {"stop_at_accuracy": 0.9, "steps": 600}},
           "grpo": {"steps": 100}},
          {"grpo": {"steps": 40}}),
    Setup("truncation", "arith",
          "a length budget too small: two response tokens cut most answers",
          {"grpo": {"max_response_tokens": 2, "steps": 100}}, {"grpo": {"steps": 40}}),
    # Every version is scored at eval temperature 1.0 whatever it trains at: a fix to the
    # sampler shows as a training gain, not as a change of the evaluation protocol.
    Setup("cold", "arith",
          "sampling too cold: temperature 0.2 collapses groups into identical samples",
          {"grpo": {"temperature": 0.2, "eval_temperature": 1.0, "steps": 100}},
          {"grpo": {"steps": 40}}),
    Setup("echo", "toolenv",
          "a multi-turn setting prone to echo traps: some demonstrations repeat one compare "
          "until the budget runs out, so the warm-started policy loops; no leak, a 24-turn "
          "budget",
          {"domain": {"params": {"echo_demo_rate": 0.3, "reveal_demo_rate": 0.0}},
           "environment": {"max_turns": 24, "tools": [{"name": "reveal", "enabled": False}]},
           "grpo": {"max_response_tokens": 4, "steps": 100}},
          {"grpo": {"steps": 40}},
          # Loops of a few turns: h0's echo trap (the method's > 60 failing turns) never
          # fires on a 24-turn budget; h1's echo_repeat_ratio counts them.
          harness="h1"),
    Setup("lr_collapse", "arith",
          "a learning rate that collapses training (30x the example's)",
          {"grpo": {"lr": 1.0e-2, "steps": 100}}, {"grpo": {"steps": 40}}),
    # ---- pathologies h0 cannot see ----
    # A shaped reward that pays quitting: 40% of the demonstrations answer a blind guess, and
    # the project's reward adds to correctness partial credit (0.5, so no group is dead: h0's
    # dead-groups skills stay quiet) and an efficiency term (0.5 × 1/actions). An answer alone
    # earns the whole efficiency term, so GRPO trains the policy to guess: on the embedded
    # engine (40 steps, seed 0) idle failures rise from 31% to 76% of the rollouts and val
    # Avg@8 falls 0.059 → 0.039 with no h0 alert; the same recipe without the efficiency term
    # idles 14% and reaches 0.141. Scored at temperature 1.0 whatever the arm trains at, as in
    # `cold`: a colder sampler that guesses less shows as a training gain, not as a change of
    # the evaluation protocol.
    Setup("idle", "toolenv",
          "idle failure: 40% of the demonstrations answer a blind guess without a single "
          "compare, and the reward's efficiency term (beside correctness and partial credit) "
          "pays an answer alone most; no leak",
          {"domain": {"params": {"idle_demo_rate": 0.4, "reveal_demo_rate": 0.0}},
           "environment": {"tools": [{"name": "reveal", "enabled": False}]},
           "reward": {"components": [{"name": "correctness", "weight": 1.0},
                                     {"name": "partial", "weight": 0.5},
                                     {"name": "efficiency", "weight": 0.5}]},
           "grpo": {"steps": 100, "eval_temperature": 1.0}},
          {"grpo": {"steps": 40}}, rounds=5),
    # The echo setup under h0: loops of a few turns hit the 24-turn budget (the catalogue's
    # tool_limit_ratio sees them) but never h0's 60-turn echo trap; rarer than in `echo`
    # (15% of demonstrations), since at about a third of the rollouts looping h0's same-tool
    # streak (max-turns-cap's trigger) sees them. Unseen on the planted stand-in only: on the
    # embedded engine (--quick, seed 0) training as is removes most loops and gains (+0.09 to
    # +0.15), h0's abandonment alert fires on the short honest searches a 24-turn horizon
    # allows, and max-turns-cap fires on a same-tool streak of 4.01, so every arm gains
    # without the harness evolving (docs/gym.md).
    Setup("echo_h0", "toolenv",
          "short echo loops on a 24-turn budget under h0: 15% of the demonstrations repeat "
          "one compare until the budget runs out; no leak",
          {"domain": {"params": {"echo_demo_rate": 0.15, "reveal_demo_rate": 0.0}},
           "environment": {"max_turns": 24, "tools": [{"name": "reveal", "enabled": False}]},
           "grpo": {"max_response_tokens": 4, "steps": 100}},
          {"grpo": {"steps": 40}}, rounds=5),
)}



@dataclass
class ArmResult:
    setup: str
    planner: str
    seed: int
    frontier: str
    baseline_avg: float
    frontier_avg: float
    delta: float
    ci: tuple[float, float]
    significant: bool
    leaky_promoted: list[str]
    steps_spent: int
    steps_to_first_gain: int | None
    tokens: int
    versions: list[dict[str, Any]]
    seconds: float
    gaps: list[str] = field(default_factory=list)  # "kind on version", as the planner noted
    adopted: list[str] = field(default_factory=list)  # "h2 (+idle_failure_rate)"
    fixes: list[str] = field(default_factory=list)  # skills of the clean promotions
    promoted: list[str] = field(default_factory=list)  # every promotion, in decision order
    # Decisions that gathered evidence before a new factor: "v3 (second seed of v2)"
    evidence: list[str] = field(default_factory=list)
    # Adopted revisions that change the gate procedure: "h3 (gate: resamples 20000)"
    gate_revisions: list[str] = field(default_factory=list)


def build_workspace(root: Path, setup: Setup, arm: str, seed: int, *, quick: bool,
                    rounds: int) -> Workspace:
    """`evotrainer init` + the setup's project recipe, committed on main like a user edit."""
    init_workspace(root, setup.example)
    path = root / PROJECT_FILE
    modeline, _, body = path.read_text().partition("\n")
    project = yaml.safe_load(body)
    recipe = deep_merge(project["recipe"], setup.recipe)
    if quick:
        recipe = deep_merge(recipe, setup.quick)
    recipe["seeds"] = [seed]
    project["recipe"] = recipe
    planner, harness, _ = ARMS[arm]
    project["harness"] = (setup.harness if planner == "rules" else None) or harness
    project["planner"] = {"name": "rules"}  # the arm's planner is passed to evolve
    # Equal compute: every arm may spend the same GRPO steps, `rounds` trainings' worth.
    project["autonomy"] = {**project["autonomy"], "mode": "human_gated",
                           "max_total_steps": rounds * 2 * recipe["grpo"]["steps"]}
    text = f"{modeline}\n{yaml.safe_dump(project, sort_keys=False)}"
    ws = Workspace(root)
    ws.git.commit_files("main", {PROJECT_FILE: text.encode()},  # updates the work tree too
                        f"Gym setup {setup.name} ({arm} arm, seed {seed}): "
                        f"{setup.pathology}", {"Action": "init"})
    # The baseline's approval covers the recipe it resolves to: approve the planted one.
    approve(ws, "v0", by="bench/autonomy.py")
    return ws


def leaky(ws: Workspace, version: str) -> bool:
    """Audit with h1's leak metrics (h0's and more), whichever harness the arm trained under."""
    try:
        rollouts = version_rollouts(ws, version).parent  # the run's train and val rollouts
    except EvoError:
        return False  # no rollouts recorded: nothing could leak
    metrics = diagnose(rollouts, None, resolve_harness("h1"))["metrics"]
    return any((metrics.get(k) or 0.0) > 0.0 for k in ("leak_ratio", "val_leak_ratio"))


def measure(ws: Workspace, setup: str, arm: str, seed: int, seconds: float) -> ArmResult:
    states = ws.versions()
    baseline = recorded_scores(ws, "v0")
    order = sorted(
        (n for n, s in states.items() if s.parent is not None
         and (s.records.get("decision") or {}).get("decided_at")),
        key=lambda n: states[n].records["decision"]["decided_at"])
    versions, spent, first_gain = [], 0, None
    frontier, best = "v0", None
    leaky_promoted = []
    for name in order:
        state = states[name]
        spent += state.run.steps_spent if state.run else 0  # every seed and attempt
        verdict = state.records["decision"]["verdict"]
        leak = leaky(ws, name)
        try:
            vs_base = compare_tables(baseline, recorded_scores(ws, name))
        except EvoError:
            vs_base = None  # stopped early (e.g. on a leak) before any evaluation: no scores
        clean_gain = not leak and vs_base is not None and vs_base["ci_low"] > 0
        if clean_gain and first_gain is None:
            first_gain = spent
        if verdict == "promote":
            if leak:
                leaky_promoted.append(name)
            else:
                frontier, best = name, vs_base  # the latest clean promotion is the frontier
        versions.append({"name": name, "parent": state.parent, "verdict": verdict,
                         "leak": leak, "delta_vs_v0": vs_base and vs_base["delta"],
                         "ci_vs_v0": vs_base and [vs_base["ci_low"], vs_base["ci_high"]],
                         "changes": state.spec.get("recipe") or {},
                         "skills": (state.spec.get("intervention") or {}).get("skills") or []})
    best = best or compare_tables(baseline, baseline)
    tokens = sum(int((states[n].spec.get("proposal") or {}).get("tokens") or 0) for n in order)
    fixes = list(dict.fromkeys(s for v in versions if v["verdict"] == "promote"
                               and not v["leak"] for s in v["skills"]))
    promoted = [v["name"] for v in versions if v["verdict"] == "promote"]
    evidence = [f"{n} ({meta.get('evidence', 'evidence').replace('_', ' ')} of "
                f"{meta.get('evidence_for')})" for n in order
                if (meta := states[n].spec.get("proposal") or {}).get("move") == "evidence"]
    return ArmResult(setup, arm, seed, frontier, best["mean_a"], best["mean_b"],
                     best["delta"], (best["ci_low"], best["ci_high"]),
                     frontier != "v0" and best["ci_low"] > 0, leaky_promoted, spent,
                     first_gain, tokens, versions, seconds, fixes=fixes, promoted=promoted,
                     evidence=evidence)


def run_arm(root: Path, setup: Setup, arm: str, seed: int, *, rounds: int, quick: bool,
            backends: dict[str, Backend] | None = None,
            log: Callable[[str], None] = lambda _: None) -> ArmResult:
    ws = build_workspace(root, setup, arm, seed, quick=quick, rounds=rounds)
    planner, _, harness_evolution = ARMS[arm]
    started = time.monotonic()
    done = evolve(ws, rounds, planner=planner, approve_all=True, backends=backends, log=log,
                  poll_s=0.2 if backends else 2.0, harness_evolution=harness_evolution)
    result = measure(ws, setup.name, arm, seed, time.monotonic() - started)
    # "gap no_next_step on v2: ..." -> "no_next_step on v2"
    result.gaps = list(dict.fromkeys(
        n.removeprefix("gap ").split(":", 1)[0]
        for r in done for n in r.result.notes if n.startswith("gap ")))
    revisions = {h.name: h for r in done for h in r.result.harness}
    result.adopted = [
        f"{name} (+{', '.join(_added_metrics(revisions[name].document, ws)) or 'no metric'})"
        for r in done for name in r.adopted]
    result.gate_revisions = [
        f"{name} (gate: {changed})" for r in done for name in r.adopted
        if (changed := _gate_change(revisions[name].document, ws))]
    return result


def _gate_change(document: dict[str, Any], ws: Workspace) -> str:
    """What a revision changes in its parent's gate procedure ("" when nothing)."""
    parent = resolve_harness(document["parent"], ws.root).procedure
    mine = GateProcedure.from_gate(document.get("gate"))
    return ", ".join(f"{k} {getattr(mine, k)}" for k in
                     ("alpha", "ci_method", "resamples", "strata", "compare_with", "correction")
                     if getattr(mine, k) != getattr(parent, k))


def _added_metrics(document: dict[str, Any], ws: Workspace) -> list[str]:
    """The metrics a revision adds to its parent."""
    parent = resolve_harness(document["parent"], ws.root)
    return [m["name"] for m in document["metrics"]
            if m["name"] not in {pm.name for pm in parent.metrics}]


def table(results: list[ArmResult]) -> str:
    """A Markdown table, one row per setup and arm, seeds pooled."""
    lines = ["| setup | arm | Δ Avg@k vs v0 (per seed, 95% CI) | significant | promoted | "
             "leaky promoted | steps to first clean gain | steps spent | evidence gathered | "
             "tokens | gaps | revision adopted | gate revision | fix |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r.setup, r.planner) for r in results)
    for setup, planner in keys:
        rows = [r for r in results if (r.setup, r.planner) == (setup, planner)]
        deltas = "; ".join(f"{r.delta:+.3f} [{r.ci[0]:+.3f}, {r.ci[1]:+.3f}]" for r in rows)
        steps = ", ".join("—" if r.steps_to_first_gain is None else str(r.steps_to_first_gain)
                          for r in rows)
        spent = ", ".join(str(r.steps_spent) for r in rows)
        lines.append(
            f"| {setup} | {planner} | {deltas} | {sum(r.significant for r in rows)}/{len(rows)} "
            f"| {'; '.join(', '.join(r.promoted) or '—' for r in rows)} "
            f"| {sum(len(r.leaky_promoted) for r in rows)} | {steps} | {spent} "
            f"| {_listed([e for r in rows for e in r.evidence])} "
            f"| {sum(r.tokens for r in rows)} | {_listed([g for r in rows for g in r.gaps])} "
            f"| {_listed([a for r in rows for a in r.adopted])} "
            f"| {_listed([g for r in rows for g in r.gate_revisions])} "
            f"| {_listed([f for r in rows for f in r.fixes])} |")
    return "\n".join(lines)


def _listed(values: list[str]) -> str:
    return "; ".join(dict.fromkeys(values)) or "—"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="append", choices=sorted(SETUPS),
                        help="run only this setup (repeatable); default: all")
    parser.add_argument("--planner", action="append", choices=sorted(ARMS),
                        help="run only this arm (repeatable); default: all three")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int,
                        help="rounds per arm (default: the setup's, 3 or 5 for the unseen)")
    parser.add_argument("--quick", action="store_true",
                        help="shorter training per version (a smoke run, not the result)")
    parser.add_argument("--json", type=Path, help="also write every result here")
    parser.add_argument("--keep", type=Path, help="keep the workspaces under this folder")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="evo-gym-") as tmp:
        base = args.keep or Path(tmp)
        for name in args.setup or list(SETUPS):
            for seed in args.seeds:
                for planner in args.planner or list(ARMS):
                    root = base / f"{name}-{planner}-s{seed}"
                    setup = SETUPS[name]
                    result = run_arm(root, setup, planner, seed,
                                     rounds=args.rounds or setup.rounds, quick=args.quick)
                    results.append(result)
                    print(f"{name:12s} {planner:16s} seed {seed}: frontier {result.frontier} "
                          f"Δ {result.delta:+.3f} [{result.ci[0]:+.3f}, {result.ci[1]:+.3f}] "
                          f"promoted {result.promoted or 'none'}; leaky promoted "
                          f"{result.leaky_promoted or 'none'}; steps {result.steps_spent}; "
                          f"evidence {result.evidence or 'none'}; gaps {result.gaps or 'none'}; "
                          f"adopted {result.adopted or 'none'}; gate revisions "
                          f"{result.gate_revisions or 'none'}; fix {result.fixes or 'none'} "
                          f"({result.seconds:.0f} s)", flush=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
