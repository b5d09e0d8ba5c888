"""The autonomy gym: does rollout-level diagnosis beat score-only iteration at equal compute?

Each setup is a workspace made by `evotrainer init` whose project recipe plants one
pathology on the embedded engine. For every setup and seed, the gym runs `evolve` twice,
under the same rounds and the same `autonomy.max_total_steps`:

- `rules`: the diagnosis-driven planner with the built-in harness h0 (alerts, leak audit), or
  the revision a setup names (echo: h1, whose echo_repeat_ratio sees short loops that h0's
  60-turn echo trap cannot);
- `score`: the score-only control — the `score` planner (hill-climbing on Avg@k) with the
  `score-only` harness revision (no alerts, a gate on the paired bootstrap CI alone).

It reports per run: the clean frontier's Avg@k against the baseline v0 (paired bootstrap Δ
and 95% CI over the validation tasks), leaky versions promoted (audited afterwards with h1's
leak metrics, the widest built-in audit, whatever harness the arm used), the GRPO steps spent
until the first clean
version significantly above v0, and the planner's LLM tokens.

    python bench/autonomy.py                      # every setup, 2 seeds (tens of minutes)
    python bench/autonomy.py --quick --setup leak # one setup, shorter training
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
from evotrainer.commands.init import init_workspace
from evotrainer.control.versions import approve
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.gate import recorded_scores
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.diagnosis.replay import version_rollouts
from evotrainer.diagnosis.stats import compare_tables
from evotrainer.errors import EvoError
from evotrainer.store.recipe import deep_merge
from evotrainer.store.workspace import PROJECT_FILE, Workspace

ARMS: dict[str, str] = {"rules": "h0", "score": "score-only"}  # planner -> harness in force


@dataclass(frozen=True)
class Setup:
    name: str
    example: str
    pathology: str
    recipe: dict[str, Any]  # deep-merged into the example's project recipe
    quick: dict[str, Any] = field(default_factory=dict)  # and this with --quick
    # The `rules` arm's harness when not h0: a pathology h0 cannot see by definition.
    harness: str | None = None


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


def build_workspace(root: Path, setup: Setup, planner: str, seed: int, *, quick: bool,
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
    project["harness"] = (setup.harness if planner == "rules" else None) or ARMS[planner]
    project["planner"] = {"name": "rules"}  # the arm's planner is passed to evolve
    # Equal compute: every arm may spend the same GRPO steps, `rounds` trainings' worth.
    project["autonomy"] = {**project["autonomy"], "mode": "human_gated",
                           "max_total_steps": rounds * 2 * recipe["grpo"]["steps"]}
    text = f"{modeline}\n{yaml.safe_dump(project, sort_keys=False)}"
    ws = Workspace(root)
    ws.git.commit_files("main", {PROJECT_FILE: text.encode()},  # updates the work tree too
                        f"Gym setup {setup.name} ({planner} arm, seed {seed}): "
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


def measure(ws: Workspace, setup: str, planner: str, seed: int, seconds: float) -> ArmResult:
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
        # The steps the run really trained (an early-stopped run spends fewer than its recipe
        # asks), every attempt included: the unit `max_total_steps` budgets.
        spent += state.run.steps_spent if state.run else 0
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
    return ArmResult(setup, planner, seed, frontier, best["mean_a"], best["mean_b"],
                     best["delta"], (best["ci_low"], best["ci_high"]),
                     frontier != "v0" and best["ci_low"] > 0, leaky_promoted, spent,
                     first_gain, tokens, versions, seconds)


def run_arm(root: Path, setup: Setup, planner: str, seed: int, *, rounds: int, quick: bool,
            backends: dict[str, Backend] | None = None,
            log: Callable[[str], None] = lambda _: None) -> ArmResult:
    ws = build_workspace(root, setup, planner, seed, quick=quick, rounds=rounds)
    started = time.monotonic()
    evolve(ws, rounds, planner=planner, approve_all=True, backends=backends, log=log,
           poll_s=0.2 if backends else 2.0)
    return measure(ws, setup.name, planner, seed, time.monotonic() - started)


def table(results: list[ArmResult]) -> str:
    """A Markdown table, one row per setup and planner, seeds pooled."""
    lines = ["| setup | planner | Δ Avg@k vs v0 (per seed, 95% CI) | significant | "
             "leaky promoted | steps to first clean gain | tokens |",
             "|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r.setup, r.planner) for r in results)
    for setup, planner in keys:
        rows = [r for r in results if (r.setup, r.planner) == (setup, planner)]
        deltas = "; ".join(f"{r.delta:+.3f} [{r.ci[0]:+.3f}, {r.ci[1]:+.3f}]" for r in rows)
        steps = ", ".join("—" if r.steps_to_first_gain is None else str(r.steps_to_first_gain)
                          for r in rows)
        lines.append(
            f"| {setup} | {planner} | {deltas} | {sum(r.significant for r in rows)}/{len(rows)} "
            f"| {sum(len(r.leaky_promoted) for r in rows)} | {steps} "
            f"| {sum(r.tokens for r in rows)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="append", choices=sorted(SETUPS),
                        help="run only this setup (repeatable); default: all")
    parser.add_argument("--planner", action="append", choices=sorted(ARMS),
                        help="run only this arm (repeatable); default: both")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=3)
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
                    result = run_arm(root, SETUPS[name], planner, seed, rounds=args.rounds,
                                     quick=args.quick)
                    results.append(result)
                    print(f"{name:12s} {planner:6s} seed {seed}: frontier {result.frontier} "
                          f"Δ {result.delta:+.3f} [{result.ci[0]:+.3f}, {result.ci[1]:+.3f}] "
                          f"leaky promoted {result.leaky_promoted or 'none'} "
                          f"({result.seconds:.0f} s)", flush=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
