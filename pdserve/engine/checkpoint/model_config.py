"""What the engine needs to know about a model, read once from its HF `config.json`.

Architecture differences (qkv bias, q/k norm, head_dim) are resolved here into plain fields, so
model code never branches on architecture names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.protocol.metadata_spec import spec_hidden_size_of

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Where a checkpoint's config.json describes its quantization (compressed-tensors' older name).
QUANTIZATION_KEYS = ("quantization_config", "compression_config")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or a feature of it) is not implemented."""


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    # NOTE: transformers 5 writes `rope_parameters` (with rope_theta inside); older checkpoints
    # have top-level `rope_theta` and an optional `rope_scaling`. Accept both.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of a decoder-only model; built by `from_pretrained`."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    rope_parameters: dict[str, Any]
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    hf_config: dict[str, Any] = field(compare=False, repr=False)

    @property
    def spec_hidden_size(self) -> int:
        return spec_hidden_size_of(self.hf_config)

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> ModelConfig:
        path = Path(model_path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"no config.json in {path}: pass a model directory "
                "(e.g. one written by `pdserve make-tiny-model`)"
            )
        hf = json.loads(config_file.read_text())
        generation_file = path / "generation_config.json"
        if generation_file.is_file():
            # NOTE: chat models list their end-of-turn tokens here, not in config.json.
            generation_eos = json.loads(generation_file.read_text()).get("eos_token_id")
            if generation_eos is not None:
                hf = {**hf, "eos_token_id": _merge_ids(hf.get("eos_token_id"), generation_eos)}
        return cls.from_dict(hf)

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        _refuse_quantized(hf)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            intermediate_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama-family configs say so in attention_bias.
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(hf),
            rope_parameters=_rope_parameters(hf),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            eos_token_ids=eos_ids,
            hf_config=hf,
        )


def _refuse_quantized(hf: dict[str, Any]) -> None:
    """A quantized checkpoint (awq, gptq, fp8, bitsandbytes, compressed-tensors...) says so
    in config.json; pdserve runs dense weights only, so it is refused here, at start-up,
    rather than loaded as if unquantized or failing on its scale tensors later."""
    for key in QUANTIZATION_KEYS:
        quantization = hf.get(key)
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            named = f"{method!r} " if method else ""
            raise UnsupportedModelError(
                f"{named}quantized checkpoints are not supported (config.json has a {key}); "
                "pdserve runs unquantized weights (float32, float16, bfloat16) only: serve the "
                "model's unquantized release"
            )


def _merge_ids(*values: int | list[int] | None) -> list[int]:
    merged: list[int] = []
    for value in values:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in merged:
                merged.append(int(token))
    return merged


def _sliding_window(hf: dict[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if not window:
        return None
    # Qwen2/Qwen3 configs carry a window but only apply it when use_sliding_window is set.
    if "use_sliding_window" in hf and not hf["use_sliding_window"]:
        return None
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "sliding_attention" for t in layer_types):
        if all(t == "full_attention" for t in layer_types):
            return None
        raise UnsupportedModelError("models mixing sliding-window and full-attention layers")
    return int(window)
