"""Full-size checkpoints with random weights and real public configs, for benchmarks.

Speed does not depend on weight values, so a real model's config with random weights measures
what the real model would. The model is never built in Python: tensors are generated per
parameter name and written shard by shard, so memory stays near one shard.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from pdserve.engine.checkpoint.dtypes import parse_dtype
from pdserve.synthetic.tiny_tokenizer import build_tokenizer


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "factor": factor,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }


def _llama_preset(**fields: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
        **fields,
    }


def _qwen2_preset(**fields: Any) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "model_type": "qwen2",
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        **fields,
    }


# Config dicts as published in the models' config.json (base models, transformers 4 format:
# `rope_scaling` + `rope_theta`; transformers 5 folds them into `rope_parameters` on load).
RANDOM_MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _llama_preset(
        head_dim=64,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        rope_scaling=_llama3_rope(32.0),
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": _llama_preset(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        rope_scaling=_llama3_rope(8.0),
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": _qwen2_preset(
        hidden_size=896,
        intermediate_size=4864,
        max_position_embeddings=32768,
        max_window_layers=24,
        num_attention_heads=14,
        num_hidden_layers=24,
        num_key_value_heads=2,
        sliding_window=32768,
        tie_word_embeddings=True,
        vocab_size=151936,
    ),
    "qwen2.5-7b": _qwen2_preset(
        hidden_size=3584,
        intermediate_size=18944,
        max_position_embeddings=131072,
        max_window_layers=28,
        num_attention_heads=28,
        num_hidden_layers=28,
        num_key_value_heads=4,
        sliding_window=131072,
        tie_word_embeddings=False,
        vocab_size=152064,
    ),
}


def random_model_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a llama or qwen2 `config`, in file order."""
    model_type = config["model_type"]
    if model_type not in ("llama", "qwen2"):
        raise ValueError(f"random weights support model types llama and qwen2, not {model_type}")
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // num_heads
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    # Qwen2 always has q/k/v biases; Llama's attention_bias adds them to all four projections.
    llama_bias = model_type == "llama" and config.get("attention_bias", False)
    qkv_bias = model_type == "qwen2" or llama_bias
    mlp_bias = model_type == "llama" and config.get("mlp_bias", False)

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        projections = {
            f"{attn}.q_proj": ((q_size, hidden), qkv_bias),
            f"{attn}.k_proj": ((kv_size, hidden), qkv_bias),
            f"{attn}.v_proj": ((kv_size, hidden), qkv_bias),
            f"{attn}.o_proj": ((hidden, q_size), llama_bias),
            f"{mlp}.gate_proj": ((inter, hidden), mlp_bias),
            f"{mlp}.up_proj": ((inter, hidden), mlp_bias),
            f"{mlp}.down_proj": ((hidden, inter), mlp_bias),
        }
        for prefix, ((out_features, in_features), has_bias) in projections.items():
            shapes[f"{prefix}.weight"] = (out_features, in_features)
            if has_bias:
                shapes[f"{prefix}.bias"] = (out_features,)
        shapes[f"model.layers.{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"model.layers.{layer}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _plan_shards(
    shapes: dict[str, tuple[int, ...]], itemsize: int, max_shard_bytes: int
) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, shape in shapes.items():
        nbytes = itemsize * torch.Size(shape).numel()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += nbytes
    return shards


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    # A per-name seed keeps each tensor independent of sharding and of the layer count.
    name_seed = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(name_seed >> 1)
    return torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=generator)


def _shard_files(num_shards: int) -> Iterator[str]:
    if num_shards == 1:
        yield "model.safetensors"
        return
    for index in range(1, num_shards + 1):
        yield f"model-{index:05d}-of-{num_shards:05d}.safetensors"


def make_random_model(
    out_dir: str | os.PathLike,
    preset: str,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    num_layers: int | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> Path:
    """Write a full-size `preset` checkpoint with random weights, for benchmarks.

    Weights are normal(0, 0.02) (norms are ones), written in shards of at most
    `max_shard_bytes` plus `model.safetensors.index.json` (a single shard is written as
    `model.safetensors`, as `transformers` does). `num_layers` truncates the model.
    The tiny tokenizer is written alongside: its vocabulary is much smaller than the
    model's, and the config's bos/eos ids are rewritten to the tokenizer's special tokens.
    """
    if preset not in RANDOM_MODEL_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(RANDOM_MODEL_PRESETS)}")
    torch_dtype = parse_dtype(dtype)
    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)

    config = copy.deepcopy(RANDOM_MODEL_PRESETS[preset])
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
        if "max_window_layers" in config:
            config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    config["torch_dtype"] = dtype
    config["bos_token_id"] = tokenizer.bos_token_id
    config["eos_token_id"] = tokenizer.eos_token_id
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    shapes = random_model_tensor_shapes(config)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shards = _plan_shards(shapes, itemsize, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for file_name, names in zip(_shard_files(len(shards)), shards, strict=True):
        tensors = {name: _random_tensor(name, shapes[name], torch_dtype, seed) for name in names}
        save_file(tensors, out_dir / file_name, metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(names, file_name))
    if len(shards) > 1:
        total_size = itemsize * sum(torch.Size(shape).numel() for shape in shapes.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        index_path = out_dir / "model.safetensors.index.json"
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir
