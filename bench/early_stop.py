"""What an early stop saves: replay a finished local run's evidence as a live look saw it
after each evaluation (the engine flushes rollouts there), with `observe_running` and the
harness in force, and print where a rule of the harness's `early_stop` first holds, and the
training steps and seconds that stop saves against the full run (times from train.log).

    .venv/bin/python bench/early_stop.py WORKSPACE VERSION [HARNESS]

e.g. after `evotrainer init demo --example toolenv`, `version new v1 --parent v0`, approve
and `reconcile --wait` in demo: `bench/early_stop.py demo v1`.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from evotrainer.control.live import live_dir, observe_running
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.store.workspace import Workspace

_EVAL = re.compile(r"^(\S+ \S+) seed (\d+) step (\d+): val avg")
_END = re.compile(r"^(\S+ \S+) run \S+: ok in")


def main(root: str, version: str, harness_name: str = "h0") -> None:
    ws = Workspace(Path(root))
    state = ws.version(version)
    run = state.records["run"]
    source = ws.root / run["artifact_dir"]
    harness = resolve_harness(harness_name, ws.root)
    log = (source / "train.log").read_text().splitlines()
    clock = {}  # eval step -> time it was flushed
    end = None
    for line in log:
        if (m := _EVAL.match(line)) and int(m[3]) not in clock:
            clock[int(m[3])] = _time(m[1])
        elif m := _END.match(line):
            end = _time(m[1])
    started = _time(log[0][:19])
    replay = ws.state_dir / "replay" / version
    shutil.rmtree(replay, ignore_errors=True)
    shutil.rmtree(live_dir(ws, version + "-replay"), ignore_errors=True)
    (replay / "rollouts").mkdir(parents=True)
    shutil.copy(source / "recipe.json", replay / "recipe.json")
    tables = {s: pq.read_table(source / "rollouts" / f"{s}.parquet") for s in ("train", "val")}
    steps = pq.read_table(source / "steps.parquet")
    replay_state = ws.version(version)
    object.__setattr__(replay_state, "name", version + "-replay")
    replay_run = {**run, "artifact_dir": ws.record_path(replay), "job_id": "replay"}
    total = max(clock)
    print(f"{version}: full run {total} steps, {end - started:.0f} s (train.log), "
          f"harness {harness.name}")
    for step in sorted(clock):
        for split, table in tables.items():
            pq.write_table(table.filter(pc.less_equal(table.column("step"), step)),
                           replay / "rollouts" / f"{split}.parquet")
        pq.write_table(steps.filter(pc.less_equal(steps.column("step"), step)),
                       replay / "steps.parquet")
        (replay / "train.log").write_text(
            "\n".join(line for line in log if _logged_step(line) <= step) + "\n"
        )
        took = time.perf_counter()
        view = observe_running(ws, replay_state, replay_run, harness)
        took = time.perf_counter() - took
        alerts = ", ".join(f"{a['name']}({a['severity']})"
                           for a in (view.diagnosis or {}).get("alerts", [])) or "none"
        print(f"  after eval at step {step:>3}: {view.rows:>5} train rollouts, alerts {alerts}; "
              f"live look {took:.2f} s")
        if view.stop:
            saved_s = end - clock[step]
            print(f"early stop: rule {view.stop['rule']} at step {step} of {total}: saves "
                  f"{total - step} steps ({(total - step) / total:.0%}) and {saved_s:.0f} s of "
                  f"{end - started:.0f} s ({saved_s / (end - started):.0%}) on this machine")
            break
    else:
        print("no early-stop rule held: the run trains to the end")
    shutil.rmtree(replay, ignore_errors=True)
    shutil.rmtree(live_dir(ws, version + "-replay"), ignore_errors=True)


def _time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()


def _logged_step(line: str) -> int:
    m = re.search(r" step (\d+):", line)
    return int(m[1]) if m else 0


if __name__ == "__main__":
    main(*sys.argv[1:])
