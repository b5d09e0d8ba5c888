"""Backends run training jobs. One protocol (`base.Backend`), one module per backend.

`BACKEND_TYPES` is the one registry of backends by name (a factory taking the shared
cache dir); a caller that brings its own backends (tests, `evolve`) hands them to
`load_context(ws, backends=...)` / `Reconciler(ws, backends=...)` instead."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from evotrainer.backends.base import Backend
from evotrainer.errors import EvoError


def _local(cache_dir: Path | None) -> Backend:
    from evotrainer.backends.local import LocalBackend

    return LocalBackend(cache_dir)


def _verl(cache_dir: Path | None) -> Backend:
    from evotrainer.backends.verl import VerlBackend

    return VerlBackend()


BACKEND_TYPES: dict[str, Callable[[Path | None], Backend]] = {"local": _local, "verl": _verl}


def get_backend(name: str, cache_dir: Path | None = None) -> Backend:
    factory = BACKEND_TYPES.get(name)
    if factory is None:
        raise EvoError(f"unknown backend {name!r}", field="recipe.backend",
                       hint=" or ".join(sorted(BACKEND_TYPES)))
    return factory(cache_dir)


class Backends:
    """The backends one command uses, by name: those `given`, else made once from the
    registry (sharing `cache_dir`, the warm-start cache)."""

    def __init__(
        self, given: Mapping[str, Backend] | None = None, cache_dir: Path | None = None
    ) -> None:
        self._made: dict[str, Backend] = dict(given or {})
        self.cache_dir = cache_dir

    def __getitem__(self, name: str) -> Backend:
        if name not in self._made:
            self._made[name] = get_backend(name, self.cache_dir)
        return self._made[name]

    def get(self, name: str) -> Backend:
        return self[name]
