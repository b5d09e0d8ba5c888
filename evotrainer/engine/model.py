"""Models and tokenizers for the embedded engine: a tiny Qwen2/Llama built from the recipe with
a character tokenizer built locally (no downloads), or a local HF checkpoint directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from evotrainer.errors import EvoError

# save_pretrained's shard progress bar would interleave with the run's own progress.
hf_logging.disable_progress_bar()

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Printable ASCII covers every domain's prompts, actions and observations.
ALPHABET = [chr(c) for c in range(32, 127)]
CONFIGS = {"qwen2": Qwen2Config, "llama": LlamaConfig}


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


def load_checkpoint(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local HF checkpoint directory (model + tokenizer), on CPU in float32."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise EvoError(
            f"no Hugging Face checkpoint at {path}",
            field="model.path",
            hint="point model.path at a directory written by save_pretrained",
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.eos_token_id is None:
        raise EvoError(
            f"the tokenizer at {path} has no eos token",
            field="model.path",
            hint="save a tokenizer with an eos_token next to the model",
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model, tokenizer


def initial_model(
    model_cfg: dict[str, Any], seed: int
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model GRPO starts from before any warm start: `model.path` wins over `model.tiny`."""
    if model_cfg.get("path"):
        return load_checkpoint(model_cfg["path"])
    tokenizer = char_tokenizer()
    return build_tiny(model_cfg["tiny"], tokenizer, seed), tokenizer


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """save_pretrained (safetensors) into a temporary sibling, then rename into place."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
