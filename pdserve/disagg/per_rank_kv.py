"""A worker's KV pages as per-rank-pair links move them (torch.distributed backends;
docs/architecture/data-plane.md): each rank sends or receives only the KV heads it holds,
straight to or from the peer worker's ranks that hold them (`head_slices` plans which), so
no rank gathers another's heads and the KV crosses neither worker's own group.

Rank 0 does its own parts here and tells the other ranks to do theirs (`rank_links`), in order
with the passes: on a prefill worker each piece is gathered on every rank right behind the
chunk that wrote it; on a decode worker each rank writes what it received into the same page
ids at the commit. A speculative draft's pools (on rank 0 alone) travel with the rank 0s'
part. A worker without tensor parallelism is the case of one rank.

Its `page_bytes` are a TP 1 worker's, every KV head of a page: what the ledgers on both sides
count, whatever the two TP sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.disagg.head_pages import gather_head_pages, head_page_bytes, scatter_head_pages
from pdserve.engine.ranks.tensor_parallel_kv import check_pages
from pdserve.protocol.rank_messages import RankCommitSlices, RankSendSlices, flatten
from pdserve.transfer.backends.dist.head_slices import LinkPart, PeerLinks, kv_heads_of, link_parts
from pdserve.transfer.kv_staging import KVStager

if TYPE_CHECKING:
    from pdserve.engine.ranks.rank_group import RankGroup
    from pdserve.engine.runtime.kv_pool import KVPool


class PerRankKV:
    def __init__(self, pool: KVPool, draft_pools: list, ranks: RankGroup | None, num_kv_heads: int):
        self.pool = pool
        self.pools = [pool, *draft_pools]
        self.drafts = KVStager(draft_pools) if draft_pools else None
        self.ranks = ranks
        self.tp_size = ranks.split.size if ranks is not None else 1
        self.held = kv_heads_of(num_kv_heads, self.tp_size, 0)
        self.device = pool.device
        self.head_page_bytes = head_page_bytes(pool)
        draft_bytes = self.drafts.page_bytes if self.drafts is not None else []
        self.page_bytes = [self.head_page_bytes * num_kv_heads, *draft_bytes]

    # ---- prefill ---------------------------------------------------------------------

    def gather_piece(
        self, links: PeerLinks, page_ids: list[list[int]]
    ) -> tuple[list[tuple[int, torch.Tensor]], int]:
        """Gather a piece for the peer `links` leads to: rank 0's parts, by the decode rank
        each goes to, and how many parts the other ranks were told to send."""
        pages, draft = page_ids[0], page_ids[1] if len(page_ids) > 1 else []
        check_pages(self.pool, pages)  # NOTE: refused before any rank is told to move them
        parts = link_parts(list(links.slices), self.drafts is not None)
        remote = [part for part in parts if part.src != 0]
        for rank in sorted({part.src for part in remote}):
            mine = [part for part in remote if part.src == rank]
            self.ranks.send_to(
                rank,
                RankSendSlices(
                    links.id,
                    pages,
                    [part.dst for part in mine],
                    [part.first_head for part in mine],
                    [part.num_heads for part in mine],
                ),
            )
        sends = []
        for part in (part for part in parts if part.src == 0):
            head_bytes = self.head_page_bytes * part.num_heads * len(pages)
            draft_bytes = self.drafts.nbytes([draft]) if part.draft and draft else 0
            # NOTE: one buffer, the draft's pages right behind the heads (no concat copy).
            data = torch.empty(head_bytes + draft_bytes, dtype=torch.uint8, device=self.device)
            heads = data[:head_bytes]
            gather_head_pages(self.pool, self.held, pages, part.first_head, part.num_heads, heads)
            if draft_bytes:
                self.drafts.gather([draft], out=data[head_bytes:])
            sends.append((part.dst, data))
        return sends, len(remote)

    # ---- decode ----------------------------------------------------------------------

    def commit_parts(
        self,
        room: int,
        pieces: list[tuple[int, list[list[int]], dict[int, torch.Tensor], list[LinkPart]]],
    ) -> None:
        """Write a complete room's pieces into their pages: rank 0's parts (`buffers`, by
        prefill rank) here, the other ranks' by telling them."""
        orders: dict[int, tuple[list[int], list[list[int]]]] = {}  # rank -> pieces, pages
        for index, page_ids, buffers, parts in pieces:
            pages, draft = page_ids[0], page_ids[1] if len(page_ids) > 1 else []
            check_pages(self.pool, pages)
            for part in parts:
                if part.dst != 0:
                    indices, page_lists = orders.setdefault(part.dst, ([], []))
                    if not indices or indices[-1] != index:
                        indices.append(index)
                        page_lists.append(pages)
                    continue
                data = buffers[part.src]
                split_at = self.head_page_bytes * part.num_heads * len(pages)
                target = data[:split_at]
                scatter_head_pages(
                    self.pool, self.held, pages, part.first_head, part.num_heads, target
                )
                if part.draft and draft:
                    self.drafts.scatter([draft], data[split_at:])
        if not orders:
            return
        per_piece = {}
        for part in pieces[0][3]:
            per_piece[part.dst] = per_piece.get(part.dst, 0) + 1
        for rank, (indices, page_lists) in orders.items():
            flat, counts = flatten(page_lists)
            self.ranks.send_to(rank, RankCommitSlices(room, indices, flat, counts, per_piece[rank]))
