"""A tensor-parallel worker's KV pages as a handoff over tcp moves them: in the layout of one
rank that holds every KV head, whatever the worker's TP size. (Over nccl and gloo each rank
moves its own heads instead: `pdserve.disagg.per_rank_kv`.)

Each rank's pool holds its KV heads of every page (`tensor_parallel.py`): `[2, layers, pages,
page_size, kv_heads / size, head_dim]`, or one replicated head when the model has fewer KV
heads than ranks. A transfer carries `[2, layers, pages, page_size, kv_heads, head_dim]`, the
bytes a TP 1 worker's `KVStager` gathers, so a prefill worker at TP p and a decode worker at
TP d agree on the wire for any p and d (the handshake compares the model's KV heads, not a
rank's):

- a prefill worker gathers a piece's pages on every rank and collects the heads on rank 0
  (one gather in the group), which lays them side by side and sends them;
- a decode worker's rank 0 receives the room, and at commit hands each rank its heads (one
  scatter in the group); each rank writes them into the same page ids (page ids are the same
  on every rank).

NOTE: the KV crosses the group once more on each side (through rank 0's GPU), and a pair's KV
travels over rank 0's connection alone; with tcp the host copies cost more than both.

Rank 0 announces each gather and scatter to the other ranks first (`RankGatherKV`,
`RankScatterKV`, in order with the passes), as it announces forward passes; a failure inside
one stops every rank (`RankGroup.abandon`), as a failed pass does. What rank 0 does with the
pages is `pdserve.disagg.tensor_parallel_stager`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pdserve.engine.runtime.forward_batch import device_ints

if TYPE_CHECKING:
    from pdserve.engine.parallel.tensor_parallel import TensorParallel
    from pdserve.engine.runtime.kv_pool import KVPool


def head_holders(tp: TensorParallel) -> list[int]:
    """The ranks whose heads, side by side in rank order, are every KV head once: all of them,
    or the first of each run of ranks that share a replicated head."""
    split = tp.split
    holders, seen = [], set()
    for rank in range(tp.size):
        start = split.kv_head_start(rank)
        if start not in seen:
            seen.add(start)
            holders.append(rank)
    return holders


class PageIdError(ValueError):
    """Page ids outside the pool (a bug on rank 0, never a peer's doing: pages are checked
    against the reservation before this)."""


def check_pages(pool: KVPool, pages: list[int]) -> None:
    """PageIdError unless every page id is in the pool (on the host: nothing is copied)."""
    if any(not 0 <= p < pool.num_pages for p in pages):
        raise PageIdError(f"page ids outside [0, {pool.num_pages}): {pages[:8]}")


def page_index(pool: KVPool, pages: list[int]) -> torch.Tensor:
    check_pages(pool, pages)
    return device_ints(pages, pool.device)


def gather_heads(tp: TensorParallel, pool: KVPool, pages: list[int]) -> torch.Tensor | None:
    """Every rank's heads of `pages` (a collective: every rank calls it). On rank 0: the
    pages with every head, `[2, layers, pages, page_size, kv_heads, head_dim]`; elsewhere
    None."""
    local = pool.storage.index_select(2, page_index(pool, pages))
    options = dist.GatherOptions()
    options.rootRank = 0
    if tp.rank != 0:
        tp.group.gather([], [local], options).wait()
        return None
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    tp.group.gather([parts], [local], options).wait()
    return torch.cat([parts[rank] for rank in head_holders(tp)], dim=4)


def scatter_heads(
    tp: TensorParallel, pool: KVPool, pages: list[int], full: torch.Tensor | None
) -> None:
    """Write each rank's heads of `full` (rank 0's; every head, as `gather_heads` returns it)
    into `pages` of every rank's pool (a collective: every rank calls it; `full` is None on
    the others)."""
    index = page_index(pool, pages)
    local = torch.empty(
        (2, pool.num_layers, len(pages), pool.page_size, pool.num_kv_heads, pool.head_dim),
        dtype=pool.dtype,
        device=pool.device,
    )
    options = dist.ScatterOptions()
    options.rootRank = 0
    if tp.rank != 0:
        tp.group.scatter([local], [], options).wait()
    else:
        heads = pool.num_kv_heads
        parts = []
        for rank in range(tp.size):
            start = tp.split.kv_head_start(rank)
            parts.append(full[:, :, :, :, start : start + heads].contiguous())
        tp.group.scatter([local], [parts], options).wait()
    pool.storage.index_copy_(2, index, local)
