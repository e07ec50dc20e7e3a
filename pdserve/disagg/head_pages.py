"""A run of one rank's KV heads of some pages, as a per-rank-pair link moves it: flat bytes of
`[2, layers, pages, page_size, heads, head_dim]` (`head_slices`). With every
head the rank holds, these are the bytes a `KVStager` moves (its faster whole-row copy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.ranks.tensor_parallel_kv import page_index
from pdserve.transfer.kv_staging import KVStager

if TYPE_CHECKING:
    from pdserve.engine.runtime.kv_pool import KVPool


def _local(pool: KVPool, held: range, first: int, count: int) -> int:
    """The pool's index of the model's head `first` (this rank holds `held`)."""
    if count < 1 or first < held.start or first + count > held.stop:
        raise ValueError(f"heads [{first}, {first + count}) are not among this rank's {held}")
    return first - held.start


def gather_head_pages(
    pool: KVPool,
    held: range,
    pages: list[int],
    first: int,
    count: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Heads [first, first + count) of `pages` as one flat uint8 buffer on the pool's device
    (into `out`, `head_page_bytes(pool) * count * len(pages)` bytes, if given)."""
    local = _local(pool, held, first, count)
    if count == pool.num_kv_heads:
        return KVStager([pool]).gather([pages], out=out)
    heads = pool.storage.narrow(4, local, count)
    if out is None:
        return heads.index_select(2, page_index(pool, pages)).view(-1).view(torch.uint8)
    shape = (2, pool.num_layers, len(pages), pool.page_size, count, pool.head_dim)
    torch.index_select(heads, 2, page_index(pool, pages), out=out.view(pool.dtype).view(shape))
    return out


def scatter_head_pages(
    pool: KVPool, held: range, pages: list[int], first: int, count: int, data: torch.Tensor
) -> None:
    """Write a buffer made by `gather_head_pages` (here or by the peer's rank) into `pages`."""
    local = _local(pool, held, first, count)
    if count == pool.num_kv_heads:
        KVStager([pool]).scatter([pages], data)
        return
    expected = head_page_bytes(pool) * count * len(pages)
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise ValueError(f"{data.numel()} bytes for {count} heads of {len(pages)} pages")
    shape = (2, pool.num_layers, len(pages), pool.page_size, count, pool.head_dim)
    rows = data.to(pool.device).view(pool.dtype).view(shape)
    pool.storage.narrow(4, local, count).index_copy_(2, page_index(pool, pages), rows)


def head_page_bytes(pool: KVPool) -> int:
    """Bytes of one KV head of one page (every layer, K and V)."""
    return pool.nbytes // pool.num_pages // pool.num_kv_heads
