"""Handshake checks: the two sides' layouts must agree field by field. Torch-free."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from pdserve.protocol.transfer_messages import KVLayout, SpecLayout

# HF config keys that change the shape or meaning of the KV cache and hidden states.
_FINGERPRINT_KEYS = (
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "hc_mult",
)


def model_fingerprint(hf_config: dict[str, Any]) -> str:
    """A short digest of the config fields that shape the KV cache (not the weights' path)."""
    subset = {k: hf_config.get(k) for k in _FINGERPRINT_KEYS}
    canonical = json.dumps(subset, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def layout_mismatches(prefill: KVLayout, decode: KVLayout) -> list[str]:
    """ "field: prefill X != decode Y" for every field that differs (spec fields as spec.*)."""
    found = []
    for name, ours, theirs in _fields(prefill, decode):
        if ours != theirs:
            found.append(f"{name}: prefill {ours!r} != decode {theirs!r}")
    return found


def _fields(prefill: KVLayout, decode: KVLayout):
    for field in dataclasses.fields(KVLayout):
        ours, theirs = getattr(prefill, field.name), getattr(decode, field.name)
        if isinstance(ours, SpecLayout):
            for spec_field in dataclasses.fields(SpecLayout):
                name = spec_field.name
                yield f"spec.{name}", getattr(ours, name), getattr(theirs, name)
        else:
            yield field.name, ours, theirs
