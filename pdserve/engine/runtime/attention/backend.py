"""The interface every attention backend implements: the torch reference and Triton."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from pdserve.engine.runtime.attention.context import AttentionContext
from pdserve.engine.runtime.kv_pool import KVPool


class RotaryTables(Protocol):
    """What a backend reads of the rotary embedding: `[max_positions, head_dim]` float32
    tables (each row [cos, cos] / [sin, sin] over the two halves), and the torch rotation."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class AttentionBackend(ABC):
    """Applies the rotary embedding to a layer's new q/k, stores the new K/V in the paged
    cache and attends each query over its sequence's cached keys (causal, optional sliding
    window, or the context's explicit masks)."""

    # Whether layers built with this backend use the fused Triton norm and activation kernels.
    fused_elementwise: bool = False
    # Whether a decode-only forward over static inputs can be captured in a CUDA graph: no
    # host syncs, no shapes that depend on the data, and padding rows (slot -1, KV length 0)
    # that write nothing and read nothing.
    graph_capturable: bool = False

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        positions: torch.Tensor,  # [T]
        kv_pool: KVPool,
        ctx: AttentionContext,
        *,
        rotary: RotaryTables,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...
