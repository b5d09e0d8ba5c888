"""The paper's version histories as recorded evidence: for each lineage (SWE-9B, SWE-4B, Math,
Coding) the versions whose decisions the paper records, each with synthetic train rollouts
whose harness metrics are the paper's figures and validation scores at the paper's Avg@k.

It is also a stand-in engine (`python -m paper_lineages RECIPE OUT VERSION`, through
`PaperBackend`): tests/standin_engine.py writes a run's files, then the rollouts and scores are
replaced by the version's case from `LINEAGES[$PAPER_LINEAGE]`. So reconcile ingests,
diagnoses and gates them as any run, and `evotrainer harness backtest` replays them.

Where the paper gives no figure the case says what it stands in for. Validation: each task is
scored over 8 samples; a child's per-task correct counts are its parent's, shifted to the
paper's score, plus a fixed spread of ±1-sample moves sized so the paired bootstrap's 95% CI
is about ±1.9pp over 77 tasks: the width of the paper's own reported CI (SWE-9B, +4.39,
[+2.61, +6.34]). The spread is the same for every version; the gate decides on it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import standin_engine
from standin import StandinBackend

from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.store.recipe import digest

SAMPLES = 8  # validation samples per task (Avg@8)
# Per-task delta variance in samples²: 2m/n with m ±1 pairs gives the paper's CI width.
DELTA_VARIANCE = 0.445
ECHO_TURNS = 200  # an echo-trapped rollout's length (the paper's alert: > 60 turns, wrong)


@dataclass(frozen=True)
class Case:
    """One version of a paper lineage: how it was made and what its rollouts show."""

    parent: str | None
    score: float  # validation Avg@k (fraction)
    groups: dict[str, int]  # group kind (GROUP_KINDS) -> number of train groups
    skills: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()
    turns: float | None = None  # mean turns (multi-turn lineages); None: single-turn
    echo: int = 0  # failing rollouts of ECHO_TURNS turns repeating one terminal call
    abandon: bool = False  # every rollout quits within 2 turns (bar a few that ran 12)
    leak: int = 0  # rollouts reading git history
    truncated: int = 0  # failing rollouts cut at the length budget
    note: str = ""  # the paper's reading this case encodes


@dataclass(frozen=True)
class Lineage:
    domain: str
    group_size: int
    tasks: int
    versions: dict[str, Case] = field(default_factory=dict)


def _group(kind: str, size: int) -> list[tuple[float, float, dict[str, float]]]:
    """(correct, reward, components) of each sample of a group of `kind`:
    solved / failed: all equal (dead) with equal auxiliary components;
    rescuable: all wrong, equal reward, but the IF judge and the shaped component vary;
    judged: a rescuable group once reward = CR + 0.1 IF (alive);
    half: half right (mid band, two rewards); shaped: all wrong, reward = 0.5 x pass fraction;
    fine / fine3: one right, rewards 4 / 3 distinct (shaped)."""
    idx = range(size)
    if kind == "solved":
        return [(1.0, 1.0, {"judge:if": 1.0, "pass_fraction": 1.0, "partial": 1.0})
                for _ in idx]
    if kind == "failed":
        return [(0.0, 0.0, {"judge:if": 1.0, "pass_fraction": 0.0, "partial": 0.0})
                for _ in idx]
    if kind in ("rescuable", "judged"):
        out = []
        for i in idx:
            judge = 0.0 if i % 3 == 1 else 1.0
            frac = (i % 4 + 1) / 5
            reward = 0.1 * judge if kind == "judged" else 0.0
            out.append((0.0, reward, {"judge:if": judge, "pass_fraction": frac,
                                      "partial": frac}))
        return out
    if kind == "half":
        return [(float(i % 2 == 0), float(i % 2 == 0),
                 {"judge:if": 1.0, "pass_fraction": float(i % 2 == 0),
                  "partial": float(i % 2 == 0)}) for i in idx]
    if kind == "shaped":
        return [(0.0, 0.5 * (i % 4 + 1) / 5, {"pass_fraction": (i % 4 + 1) / 5,
                                              "partial": (i % 4 + 1) / 5}) for i in idx]
    if kind in ("fine", "fine3"):
        fractions = [1.0, 0.2, 0.6, 0.4] if kind == "fine" else [1.0, 0.2, 0.6, 0.6]
        out = []
        for i in idx:
            frac = fractions[i % 4]
            correct = float(frac == 1.0)
            out.append((correct, 0.5 * correct + 0.5 * frac,
                        {"pass_fraction": frac, "partial": frac}))
        return out
    raise ValueError(f"unknown group kind {kind!r}")


GROUP_KINDS = ("solved", "failed", "rescuable", "judged", "half", "shaped", "fine", "fine3")


# ---- the lineages -------------------------------------------------------------------------

SWE9B = Lineage("swe", 8, 77, {
    # Groups of 8; 40 groups a version (the paper's IF backtest: 40 groups, 20 CR-dead).
    "v0": Case(None, 0.3019, {"solved": 6, "failed": 18, "half": 16}, turns=35.7,
               note="base model: 30.19 BC%, 35.7 turns, about 60% dead groups (harness doc)"),
    "v1-leak": Case("v0", 0.4880, {"solved": 8, "failed": 14, "half": 18}, turns=36.0,
                    leak=40, note="v1 on an uncleaned repo: git show/log read the fix, 48.80"),
    "v1": Case("v0", 0.3104, {"solved": 4, "failed": 18, "half": 18}, turns=36.0,
               skills=("close-leak",), note="clean re-run: 31.04, DGR 55%"),
    "v2": Case("v1", 0.3289, {"solved": 4, "failed": 17, "half": 19}, turns=36.0,
               skills=("zero-std-filter",), note="RAGEN group filter: 32.89, DGR 52%"),
    "v3": Case("v2", 0.3333, {"solved": 4, "failed": 16, "half": 20}, turns=36.0,
               skills=("shaped-correctness",), note="continuous CR: 33.33, DGR 50%"),
    "v4": Case("v3", 0.3630, {"solved": 4, "failed": 7, "rescuable": 9, "half": 20},
               turns=36.0, skills=("std-group-filter",),
               note="StdGroupFilter top-p: 36.30 with DGR still 50%; 9 of its 20 dead groups "
               "regain variance under the IF judge (the 45% backtest)"),
    "v8": Case("v4", 0.3816, {"solved": 4, "failed": 7, "judged": 9, "half": 20},
               turns=36.0, skills=("instruction-following-judge",),
               note="IF judge at 0.1: 38.16, DGR 27.5%"),
})

SWE4B = Lineage("swe", 4, 77, {
    # Groups of 4; 40 groups (160 rollouts) a version.
    "v0": Case(None, 0.2468, {"solved": 4, "failed": 16, "half": 20}, turns=37.0, echo=4,
               note="base model: 24.68 BC%"),
    "v4": Case("v0", 0.2971, {"solved": 5, "failed": 13, "half": 22}, turns=36.5, echo=5,
               skills=("zero-std-filter",),
               note="the configuration the echo branch forks from: 29.71, 36-37 turns; 23 "
               "degenerate trajectories (here 5 of 160)"),
    "v5-echo": Case("v4", 0.3328, {"solved": 6, "failed": 12, "half": 22}, turns=76.3,
                    echo=40, settings=("grpo.temperature=1.1",),
                    note="the echo-trapped branch: 33.28, 76.3 turns, 194 degenerate "
                    "trajectories (8.4x; here 40 of 160). The paper does not say what the "
                    "branch changed; here a hotter sampler"),
    "v9": Case("v4", 0.2208, {"solved": 3, "failed": 25, "half": 12}, abandon=True,
               settings=("grpo.lr=2e-06",),
               note="the efficiency factor: the policy exits after one turn (the library holds "
               "it as the negative skill efficiency-multiplier, which has no patch to apply; "
               "the branch is a stand-in setting)"),
    "v10": Case("v4", 0.2338, {"solved": 3, "failed": 24, "half": 13}, abandon=True,
                settings=("grpo.lr=3e-06",),
                note="the second efficiency branch (the paper does not say which 4B versions "
                "they were or what the second one changed: a stand-in setting): it collapses "
                "the same way"),
    "v11": Case("v4", 0.3000, {"solved": 5, "failed": 13, "half": 22}, turns=36.0, echo=5,
                settings=("grpo.steps=2",),
                note="the control: the same configuration trained longer; it does not collapse"),
})

MATH = Lineage("math", 4, 78, {
    # Groups of 4; 100 groups (400 rollouts) a version; single-turn.
    "v0": Case(None, 0.733, {"solved": 20, "failed": 20, "half": 60}, truncated=72,
               note="about 18% of validation responses cut at the length budget"),
    "v2": Case("v0", 0.749, {"solved": 15, "failed": 12, "half": 73}, truncated=8,
               skills=("raise-length-budget",), note="the length budget fixed: about 74.9"),
    "v5": Case("v2", 0.782, {"solved": 12, "failed": 9, "half": 79}, truncated=8,
               settings=('reward.components=[{"name": "correctness", "weight": 1.0}, '
                         '{"name": "format", "weight": 0.1}]',),
               note="the reward refinement (the paper does not say what changed; here a "
               "format term): about 78.2, DGR 0.21"),
    "v7": Case("v5", 0.792, {"solved": 7, "failed": 6, "half": 87}, truncated=8,
               skills=("std-group-filter",),
               note="StdGroupFilter transferred from SWE: DGR 0.21 -> 0.13, about 79.2"),
})

CODING = Lineage("code", 4, 175, {
    # Groups of 4; 100 groups (400 rollouts) a version; single-turn.
    "v0": Case(None, 0.4671, {"solved": 10, "failed": 35, "rescuable": 10, "half": 45},
               truncated=80, note="base model: 46.71; 20% of responses cut off"),
    "v3": Case("v0", 0.455, {"solved": 10, "failed": 25, "rescuable": 20, "half": 45},
               truncated=8, skills=("raise-length-budget",),
               note="measurement artifacts repaired (truncation budget; the format gate is "
               "measured apart by the code domain): about 45.5"),
    "v8": Case("v3", 0.490, {"solved": 10, "failed": 21, "shaped": 35, "half": 34},
               truncated=8, skills=("shaped-correctness",),
               note="shaped continuous CR (pass fraction): about 49.0; MidBand 0.34, DGR 0.31"),
    "v9": Case("v8", 0.502, {"solved": 8, "failed": 16, "shaped": 24, "half": 22,
                             "fine3": 30}, truncated=32, skills=("std-group-filter",),
               note="StdGroupFilter: about 50.2 (+1.17); 8% of responses still cut"),
    "v10": Case("v9", 0.5129, {"solved": 6, "failed": 12, "fine": 30, "fine3": 47,
                               "half": 5}, truncated=8, skills=("dual-level-filter",),
                note="Dual-Level filter: 51.29 final; DGR 0.18, ADiv 0.63"),
})

LINEAGES = {"swe9b": SWE9B, "swe4b": SWE4B, "math": MATH, "coding": CODING}


# ---- rollouts ----------------------------------------------------------------------------


def _seed(*parts: str) -> int:
    return int(digest(list(parts))[7:15], 16)


def train_rows(lineage: Lineage, version: str) -> list[dict[str, Any]]:
    case = lineage.versions[version]
    size = lineage.group_size
    samples = [(kind, g, s) for kind in GROUP_KINDS for g in range(case.groups.get(kind, 0))
               for s in _group(kind, size)]
    rows = []
    for index, (kind, g, (correct, reward, components)) in enumerate(samples):
        group = f"{kind}-{g}"
        rows.append({
            "version": version, "seed": 0, "step": 1, "split": "train",
            "task_id": group, "data_source": lineage.domain, "group_id": group,
            "sample_idx": index % size, "prompt": f"task {group}", "response": "done",
            "reward": reward, "correct": correct, "reward_components": [
                ("correctness", correct), *components.items()],
            "response_tokens": 400, "truncated": False, "finish_reason": "stop",
            "turns": 1, "tool_calls": None, "mean_logprob": -0.4, "extra": "{}",
        })
    failing = [r for r in rows if r["correct"] == 0.0]
    for r in failing[:case.truncated]:
        r.update(truncated=True, finish_reason="length", response_tokens=2048)
    if case.turns is not None or case.abandon:
        _episodes(rows, case)
    return rows


def _episodes(rows: list[dict[str, Any]], case: Case) -> None:
    """Tool calls and turns: echo rollouts (failing) repeat one terminal call ECHO_TURNS times;
    the others read, edit and test, their turns set so the mean is the case's."""
    act = [{"name": "read_file", "args": "src/x.py"},
           {"name": "search_replace", "args": "src/x.py"},
           {"name": "run_in_terminal", "args": "pytest -q"}]
    failing = [r for r in rows if r["correct"] == 0.0 and not r["truncated"]]
    echo = {id(r) for r in failing[:case.echo]}
    if case.abandon:
        for i, r in enumerate(rows):
            long = i < 4  # a few still run long: the environment's horizon is observed
            r.update(turns=12 if long else 1, tool_calls=act if long else [])
        return
    rest = len(rows) - len(echo)
    base = (case.turns * len(rows) - ECHO_TURNS * len(echo)) / rest
    low, high = int(np.floor(base)), int(np.ceil(base))
    n_high = round((base - low) * rest)
    placed = 0
    for r in rows:
        if id(r) in echo:
            r.update(turns=ECHO_TURNS,
                     tool_calls=[{"name": "run_in_terminal", "args": "pytest -q"}] * ECHO_TURNS)
            continue
        turns = high if placed < n_high else low
        placed += 1
        r.update(turns=turns, tool_calls=act)
    for r in rows[: case.leak]:
        r["tool_calls"] = [{"name": "run_in_terminal", "args": "git log -p"}, *r["tool_calls"]]


