"""A stand-in engine with planted pathologies, for tests of what the harness can and cannot
see. It runs tests/standin_engine.py, then rewrites the evidence it wrote, from two more
`domain.params`:

- `planted_need` (tokens): every response needs that many tokens; under a smaller
  `grpo.max_response_tokens` it is cut (truncated, finish_reason length) — correctness is
  left as drawn, so a longer budget removes the truncation without moving the score;
- `planted_val_skill` (probability): validation correctness is drawn at this rate instead of
  `standin_skill`, so the score moves while nothing in the train rollouts (every signal and
  behavior metric h0 has) moves with it;
- `planted_idle` (share): a multi-turn run whose rollouts act (one `compare` call over two
  turns), except that share of them, which answer at once without any call and fail: idle
  failure (the catalogue's `idle_failure_rate`); each episode records toolenv's
  `correctness`, `partial` and `efficiency` components as toolenv scores them (efficiency
  1 / actions: an answer alone earns all of it, so it pays the idle failures most);
- `planted_loop` (share, with `environment.max_turns`): the same acting run, except that share
  of them, which repeat one `compare` until the turn budget cuts them (finish_reason
  tool_limit) and fail: short echo loops (h0's echo trap needs more than 60 turns).

Use with the `standin` fixture, `monkeypatch.setitem(BACKEND_TYPES, "local", PlantedBackend)`
and `converge` (below).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import standin_engine
from standin import StandinBackend

from evotrainer.control.reconcile import Reconciler
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.store.workspace import Workspace


class PlantedBackend(StandinBackend):
    engine_module = "standin_planted"


def converge(ws: Workspace) -> None:
    Reconciler(ws, log=lambda _: None, backends={"local": PlantedBackend()}).run(
        wait=True, poll_s=0.05)


def _replace(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, values)


def _truncate(path: Path, need: int, budget: int) -> None:
    table = pq.read_table(path)
    cut = need > budget
    n = table.num_rows
    table = _replace(table, "truncated", pa.array([cut] * n))
    table = _replace(table, "finish_reason", pa.array(["length" if cut else "stop"] * n))
    table = _replace(table, "response_tokens", pa.array([min(need, budget)] * n, pa.int64()))
    pq.write_table(table.cast(ROLLOUT_SCHEMA), path)


def _redraw_val(out: Path, skill: float, version: str) -> None:
    path = out / "rollouts/val.parquet"
    table = pq.read_table(path)
    rng = np.random.default_rng(sum(version.encode()))
    correct = (rng.random(table.num_rows) < skill).astype(float)
    table = _replace(table, "correct", pa.array(correct))
    table = _replace(table, "reward", pa.array(correct))
    pq.write_table(table.cast(ROLLOUT_SCHEMA), path)
    _score(out, table)


def _score(out: Path, table: pa.Table) -> None:
    """scores.csv and result.json's val_avg from the (rewritten) val rollouts."""
    rows = table.select(["seed", "task_id", "data_source", "sample_idx", "correct"]).to_pylist()
    lines = ["seed,task_id,data_source,sample_idx,correct"] + [
        f"{r['seed']},{r['task_id']},{r['data_source']},{r['sample_idx']},{r['correct']}"
        for r in rows]
    (out / "scores.csv").write_text("\n".join(lines) + "\n")
    result = json.loads((out / "result.json").read_text())
    result["val_avg"] = float(pc.mean(table.column("correct")).as_py())
    (out / "result.json").write_text(json.dumps(result))


def _episodes(path: Path, idle: float, loop: float, max_turns: int, version: str
              ) -> pa.Table:
    """Rewrite each rollout as an episode: acting (one compare), idle or looping (see the
    module docstring); the planted rows fail, the others keep their drawn correctness."""
    table = pq.read_table(path)
    rng = np.random.default_rng(sum(version.encode()) + 7)
    draw = rng.random(table.num_rows)
    kind = np.where(draw < idle, "idle", np.where(draw < idle + loop, "loop", "act"))
    correct = np.where(kind == "act", table.column("correct").to_numpy(), 0.0)
    act = [{"name": "compare", "args": "32"}]
    calls = {"idle": [], "loop": act * (max_turns // 2), "act": act}
    turns = {"idle": 1, "loop": max_turns, "act": 2}
    actions = {"idle": 1, "loop": max_turns // 2 + 1, "act": 2}  # calls and the answer
    replies = {"idle": "=0;", "loop": "?32;<;" * (max_turns // 2), "act": "?32;<;"}
    table = _replace(table, "correct", pa.array(correct))
    table = _replace(table, "reward", pa.array(correct))
    table = _replace(table, "reward_components", pa.array(
        [[("correctness", float(c)), ("partial", float(c)), ("efficiency", 1.0 / actions[k])]
         for k, c in zip(kind, correct, strict=True)],
        ROLLOUT_SCHEMA.field("reward_components").type))
    table = _replace(table, "tool_calls", pa.array([calls[k] for k in kind], ROLLOUT_SCHEMA.field(
        "tool_calls").type))
    table = _replace(table, "turns", pa.array([turns[k] for k in kind], pa.int64()))
    table = _replace(table, "finish_reason", pa.array(
        ["tool_limit" if k == "loop" else "stop" for k in kind]))
    table = _replace(table, "response", pa.array(
        [replies[k] + ("" if k == "loop" else f"={int(c)};") for k, c in zip(
            kind, correct, strict=True)]))
    pq.write_table(table.cast(ROLLOUT_SCHEMA), path)
    return table


def main(recipe_file: str, out_dir: str, version: str) -> int:
    code = standin_engine.main(recipe_file, out_dir, version)
    if code:
        return code
    recipe = json.loads(Path(recipe_file).read_text())
    params = recipe["domain"].get("params") or {}
    out = Path(out_dir)
    if "planted_need" in params:
        for split in ("train", "val"):
            _truncate(out / f"rollouts/{split}.parquet", int(params["planted_need"]),
                      int(recipe["grpo"]["max_response_tokens"]))
    if "planted_idle" in params or "planted_loop" in params:
        max_turns = int((recipe.get("environment") or {}).get("max_turns") or 8)
        for split in ("train", "val"):
            table = _episodes(out / f"rollouts/{split}.parquet",
                              float(params.get("planted_idle", 0)),
                              float(params.get("planted_loop", 0)), max_turns, version)
        _score(out, table)  # the val table: the planted episodes fail there too
    if "planted_val_skill" in params:
        _redraw_val(out, float(params["planted_val_skill"]), version)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
