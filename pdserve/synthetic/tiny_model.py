"""Seeded random checkpoints in the Hugging Face format, built offline.

Two kinds of checkpoints:

- `make_tiny_model` writes a very small model (default hidden size 64, two layers) through
  `transformers` itself, for correctness tests: pdserve's forward pass is compared with the
  `transformers` one on greedy tokens. Weights use a larger std than a real initialisation
  so that logits are peaky and greedy ties are unlikely.
- `pdserve.synthetic.random_model.make_random_model` writes full-size checkpoints for benchmarks.

Both write the tiny tokenizer of `tiny_tokenizer` next to the weights, and are deterministic:
the same arguments give byte-identical files.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from pdserve.engine.checkpoint.dtypes import parse_dtype
from pdserve.engine.checkpoint.local_cache import pdserve_cache_dir, write_cache_entry
from pdserve.synthetic.tiny_tokenizer import IM_END_TOKEN, build_tokenizer

__all__ = [
    "SUPPORTED_ARCHS",
    "TINY_MODEL_VERSION",
    "build_tokenizer",
    "default_model_dir",
    "make_tiny_model",
]

# NOTE: bump when the files written by `default_model_dir` change, so caches regenerate.
TINY_MODEL_VERSION = "1"

_NORM_NOISE_STD = 0.05
_BIAS_STD_FRACTION = 0.2


def _llama_config(num_layers: int, max_position_embeddings: int) -> dict[str, Any]:
    return {
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(1, max_position_embeddings // 8),
        },
    }


def _mistral_config(num_layers: int, max_position_embeddings: int) -> dict[str, Any]:
    return {
        "tie_word_embeddings": False,
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }


def _qwen2_config(num_layers: int, max_position_embeddings: int) -> dict[str, Any]:
    # Qwen2 attention always has q/k/v biases; no config flag is needed for them.
    return {
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "max_window_layers": num_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }


def _qwen3_config(num_layers: int, max_position_embeddings: int) -> dict[str, Any]:
    # head_dim is deliberately not hidden_size / num_heads, as in the real Qwen3 models.
    return {
        "tie_word_embeddings": False,
        "head_dim": 32,
        "attention_bias": False,
        "use_sliding_window": False,
        "max_window_layers": num_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }


_ARCH_CONFIGS = {
    "llama": _llama_config,
    "mistral": _mistral_config,
    "qwen2": _qwen2_config,
    "qwen3": _qwen3_config,
}
SUPPORTED_ARCHS: tuple[str, ...] = tuple(_ARCH_CONFIGS)


def _check_arch_and_overrides(arch: str, overrides: dict[str, Any]) -> None:
    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; supported archs: {', '.join(SUPPORTED_ARCHS)}")
    # NOTE: configs accept any keyword silently, so a typo would otherwise be lost.
    unknown = sorted(set(overrides) - set(vars(AutoConfig.for_model(arch))))
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown} for arch {arch!r}")


@torch.no_grad()
def _reinitialize(
    model: torch.nn.Module, seed: int, init_std: float, residual_scale: float = 1.0
) -> None:
    """Overwrite every parameter with seeded values: normal(0, init_std) for matrices (times
    `residual_scale` for the projections that write into the residual stream), 1 + small
    noise for norm weights, small random biases."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            values = 1.0 + _NORM_NOISE_STD * values
        elif name.endswith(".bias"):
            values = values * (_BIAS_STD_FRACTION * init_std)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            values = values * init_std * residual_scale
        else:
            values = values * init_std
        param.copy_(values)


def make_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    init_std: float = 0.1,
    shard_size: int | str | None = None,
    residual_scale: float = 1.0,
    **overrides: Any,
) -> Path:
    """Write a seeded random `arch` model with the tiny tokenizer to `out_dir`.

    `overrides` replace fields of the Hugging Face config (e.g. `head_dim=16`); an unknown
    field raises ValueError. `shard_size` (bytes or a string like "100KB") splits the weights
    into shards with a `model.safetensors.index.json`. The vocabulary is the tokenizer's,
    rounded up to a multiple of 8 (extra ids are never produced by the tokenizer).
    `generation_config.json` stops on both `<|end_of_text|>` and `<|im_end|>`.
    `residual_scale` < 1 makes the layers write weakly into the residual stream, so each token
    mostly decides the next one: the model's own text then falls into predictable loops (a
    random target a draft head can learn).
    """
    _check_arch_and_overrides(arch, overrides)
    torch_dtype = parse_dtype(dtype)
    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    token_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config_fields = {
        "vocab_size": -(-len(tokenizer) // 8) * 8,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "dtype": dtype,
        **token_ids,
        **_ARCH_CONFIGS[arch](num_layers, max_position_embeddings),
        **overrides,
    }
    config = AutoConfig.for_model(arch, **config_fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinitialize(model, seed, init_std, residual_scale)
    model = model.to(torch_dtype)
    stop_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    model.generation_config = GenerationConfig(**{**token_ids, "eos_token_id": stop_ids})
    save_kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    with _no_progress_bar():
        model.save_pretrained(out_dir, **save_kwargs)
    # NOTE: safetensors writes owner-only files; a model directory is for others to read too
    # (another user's server, a container running as another uid), as its other files are.
    for weights in out_dir.glob("*.safetensors"):
        weights.chmod(0o644)
    return out_dir


@contextlib.contextmanager
def _no_progress_bar():
    """transformers draws a progress bar on stderr while it writes shards: noise for a model
    of kilobytes, and the first `pdserve` command without a model writes this one (a bad
    flag's one `error:` line must stay the only line)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def default_model_dir() -> Path:
    """The built-in tiny model (llama, default sizes, seed 0), generated once into the cache.

    The cache is `$PDSERVE_CACHE_DIR` or `~/.cache/pdserve`. The model is written to a
    temporary directory and renamed into place, so concurrent callers never see a partial
    model; when two processes race, the loser discards its copy.
    """
    final_dir = pdserve_cache_dir() / f"tiny-llama-v{TINY_MODEL_VERSION}"
    if final_dir.is_dir():
        return final_dir
    return write_cache_entry(final_dir, make_tiny_model)
