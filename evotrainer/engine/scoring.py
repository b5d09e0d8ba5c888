"""Scoring off the sampler's critical path.

A reward that runs programs (a HumanEval test, a repository's test suite) costs seconds per
episode. With `rollout.score_workers: N` the engine scores each episode in one of N worker
processes the moment the sampler finishes it, while the rest of the batch is still sampling;
absent or 0 it scores after sampling, in the engine's process, as it always has. A domain's
`score` is a function of the task and the transcript alone, so both give the same scores in the
same order (tests/test_scoring.py). A domain with LLM judges (`JudgedDomain`) scores its own
components in the workers and asks its judges for the whole batch at once in `collect`.

The workers are processes, not threads: the sandbox forks, and a fork from a thread of a
process whose main thread is in a torch kernel can inherit a held lock. Each worker builds the
domain from the recipe's `domain` section once (spawned, so it imports no torch) and scores
what it is sent: the task, the response, the tool calls and the truncation flag.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import numpy as np

from evotrainer.domains import Domain, JudgedDomain, Score, Scored, Task, make_domain, score_all

_WORKER_DOMAIN: list[Domain] = []  # the worker process's domain, built once by _start_worker


def _start_worker(domain_cfg: dict[str, Any]) -> None:
    _WORKER_DOMAIN.append(make_domain(domain_cfg))  # without judges: they stay in the engine


def _score_in_worker(
    task: Task, response: str, tool_calls: list[dict[str, str]], truncated: bool | None
) -> Score:
    return _WORKER_DOMAIN[0].score(task, response, tool_calls, truncated)


class Scoring:
    """Scores a batch of episodes, those handed to `submit` as they finish while the sampler
    runs, the others in `collect`. `workers` 0 scores in this process."""

    def __init__(
        self, domain: Domain, domain_cfg: dict[str, Any], weights: dict[str, float], workers: int
    ) -> None:
        self.domain, self.weights = domain, weights
        self.pool = (
            ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(domain_cfg,),
            )
            if workers
            else None
        )
        self.pending: dict[int, Future[Score]] = {}

    def submit(self, index: int, episode: Any) -> None:
        """Start scoring the batch's episode `index` now (with workers; else a no-op: `collect`
        scores it)."""
        if self.pool is not None:
            self.pending[index] = self.pool.submit(
                _score_in_worker,
                episode.task,
                episode.response,
                episode.tool_calls,
                episode.finish_reason == "length",
            )

    def collect(self, episodes: list[Any]) -> tuple[np.ndarray, list[Score]]:
        """Every episode's reward (Σ weight × component) and score, in the batch's order."""
        items: list[Scored] = [
            (e.task, e.response, e.tool_calls, e.finish_reason == "length") for e in episodes
        ]
        if self.pool is None:
            scores = score_all(self.domain, items)
        else:
            scores = [
                (self.pending.pop(i, None) or self.pool.submit(_score_in_worker, *item)).result()
                for i, item in enumerate(items)
            ]
            if isinstance(self.domain, JudgedDomain):
                judged = [j.component for j in self.domain.judges]
                verdicts = self.domain.judge_values(judged, items)
                scores = [
                    Score(s.components | {c: verdicts[c][i] for c in judged}, s.correct)
                    for i, s in enumerate(scores)
                ]
        self.pending.clear()
        rewards = np.array(
            [sum(w * s.components[name] for name, w in self.weights.items()) for s in scores]
        )
        return rewards, scores

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
