"""Attention backends behind one interface, and the per-step metadata they read."""

from pdserve.engine.runtime.attention.backend import AttentionBackend
from pdserve.engine.runtime.attention.context import AttentionContext
from pdserve.engine.runtime.attention.select import make_attention_backend
from pdserve.engine.runtime.attention.torch_ref import TorchReferenceBackend

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "TorchReferenceBackend",
    "make_attention_backend",
]
