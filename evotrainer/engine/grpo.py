"""The embedded GRPO engine, top to bottom.

Per training step:
  1. sample `prompts_per_step` training tasks and G = `group_size` episodes of each
     (multi-turn episodes interleave policy actions with environment replies);
  2. score every episode with the domain; reward = Σ weight × component (recipe `reward`);
  3. group-relative advantages A = (r - mean_group) / (std_group + eps) (std switchable);
  4. the group filter decides which groups enter the loss;
  5. `ppo_epochs` updates of the token-level clipped surrogate with Clip-Higher
     (ratio clipped to [1 - clip_low, 1 + clip_high]) plus an optional KL to the frozen
     reference (k1 or k3), aggregated token-mean or seq-mean; AdamW with grad clipping.
     Old log-probs are those of the first epoch's forward pass, before any update.
Environment tokens are masked out of the loss. Validation (`eval_k` samples per val task, drawn
at `eval_temperature` / `eval_top_p`, by default the training ones) runs at step 0, every
`eval_every` steps and at the end; `grpo.steps: 0` means evaluate only.

The recipe's optional `rollout` section picks what samples (`engine`: builtin, the default, or
vllm: vLLM generates, the policy's weights pushed to it after every update, and the trainer
computes the log-probabilities the loss uses itself, as verl does), in what precision the
built-in sampler samples training groups (`quantization: int8`), whether the surrogate is
importance-weighted against the sampler's distribution (`importance_cap`: truncated importance
sampling, as verl's rollout correction) and how many processes score beside the sampler
(`score_workers`, default 0: after sampling, in this process).
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from evotrainer.contract.filters import Trajectory, filter_batch, make_filter
from evotrainer.contract.model_start import model_start
from evotrainer.contract.recipe import (
    check_recipe,
    environment_config,
    evaluation_sampling,
)
from evotrainer.contract.rollout import check_rollout
from evotrainer.contract.typed import Grpo, Recipe
from evotrainer.domains import Domain, Task, judge_records, make_domain
from evotrainer.engine import engine_threads, offline_environment
from evotrainer.engine.judge_servers import served_judges
from evotrainer.engine.model import (
    AdapterOff,
    continued_model,
    initial_model,
    save_checkpoint,
    uses_chat_template,
    with_cache,
    with_lora,
)
from evotrainer.engine.outputs import RunLog, RunOutputs, Stopped, write_json
from evotrainer.engine.rollout import (
    Episode,
    Sampler,
    batch_tensors,
    distinct_rows,
    sample_episodes,
    target_logprobs,
    token_logprobs,
)
from evotrainer.engine.scoring import Scoring
from evotrainer.engine.warm_start import warm_start
from evotrainer.evidence.groups import dead_group_ratio
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.store.checkpoints import check_job_start, seed_checkpoint_name
from evotrainer.store.recipe import digest
from evotrainer.trackers import RunIdentity, logger_names, open_trackers

ADV_EPS = 1e-6


# ----------------------------------------------------------------------------- the algorithm


def group_advantages(rewards: np.ndarray, normalize_std: bool) -> np.ndarray:
    """rewards (groups, G) → advantages (groups, G): centred per group, optionally divided by the
    group's (unbiased, as verl and TRL) std."""
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if not normalize_std:
        return centred
    return centred / (rewards.std(axis=1, ddof=1, keepdims=True) + ADV_EPS)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    grpo: Grpo,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped surrogate (+ KL). logp/old_logp/ref_logp/mask: (B, T); advantages
    (B,), one per sequence, broadcast over its tokens. `importance` (B, T), no gradient: each
    token's truncated importance weight (`importance_weights`), multiplying its surrogate term
    and not the KL, as verl's rollout correction weights the policy gradient."""
    adv = advantages[:, None]
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - grpo.clip_low, 1 + grpo.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if importance is not None:
        per_token = per_token * importance
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        log_ref_ratio = ref_logp - logp
        # k1 = log π/π_ref; k3 = e^x - x - 1 with x = log π_ref/π (unbiased, never negative).
        kl = (
            -log_ref_ratio
            if grpo.kl_estimator == "k1"
            else (torch.exp(log_ref_ratio) - log_ref_ratio - 1)
        )
        per_token = per_token + grpo.kl_coef * kl
    loss = aggregate(per_token, mask, grpo.loss_agg)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        stats = {
            "clip_frac": float(((clipped < unclipped).float() * mask).sum() / tokens),
            "kl": float((kl * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
        }
    return loss, stats


def sampler_logprobs(logprobs: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Each row's sampling log-probabilities (an episode's `logprobs`) laid out as `mask`
    (B, T), either training batch's: a row's masked-in positions, in order, are its sampled
    tokens."""
    logp = torch.zeros_like(mask)
    for row, values in enumerate(logprobs):
        logp[row, mask[row] > 0] = torch.tensor(values, dtype=logp.dtype)
    return logp


def importance_weights(
    old_logp: torch.Tensor, sampled_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (TIS), per token: min(pi_old / pi_sampler, cap), the
    trainer's probability of the sampled token over the probability it was sampled with, both
    at the sampling temperature. The sampler's is after top-p (the nucleus renormalized, as
    vLLM's processed log-probs are), so below top_p 1 a weight also carries the nucleus's mass.
    With the statistics of the mismatch, defined as verl's `rollout_corr/` metrics of token-level
    TIS: the applied weights' mean, the share of tokens whose weight the cap cut, and the k1
    estimate of KL(sampler || trainer), all over the trained tokens."""
    with torch.no_grad():
        log_ratio = old_logp - sampled_logp
        raw = torch.exp(log_ratio)
        weights = raw.clamp(max=cap) * mask
        tokens = mask.sum().clamp(min=1)
        stats = {
            "rollout_is_mean": float(weights.sum() / tokens),
            "rollout_is_ratio_fraction_high": float(((raw > cap).float() * mask).sum() / tokens),
            "rollout_kl": float((-log_ratio * mask).sum() / tokens),
        }
        return weights, stats


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """token-mean: every trained token weighs the same (DAPO); seq-mean: mean over sequences
    of each sequence's token mean."""
    if how == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.mean()


# The training forward runs each distinct prompt once and its group's responses over that
# prompt's KV cache (as the sampler does), so a group of G pays for its prompt once instead of G
# times: the same log-probabilities and gradients in fewer FLOPs. False: every episode as one
# full row (bench/real_model.py's baseline).
SHARE_PROMPT_FORWARD = True


class FullRows:
    """The kept episodes as left-padded rows of prompt + response; responses end at the right
    edge, so the loss covers the last `tail` positions."""

    def __init__(self, episodes: list[Episode], pad_id: int) -> None:
        rows = [e.prompt_ids + e.ids for e in episodes]
        self.ids, self.attn, self.positions, mask = batch_tensors(
            rows, [e.mask for e in episodes], pad_id
        )
        self.tail = max(len(e.mask) for e in episodes)
        self.mask = mask[:, -self.tail:]

    def logprobs(
        self, model: torch.nn.Module, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(model, self.ids, self.attn, self.positions, self.tail,
                              temperature)


class SharedPrompts:
    """The kept episodes as one batch of distinct (left-padded) prompts and one of responses
    (right-padded, aligned with `mask`), each response row attending to its prompt's cache."""

    def __init__(self, episodes: list[Episode], pad_id: int) -> None:
        self.prompt_ids, self.prompt_attn, self.source = distinct_rows(
            [e.prompt_ids for e in episodes], pad_id)
        width = max(len(e.ids) for e in episodes)
        self.ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
        response_attn = torch.zeros((len(episodes), width), dtype=torch.long)
        self.mask = torch.zeros((len(episodes), width), dtype=torch.float32)
        for i, e in enumerate(episodes):
            self.ids[i, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
            response_attn[i, : len(e.ids)] = 1
            self.mask[i, : len(e.mask)] = torch.tensor(e.mask, dtype=torch.float32)
        prompt_attn = self.prompt_attn[self.source]
        self.attn = torch.cat([prompt_attn, response_attn], dim=-1)
        self.positions = prompt_attn.sum(-1, keepdim=True) + torch.arange(width)

    def logprobs(
        self, model: torch.nn.Module, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = DynamicCache()
        prompt_out = model(
            input_ids=self.prompt_ids,
            attention_mask=self.prompt_attn,
            position_ids=(self.prompt_attn.cumsum(-1) - 1).clamp(min=0),
            logits_to_keep=1,
            **with_cache(cache),
        )
        cache.batch_select_indices(self.source)  # gradients flow back to the shared prompt rows
        response_logits = model(
            input_ids=self.ids, attention_mask=self.attn, position_ids=self.positions,
            **with_cache(cache),
        ).logits
        # The prompt's last position predicts the first response token; the rest predict
        # the next one.
        logits = torch.cat(
            [prompt_out.logits[self.source, -1:], response_logits[:, :-1]], dim=1
        )
        return target_logprobs(logits, self.ids, temperature)


def update(
    model: PreTrainedModel,
    ref: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    episodes: list[Episode],
    advantages: np.ndarray,
    grpo: Grpo,
    pad_id: int,
    importance_cap: float | None = None,
) -> dict[str, float]:
    """`ppo_epochs` gradient steps on the kept episodes (one full batch each). With
    `importance_cap` (`rollout.importance_cap`) the surrogate is importance-weighted against
    the distribution the episodes were sampled from (`importance_weights`)."""
    batch = (SharedPrompts if SHARE_PROMPT_FORWARD else FullRows)(episodes, pad_id)
    mask = batch.mask
    adv = torch.tensor(advantages, dtype=torch.float32)
    # Log-probabilities at the temperature the episodes were sampled at, the policy's and the
    # reference's alike (as verl and TRL compute them).
    temperature = grpo.temperature
    ref_logp = None
    if ref is not None:
        with torch.no_grad():
            ref_logp = batch.logprobs(ref, temperature)[0]
    old_logp = importance = None
    correction: dict[str, float] = {}
    model.train()
    for _ in range(grpo.ppo_epochs):
        logp, entropy = batch.logprobs(model, temperature)
        if old_logp is None:
            old_logp = logp.detach()
            if importance_cap is not None:
                importance, correction = importance_weights(
                    old_logp, sampler_logprobs([e.logprobs for e in episodes], mask), mask,
                    importance_cap)
        loss, stats = policy_loss(logp, old_logp, ref_logp, adv, mask, grpo, importance)
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grpo.grad_clip)
        optimizer.step()
    return {
        **stats,
        **correction,
        "loss": loss.item(),
        "grad_norm": float(grad_norm),
        "entropy": float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1)),
    }


# ------------------------------------------------------------------------------- one seed


class Trainer:
    """Everything one seed's run needs; `run()` is the loop."""

    def __init__(
        self,
        recipe: Recipe | dict[str, Any],
        seed: int,
        domain: Domain,
        outputs: RunOutputs,
        log: RunLog,
        cache_root: Path,
        sampler: Sampler | None = None,
    ) -> None:
        """`sampler`: the vLLM engine an earlier seed of the job started (`rollout.engine:
        vllm`), reused with this seed's weights; None starts one when the recipe asks."""
        if not isinstance(recipe, Recipe):  # a resolved recipe as its mapping (the benches)
            recipe = Recipe.from_dict(recipe)
        self.recipe, self.seed, self.domain = recipe, seed, domain
        self.outputs, self.log = outputs, log
        self.grpo = recipe.grpo
        # The model and environment helpers (shared with verl's renderer and the checks) and
        # the warm-start cache key read the resolved mapping the recipe was built from.
        resolved = recipe.as_dict()
        model_cfg = resolved["model"]
        self.env_config = environment_config(resolved, domain)
        self.weights = {c.name: c.weight for c in recipe.reward.components}
        random.seed(seed)
        np.random.seed(seed)
        self.train_tasks, self.val_tasks = domain.split(
            recipe.domain.train_size, recipe.domain.val_size
        )
        start = model_start(model_cfg)
        if start.kind == "parent":  # the parent's policy: it is already past any warm start
            self.model, self.tokenizer = continued_model(model_cfg)
            self.chat = uses_chat_template(model_cfg, self.tokenizer)
            self.warm_start: dict[str, Any] = {
                "steps": 0, "cached": False, "continued_from": start.source["digest"]
            }
        else:
            model, self.tokenizer = initial_model(model_cfg, seed, cache_root, log)
            # Instruct models see their prompts as a chat turn (model.chat_template: auto).
            self.chat = uses_chat_template(model_cfg, self.tokenizer)
            self.model, self.warm_start = warm_start(
                model,
                self.tokenizer,
                domain,
                self.train_tasks,
                resolved,
                self.env_config,
                seed,
                cache_root,
                log,
                self.chat,
            )
        # Reseed after the warm start, so a cached and a freshly trained start give the same run.
        torch.manual_seed(seed)
        self.rng = random.Random(seed)
        self.ref: torch.nn.Module | None = None
        if model_cfg.get("lora"):  # only the adapter trains; its base is the reference
            self.model = with_lora(self.model, model_cfg["lora"])
            self.ref = AdapterOff(self.model) if self.grpo.kl_coef > 0 else None
        elif self.grpo.kl_coef > 0:
            self.ref = copy.deepcopy(self.model).eval()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.grpo.lr)
        rollout = recipe.rollout or {}
        # Training groups sample in this precision; evaluation always in the policy's own, so
        # val_avg means the same with and without int8 rollouts.
        self.rollout_weights = rollout.get("quantization") or "float32"
        self.importance_cap = rollout.get("importance_cap")
        self.scoring = Scoring(
            domain, resolved["domain"], self.weights, rollout.get("score_workers") or 0
        )
        self.sampler = sampler
        if (rollout.get("engine") or "builtin") == "vllm" and sampler is None:
            from evotrainer.engine.vllm_rollout import VllmSampler  # only where vllm is used

            self.sampler = VllmSampler(self.model, self.tokenizer, seed, log)
        self.policy_pushed = False  # the sampler holds the policy's current weights
        self.group_filter = make_filter(resolved.get("group_filter"))
        # The engine's own log and steps.parquet are its `console` and `file` loggers; the
        # others (TensorBoard, MLflow, W&B) get the same per-step metrics, one run per seed.
        external = [n for n in logger_names(resolved) if n not in ("console", "file")]
        self.trackers = open_trackers(
            external, outputs.out_dir, RunIdentity.read(outputs.out_dir, outputs.version),
            seed=seed,
        )

    def sample(
        self, tasks: list[Task], temperature: float, top_p: float, weights: str = "float32"
    ) -> list[Episode]:
        """Episodes of `tasks`, each handed to the scorers the moment it is over; `weights`:
        the built-in sampler's precision."""
        if self.sampler is not None and not self.policy_pushed:
            self.sampler.load(self.model)  # vLLM samples from the weights of the last update
            self.policy_pushed = True
        return sample_episodes(
            self.model,
            self.tokenizer,
            self.domain,
            tasks,
            self.env_config,
            self.grpo.max_response_tokens,
            temperature,
            top_p,
            self.chat,
            on_finished=self.scoring.submit,
            sampler=self.sampler,
            weights=weights,
        )

    def score(self, episodes: list[Episode]) -> tuple[np.ndarray, list[Any]]:
        return self.scoring.collect(episodes)

    def run(self) -> float:
        steps = self.grpo.steps
        self.outputs.progress.begin_seed(self.seed, steps * len(self.recipe.seeds))
        try:
            val_avg = self.evaluate(0)
            with self.log.steps(steps, f"seed {self.seed}") as advance:
                for step in range(1, steps + 1):
                    self.train_step(step)
                    if step % self.grpo.eval_every == 0 or step == steps:
                        val_avg = self.evaluate(step)
                    advance()
        finally:
            self.trackers.close()
            self.scoring.close()
        return val_avg

    def train_step(self, step: int) -> None:
        start = time.perf_counter()
        size = self.grpo.group_size
        tasks = self.rng.sample(self.train_tasks, self.grpo.prompts_per_step)
        episodes = self.sample(
            [t for t in tasks for _ in range(size)], self.grpo.temperature, self.grpo.top_p,
            self.rollout_weights,
        )
        sampled_at = time.perf_counter()
        rewards, scores = self.score(episodes)
        scored_at = time.perf_counter()
        grouped = rewards.reshape(len(tasks), size)
        advantages = group_advantages(grouped, self.grpo.normalize_std).reshape(-1)
        # Both filter levels: a trajectory rule (dual_level's idle, abandoned, echo-trap and
        # truncated rollouts) takes members out of their group before the group test.
        multi_turn = self.env_config is not None
        trajectories = [
            Trajectory(s.correct, e.turns if multi_turn else None,
                       e.tool_calls if multi_turn else None, e.finish_reason == "length")
            for e, s in zip(episodes, scores, strict=True)
        ]
        decision = filter_batch(
            self.group_filter, list(grouped),
            [trajectories[i * size:(i + 1) * size] for i in range(len(tasks))],
        )
        for i, out in enumerate(decision.excluded):
            if out.any():  # advantages over the members left (one alone has no spread)
                advantages[i * size:(i + 1) * size] = 0.0
                left = np.flatnonzero(~out)
                if left.size > 1:
                    advantages[i * size + left] = group_advantages(
                        grouped[i, left][None, :], self.grpo.normalize_std)[0]
        keep_groups = decision.keep_groups
        keep = decision.sample_mask()
        stats: dict[str, float] = {}
        if keep.any():
            kept = [e for e, k in zip(episodes, keep, strict=True) if k]
            stats = update(
                self.model,
                self.ref,
                self.optimizer,
                kept,
                advantages[keep],
                self.grpo,
                self.tokenizer.pad_token_id,
                self.importance_cap,
            )
            self.policy_pushed = False
        elapsed = time.perf_counter() - start
        sampled = sum(sum(e.mask) for e in episodes)
        stats |= {
            "reward_mean": float(rewards.mean()),
            "correct_mean": float(np.mean([s.correct for s in scores])),
            "dead_group_ratio": dead_group_ratio(grouped),
            "kept_group_ratio": float(keep_groups.mean()),
            "excluded_ratio": float(np.concatenate(decision.excluded).mean()),
            "response_tokens_mean": sampled / len(episodes),
            "truncated_ratio": float(np.mean([e.finish_reason != "stop" for e in episodes])),
            "time_per_step": elapsed,
            "tokens_per_s": sampled / elapsed,
            # The step split: sampling, the wait for scores once sampling is over (scoring
            # that ran beside the sampler is not in it), and everything after (the update).
            "sampling_s": sampled_at - start,
            "scoring_s": scored_at - sampled_at,
            "training_s": elapsed - (scored_at - start),
        }
        for name, value in stats.items():
            self.outputs.metric(self.seed, step, name, value)
        self.trackers.log(step, stats)
        self.record("train", step, episodes, rewards, scores, advantages, keep)
        self.log(
            f"seed {self.seed} step {step}: reward {stats['reward_mean']:.3f} "
            f"kept {stats['kept_group_ratio']:.2f} loss {stats.get('loss', 0.0):.4f} "
            f"({elapsed:.2f}s)"
        )
        self.outputs.progress.stepped(step, elapsed)

    def evaluate(self, step: int) -> float:
        """eval_k samples per val task, at the evaluation temperature and top-p. A private RNG
        stream (seed, step) keeps evaluation from shifting the training samples, so
        `eval_every` does not change the training run."""
        k = self.grpo.eval_k
        with torch.random.fork_rng():
            torch.manual_seed(self.seed * 1_000_003 + step)
            episodes = self.sample([t for t in self.val_tasks for _ in range(k)],
                                   *evaluation_sampling(asdict(self.grpo)))
        rewards, scores = self.score(episodes)
        self.record("val", step, episodes, rewards, scores)
        val_avg = float(np.mean([s.correct for s in scores]))
        self.outputs.metric(self.seed, step, "val_avg", val_avg)
        self.outputs.metric(self.seed, step, "val_reward_mean", float(rewards.mean()))
        self.trackers.log(step, {"val_avg": val_avg, "val_reward_mean": float(rewards.mean())})
        self.outputs.scores = [r for r in self.outputs.scores if r["seed"] != self.seed] + [
            {
                "seed": self.seed,
                "task_id": e.task.task_id,
                "data_source": e.task.data_source,
                "sample_idx": i % k,
                "correct": s.correct,
            }
            for i, (e, s) in enumerate(zip(episodes, scores, strict=True))
        ]
        self.outputs.flush()
        self.outputs.progress.evaluated(step, val_avg)
        self.log(f"seed {self.seed} step {step}: val avg@{k} {val_avg:.3f}")
        return val_avg

    def record(
        self,
        split: str,
        step: int,
        episodes: list[Episode],
        rewards: np.ndarray,
        scores: list[Any],
        advantages: np.ndarray | None = None,
        keep: np.ndarray | None = None,
    ) -> None:
        size = self.grpo.group_size if split == "train" else self.grpo.eval_k
        for i, (e, r, s) in enumerate(zip(episodes, rewards, scores, strict=True)):
            extra: dict[str, Any] = {"env_tokens": len(e.mask) - sum(e.mask)}
            if advantages is not None and keep is not None:
                extra |= {"advantage": float(advantages[i]), "used_in_loss": bool(keep[i])}
            self.outputs.rollouts[split].append(
                {
                    "version": self.outputs.version,
                    "seed": self.seed,
                    "step": step,
                    "split": split,
                    "task_id": e.task.task_id,
                    "data_source": e.task.data_source,
                    "group_id": f"{split}-s{self.seed}-t{step}-g{i // size}",
                    "sample_idx": i % size,
                    "prompt": e.task.prompt,
                    "response": e.response,
                    "reward": float(r),
                    "reward_components": list(s.components.items()),
                    "correct": s.correct,
                    "response_tokens": sum(e.mask),
                    "truncated": e.finish_reason != "stop",
                    "finish_reason": e.finish_reason,
                    "turns": e.turns,
                    "tool_calls": e.tool_calls,
                    "mean_logprob": float(np.mean(e.logprobs)) if e.logprobs else None,
                    "extra": json.dumps(extra, sort_keys=True),
                }
            )


# ------------------------------------------------------------------------------- one job


def run_job(
    recipe: dict[str, Any],
    out_dir: Path,
    version: str = "adhoc",
    progress: bool = False,
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """Train every seed of a resolved recipe in turn and write the run's outputs to `out_dir`.

    Warm starts (and a converted GGUF model) are cached under `cache_dir`, else
    $EVOTRAINER_CACHE_DIR (the `local` backend points it at the artifact root's `cache`, shared
    by a workspace's runs), else `<out_dir>/cache`: a standalone run writes nothing outside its
    own folder. Returns the content of
    result.json; on failure result.json says `failed` with the `error` and the exception
    propagates.
    """
    check_recipe(recipe)
    check_rollout(recipe)
    offline_environment(recipe)
    typed = Recipe.from_dict(recipe)
    torch.set_num_threads(engine_threads(recipe.get("threads")))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_root = Path(cache_dir or os.environ.get("EVOTRAINER_CACHE_DIR") or out_dir / "cache")
    log = RunLog(RunArtifacts(out_dir).log, progress)
    outputs = RunOutputs(out_dir, version)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "status": "running",
        "version": version,
        "recipe_digest": digest(recipe),
        "steps": typed.grpo.steps,
        "steps_done": 0,
        "seeds": list(typed.seeds),
        "eval_k": typed.grpo.eval_k,
        "val_avg": None,
        "val_avg_by_seed": {},
        "warm_start": {},
        "wall_time_s": 0.0,
    }
    write_json(RunArtifacts(out_dir).result, result)
    log(f"run {version}: recipe {result['recipe_digest']}, seeds {result['seeds']}")
    sampler: Sampler | None = None
    try:
        check_job_start(recipe)
        judges = recipe["reward"].get("judges")  # judge.schema.json mappings, as served
        # serve: judges get a server for the run's duration; their replies are cached beside
        # the warm starts, keyed by the judge's identity.
        with served_judges(judges, out_dir / "judges", cache_root, log) as endpoints:
            domain = make_domain(recipe["domain"], judges, cache_dir=cache_root / "judges",
                                 endpoints=endpoints)
            try:
                for index, seed in enumerate(typed.seeds):
                    trainer = Trainer(typed, seed, domain, outputs, log, cache_root, sampler)
                    sampler = trainer.sampler  # one vLLM engine for all the job's seeds
                    result["warm_start"][str(seed)] = trainer.warm_start
                    result["val_avg_by_seed"][str(seed)] = trainer.run()
                    # Over every seed trained, as the live record counts an early stop's.
                    result["steps_done"] += typed.grpo.steps
                    save_checkpoint(trainer.model, trainer.tokenizer,
                                    out_dir / seed_checkpoint_name(index, seed))
            finally:  # the judges' identity and counts, a failed run's too
                if judges:
                    result["judges"] = judge_records(domain)
        result["val_avg"] = float(np.mean(list(result["val_avg_by_seed"].values())))
        result["status"] = "ok"
    except Stopped as exc:  # cancel or an early stop: a stop, with its cause, not a failure
        result["status"] = "failed"
        result["error"] = str(exc)
        log(f"stopped: {exc}")
        raise
    except BaseException as exc:
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"failed: {result['error']}")
        raise
    finally:
        if sampler is not None:
            sampler.close()
        result["wall_time_s"] = round(time.perf_counter() - started, 3)
        write_json(RunArtifacts(out_dir).result, result)
        log(
            f"run {version}: {result['status']} in {result['wall_time_s']:.1f}s, "
            f"val avg@{result['eval_k']} {result['val_avg']}"
        )
        log.close()
    return result
