"""The interface every attention backend implements (torch reference now, Triton later)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.engine.attention.context import AttentionContext
from pdserve.engine.kv_pool import KVPool


class AttentionBackend(ABC):
    """Stores a layer's new K/V in the paged cache and attends each query over its sequence's
    cached keys (causal, optional sliding window)."""

    # Whether layers built with this backend use the fused Triton norm and activation kernels.
    fused_elementwise: bool = False

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        kv_pool: KVPool,
        ctx: AttentionContext,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...
