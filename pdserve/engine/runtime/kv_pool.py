"""The paged KV cache tensors.

Per layer, K and V are `[num_pages, page_size, kv_heads, head_dim]` views into one allocation,
so a whole request's pages can later be gathered for transfer with one index per layer.
Which page belongs to whom is the (torch-free) `PageAllocator`'s business, not this class's.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (2, num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self.storage[0].unbind(0))
        self.v = list(self.storage[1].unbind(0))

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V (`[T, kv_heads, head_dim]`) at flat slots
        `page * page_size + offset`."""
        flat_shape = (-1, self.num_kv_heads, self.head_dim)
        self.k[layer].view(flat_shape).index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].view(flat_shape).index_copy_(0, slots, v.to(self.dtype))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K and V at flat slots `src` to slots `dst`."""
        flat = self.storage.view(2, self.num_layers, -1, self.num_kv_heads, self.head_dim)
        flat.index_copy_(2, dst, flat.index_select(2, src))
