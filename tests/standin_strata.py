"""A stand-in engine whose validation set has two data sources, each scored at its own rate, for
tests of what the gate reads per stratum. It runs tests/standin_engine.py, then rewrites the
validation rollouts, scores.csv and the result's val_avg: `STRATUM_TASKS` tasks per source,
`SAMPLES` samples each, correct at `strata_skill[source]` (`domain.params`, a map; absent, both
sources at `standin_skill`, 0.3 by default).

Use with the `standin` fixture, `monkeypatch.setitem(BACKEND_TYPES, "local", StrataBackend)`
and `converge` (below).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import standin_engine
from standin import StandinBackend

from evotrainer.control.reconcile import Reconciler
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.store.recipe import digest
from evotrainer.store.workspace import Workspace

SOURCES = ("src_a", "src_b")
STRATUM_TASKS, SAMPLES = 40, 8


class StrataBackend(StandinBackend):
    engine_module = "standin_strata"


def converge(ws: Workspace) -> None:
    Reconciler(ws, log=lambda _: None, backends={"local": StrataBackend()}).run(
        wait=True, poll_s=0.05)


def main(recipe_file: str, out_dir: str, version: str) -> int:
    code = standin_engine.main(recipe_file, out_dir, version)
    if code:
        return code
    recipe = json.loads(Path(recipe_file).read_text())
    params = recipe["domain"].get("params") or {}
    default = params.get("standin_skill", 0.3)
    skills = params.get("strata_skill") or {source: default for source in SOURCES}
    # Seeded by what the draws depend on, never by where a parent's checkpoint lies.
    rng = np.random.default_rng(int(digest({"version": version, "skills": skills})[7:15], 16))
    step = recipe["grpo"]["steps"]
    rows = []
    for source in SOURCES:
        for task in range(STRATUM_TASKS):
            for sample in range(SAMPLES):
                correct = float(rng.random() < skills[source])
                rows.append({
                    "version": version, "seed": 0, "step": step, "split": "val",
                    "task_id": f"{source}-{task}", "data_source": source,
                    "group_id": f"{step}-{source}-{task}", "sample_idx": sample,
                    "prompt": f"task {source} {task}", "response": f"={int(correct)}",
                    "reward": correct, "reward_components": [("correctness", correct)],
                    "correct": correct, "response_tokens": 2, "truncated": False,
                    "finish_reason": "stop", "turns": 2, "tool_calls": [],
                    "mean_logprob": -1.0, "extra": "{}"})
    out = Path(out_dir)
    pq.write_table(pa.Table.from_pylist(rows, ROLLOUT_SCHEMA), out / "rollouts/val.parquet")
    lines = ["seed,task_id,data_source,sample_idx,correct"] + [
        f"0,{r['task_id']},{r['data_source']},{r['sample_idx']},{r['correct']}" for r in rows]
    (out / "scores.csv").write_text("\n".join(lines) + "\n")
    result = json.loads((out / "result.json").read_text())
    result.update(val_avg=float(np.mean([r["correct"] for r in rows])), eval_k=SAMPLES)
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
