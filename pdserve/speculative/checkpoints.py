"""Writing EAGLE draft checkpoints in the Hugging Face layout the server loads: `config.json`
plus `model.safetensors` with the checkpoint names (separate q/k/v and gate/up projections,
`layers.N.*` or the legacy `midlayer.*`). Used by `pdserve train-eagle` and by tests, which
build seeded random drafts for a tiny target."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve.engine.checkpoint.model_config import ModelConfig
from pdserve.engine.runtime.attention import TorchReferenceBackend
from pdserve.engine.runtime.models.eagle import EagleConfig, EagleDraftModel


def eagle_draft_config(
    target: ModelConfig,
    *,
    eagle3: bool = True,
    hidden_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    num_layers: int = 1,
    aux_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
    fc_norm: bool = False,
    legacy_fc_norm_key: bool = False,
) -> dict[str, Any]:
    """An HF config for an EAGLE(-3) draft of `target` (Llama-style layers)."""
    hidden = hidden_size or target.hidden_size
    heads = num_heads or target.num_heads
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate_size or 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": num_kv_heads or heads,
        "head_dim": hidden // heads,
        "num_hidden_layers": num_layers,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": target.rms_norm_eps,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_parameters": dict(target.rope_parameters),
        "tie_word_embeddings": False,
        "target_hidden_size": target.hidden_size,
    }
    if eagle3:
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
        if draft_vocab_size is not None:
            config["draft_vocab_size"] = draft_vocab_size
        if fc_norm:
            config["use_aux_norm" if legacy_fc_norm_key else "fc_norm"] = True
    return config


def build_draft_model(
    config: dict[str, Any], target: ModelConfig, max_positions: int = 4096
) -> EagleDraftModel:
    """A float32 CPU draft model for this config (random weights; see `save_draft`)."""
    return EagleDraftModel(
        EagleConfig.from_dict(config, target), TorchReferenceBackend(), max_positions
    )


def save_draft(
    model: EagleDraftModel,
    config: dict[str, Any],
    out_dir: str | os.PathLike,
    *,
    legacy_midlayer: bool = False,
    include_embeddings: bool = True,
) -> Path:
    """Write `config.json` and `model.safetensors` (checkpoint names) to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = model.config.layers
    q = layers.num_heads * layers.head_dim
    kv = layers.num_kv_heads * layers.head_dim
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if "rotary" in name or (name == "d2t" and model.d2t is None):
            continue
        if name.startswith("embed_tokens") and not include_embeddings:
            continue
        if name.startswith("layers.0.fc."):
            name = name.removeprefix("layers.0.")
        tensor = tensor.detach().cpu().contiguous()
        if ".qkv_proj." in name:
            for part, chunk in zip(("q", "k", "v"), tensor.split([q, kv, kv]), strict=True):
                tensors[name.replace("qkv_proj", f"{part}_proj")] = chunk.clone()
        elif ".gate_up_proj." in name:
            gate, up = tensor.split(layers.intermediate_size)
            tensors[name.replace("gate_up_proj", "gate_proj")] = gate.clone()
            tensors[name.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            tensors[name] = tensor
    if legacy_midlayer:
        tensors = {
            (("midlayer." + k.removeprefix("layers.0.")) if k.startswith("layers.0.") else k): v
            for k, v in tensors.items()
        }
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@torch.no_grad()
def make_tiny_eagle_draft(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    seed: int = 0,
    init_std: float = 0.1,
    legacy_midlayer: bool = False,
    draft_vocab_ids: list[int] | None = None,
    **config_fields: Any,
) -> Path:
    """A seeded random EAGLE(-3) draft for the target in `target_dir` (tests: random drafts
    exercise every code path; verification keeps the output exact whatever they propose).
    `draft_vocab_ids`: the target ids of a reduced draft vocabulary (writes d2t)."""
    target = ModelConfig.from_pretrained(target_dir)
    if draft_vocab_ids is not None:
        config_fields["draft_vocab_size"] = len(draft_vocab_ids)
    config = eagle_draft_config(target, **config_fields)
    model = build_draft_model(config, target)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=generator)
        param.copy_(1.0 + 0.05 * values if name.endswith("norm.weight") else init_std * values)
    if draft_vocab_ids is not None:
        ids = torch.tensor(draft_vocab_ids, dtype=torch.int64)
        model.d2t.copy_(ids - torch.arange(len(ids)))
    return save_draft(model, config, out_dir, legacy_midlayer=legacy_midlayer)
