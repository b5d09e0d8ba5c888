"""Backends run training jobs. One protocol (`base.Backend`), one module per backend."""

from __future__ import annotations

from evotrainer.backends.base import Backend
from evotrainer.errors import EvoError


def get_backend(name: str, cache_dir=None) -> Backend:
    if name == "local":
        from evotrainer.backends.local import LocalBackend

        return LocalBackend(cache_dir)
    if name == "verl":
        from evotrainer.backends.verl import VerlBackend

        return VerlBackend()
    raise EvoError(f"unknown backend {name!r}", field="recipe.backend", hint="local or verl")
