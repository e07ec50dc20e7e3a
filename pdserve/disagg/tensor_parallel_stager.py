"""A tensor-parallel worker's rank 0 staging a handoff's KV over tcp (nccl and gloo move each
rank's heads on links of its own: `per_rank_kv`): `KVStager`'s interface over the
pages of every rank, in the layout of one rank with every KV head
(`pdserve.engine.ranks.tensor_parallel_kv` says why and how), so that the transfer layer, the
prefill and decode handoffs and the peer at any TP size see a TP 1 worker's pages."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.ranks.tensor_parallel_kv import gather_heads, scatter_heads
from pdserve.transfer.kv_staging import KVStager

if TYPE_CHECKING:
    from pdserve.engine.parallel.tensor_parallel import TensorParallel
    from pdserve.engine.ranks.rank_group import RankGroup
    from pdserve.engine.runtime.kv_pool import KVPool


class TensorParallelStager(KVStager):
    """`KVStager` for a tensor-parallel worker's rank 0: the target pool's pages in the layout
    of one rank with every head, gathered from and scattered to every rank; a speculative
    draft's pools (on rank 0 alone, every head) as `KVStager` moves them."""

    def __init__(self, ranks: RankGroup, pool: KVPool, draft_pools: list):
        super().__init__([pool, *draft_pools])
        self.ranks = ranks
        self.tp: TensorParallel = ranks.tp
        self.target = pool
        self.drafts = KVStager(draft_pools) if draft_pools else None
        self.num_kv_heads = self.tp.split.num_kv_heads

    @property
    def page_bytes(self) -> list[int]:
        """Bytes per page of each pool: the target's with every KV head, then the draft's."""
        local = self.target.nbytes // self.target.num_pages // self.target.num_kv_heads
        return [local * self.num_kv_heads, *(self.drafts.page_bytes if self.drafts else [])]

    def gather(self, page_ids: list[list[int]]) -> torch.Tensor:
        """The pages (one id list per pool) as one flat uint8 buffer on rank 0's device."""
        self._check_counts(page_ids)
        pages = page_ids[0]
        self._index(self.target, pages)  # NOTE: refused before any rank is told to move them
        try:
            self.ranks.gather_kv(pages)
            target = gather_heads(self.tp, self.target, pages)
        except Exception as e:
            raise self.ranks.abandon(f"gathering KV for a transfer failed: {e}") from e
        parts = [target.view(-1).view(torch.uint8)]
        if self.drafts is not None:
            parts.append(self.drafts.gather(page_ids[1:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def scatter(self, page_ids: list[list[int]], buffer: torch.Tensor) -> None:
        """Write a buffer made by `gather` (or by a `KVStager` of a worker at another TP
        size) into these pages on every rank."""
        self._check_buffer(page_ids, buffer)
        pages = page_ids[0]
        self._index(self.target, pages)
        split_at = len(pages) * self.page_bytes[0]
        pool = self.target
        full = (
            buffer[:split_at]
            .to(self.device)
            .view(pool.dtype)
            .view(2, pool.num_layers, len(pages), pool.page_size, self.num_kv_heads, -1)
        )
        try:
            self.ranks.scatter_kv(pages)
            scatter_heads(self.tp, pool, pages, full)
        except Exception as e:
            raise self.ranks.abandon(f"committing transferred KV failed: {e}") from e
        if self.drafts is not None:
            self.drafts.scatter(page_ids[1:], buffer[split_at:])