def task_counts(lineage: Lineage, version: str) -> np.ndarray:
    """Correct samples (of 8) per validation task: the root's drawn around its score, a
    child's its parent's moved to its own score plus the fixed ±1 spread (module docstring)."""
    case = lineage.versions[version]
    n = lineage.tasks
    rng = np.random.default_rng(_seed(lineage.domain, str(n), version))
    if case.parent is None:
        counts = np.clip(np.round(rng.beta(1.2, 1.8, n) * SAMPLES * case.score / 0.4), 0,
                         SAMPLES).astype(int)
        return _shift(counts, round(case.score * SAMPLES * n) - counts.sum(), rng)
    counts = task_counts(lineage, case.parent).copy()
    pairs = round(DELTA_VARIANCE * n / 2)
    counts = _shift(counts, pairs, rng)
    counts = _shift(counts, -pairs, rng)
    return _shift(counts, round(case.score * SAMPLES * n) - counts.sum(), rng)


def _shift(counts: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """`counts` with `total` samples added (or removed), one at a time on random tasks that
    have room."""
    step = 1 if total > 0 else -1
    for _ in range(abs(int(total))):
        room = np.flatnonzero(counts < SAMPLES) if step > 0 else np.flatnonzero(counts > 0)
        counts[rng.choice(room)] += step
    return counts


def val_rows(lineage: Lineage, version: str) -> list[dict[str, Any]]:
    rows = []
    for task, count in enumerate(task_counts(lineage, version)):
        for sample in range(SAMPLES):
            correct = float(sample < count)
            rows.append({
                "version": version, "seed": 0, "step": 2, "split": "val",
                "task_id": f"t{task}", "data_source": lineage.domain,
                "group_id": f"val-{task}", "sample_idx": sample, "prompt": f"task {task}",
                "response": "done", "reward": correct, "correct": correct,
                "reward_components": [("correctness", correct)], "response_tokens": 400,
                "truncated": False, "finish_reason": "stop", "turns": None,
                "tool_calls": None, "mean_logprob": -0.4, "extra": "{}"})
    return rows


# ---- the stand-in engine -----------------------------------------------------------------


class PaperBackend(StandinBackend):
    """Runs this module as the engine; the lineage comes from $PAPER_LINEAGE."""

    engine_module = "paper_lineages"

    def environment(self, job) -> dict[str, str]:
        return {**super().environment(job), "PAPER_LINEAGE": os.environ["PAPER_LINEAGE"]}


def main(recipe_file: str, out_dir: str, version: str) -> int:
    code = standin_engine.main(recipe_file, out_dir, version)
    if code:
        return code
    lineage = LINEAGES[os.environ["PAPER_LINEAGE"]]
    out = Path(out_dir)
    train, val = train_rows(lineage, version), val_rows(lineage, version)
    pq.write_table(pa.Table.from_pylist(train, ROLLOUT_SCHEMA), out / "rollouts/train.parquet")
    pq.write_table(pa.Table.from_pylist(val, ROLLOUT_SCHEMA), out / "rollouts/val.parquet")
    lines = ["seed,task_id,data_source,sample_idx,correct"] + [
        f"0,{r['task_id']},{r['data_source']},{r['sample_idx']},{r['correct']}" for r in val]
    (out / "scores.csv").write_text("\n".join(lines) + "\n")
    result = json.loads((out / "result.json").read_text())
    result["val_avg"] = float(np.mean([r["correct"] for r in val]))
    result["eval_k"] = SAMPLES
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
