"""The domain registry: names → lazy import strings, so listing domains or validating a recipe
never imports a domain that is not used (or not written yet)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from evotrainer.domains.base import Domain, Environment, EnvStep, Score, Task
from evotrainer.errors import EvoError

REGISTRY: dict[str, str] = {
    "arith": "evotrainer.domains.arith:ArithDomain",
    "toolenv": "evotrainer.domains.toolenv:ToolEnvDomain",
    "math": "evotrainer.domains.math:MathDomain",
    "code": "evotrainer.domains.code:CodeDomain",
    "humaneval": "evotrainer.domains.humaneval:HumanEvalDomain",
    "swe": "evotrainer.domains.swe:SweDomain",
}


def get_domain(name: str) -> type[Domain]:
    """The domain class registered under `name` (EvoError naming `domain.name` otherwise)."""
    if name not in REGISTRY:
        raise EvoError(
            f"unknown domain {name!r}",
            field="domain.name",
            hint=f"choose one of: {', '.join(sorted(REGISTRY))}",
        )
    module_name, _, attr = REGISTRY[name].partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EvoError(
            f"domain {name!r} is registered but cannot be loaded ({exc})",
            field="domain.name",
            hint=f"{REGISTRY[name]} is not available in this installation; use another domain",
        ) from exc


def make_domain(domain_cfg: dict[str, Any]) -> Domain:
    """Instantiate the recipe's `domain` section: its `name`, `params` and, for dataset
    domains, `data` (train/val paths, relative to the job's working directory)."""
    name = domain_cfg.get("name", "")
    domain = get_domain(name)
    data = {k: v for k, v in (domain_cfg.get("data") or {}).items() if v}
    if not data:
        return domain(domain_cfg.get("params") or {})
    if "data" not in inspect.signature(domain).parameters:
        raise EvoError(f"domain {name!r} generates its own tasks and reads no data files",
                       field="domain.data", hint="remove domain.data, or use a dataset "
                       "domain (math, code, humaneval)")
    return domain(domain_cfg.get("params") or {}, data=data)


__all__ = [
    "REGISTRY",
    "Domain",
    "EnvStep",
    "Environment",
    "Score",
    "Task",
    "get_domain",
    "make_domain",
]
