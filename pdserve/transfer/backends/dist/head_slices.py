"""Which prefill rank sends which KV heads to which decode rank, for workers at any two TP sizes
(docs/architecture/data-plane.md, per-rank-pair links).

A worker at TP `n` splits the model's `num_kv_heads` KV heads as the engine does
(`pdserve.engine.parallel.tensor_parallel.ModelSplit`): rank r holds `num_kv_heads / n` heads from
`r * num_kv_heads // n`, or, with fewer heads than ranks, one head replicated on
`n / num_kv_heads` ranks. Each decode rank gets each head it holds exactly once, from one
prefill rank that holds it; where several prefill ranks hold a replicated head, decode ranks
take it from them in turn, so the sends spread over them. Both sides compute the same plan
from the two TP sizes they exchanged at the handshake.

A piece of a room travels as one transfer per (prefill rank, decode rank) pair in the plan: the
pair's heads of the piece's target pages, `[2, layers, pages, page_size, heads, head_dim]`, and
on the pair of rank 0s the draft's pages after them (drafts live on rank 0 alone). Between two
TP 1 workers that is one transfer of every head and the draft: the bytes a `KVStager` gathers.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


class HeadSplitError(ValueError):
    """A TP size that does not split the model's KV heads."""


def check_split(num_kv_heads: int, tp_size: int) -> None:
    if tp_size < 1 or num_kv_heads < 1:
        raise HeadSplitError(f"TP size {tp_size} and {num_kv_heads} KV heads must be positive")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise HeadSplitError(
            f"TP size {tp_size} does not split the model's {num_kv_heads} KV heads (one must "
            "divide the other)"
        )


def tp_mismatch(num_kv_heads: int, peer_tp_size: int, peer_side: str) -> str | None:
    """Why a peer's tensor-parallel size cannot pair with us over torch.distributed (each of
    its ranks exchanges the KV heads it holds with ours), or None."""
    try:
        check_split(num_kv_heads, peer_tp_size)
    except HeadSplitError as e:
        return f"{peer_side}'s tensor-parallel size: {e}"
    return None


def kv_heads_of(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads rank `rank` of a worker at TP `tp_size` holds."""
    check_split(num_kv_heads, tp_size)
    start = rank * num_kv_heads // tp_size
    return range(start, start + max(num_kv_heads // tp_size, 1))


@dataclass(frozen=True)
class HeadSlice:
    """Heads [first, first + count) go from prefill rank `src` to decode rank `dst`."""

    src: int
    dst: int
    first: int
    count: int


def head_slices(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[HeadSlice]:
    """The plan, ordered by (src, dst): at most one slice per pair of ranks (both sides hold
    contiguous heads, so a pair's common heads are one run)."""
    check_split(num_kv_heads, prefill_tp)
    check_split(num_kv_heads, decode_tp)
    holders: dict[int, list[int]] = {}
    for rank in range(prefill_tp):
        for head in kv_heads_of(num_kv_heads, prefill_tp, rank):
            holders.setdefault(head, []).append(rank)
    runs: dict[tuple[int, int], list[int]] = {}
    for dst in range(decode_tp):
        for head in kv_heads_of(num_kv_heads, decode_tp, dst):
            ranks = holders[head]
            src = ranks[dst % len(ranks)]  # NOTE: replicated heads come from each holder in turn
            runs.setdefault((src, dst), []).append(head)
    return [HeadSlice(src, dst, heads[0], len(heads)) for (src, dst), heads in sorted(runs.items())]


@dataclass(frozen=True)
class LinkPart:
    """What one piece sends over the link from prefill rank `src` to decode rank `dst`: its
    heads (none: the draft's pages only), and the draft's pages if `draft`."""

    src: int
    dst: int
    first_head: int
    num_heads: int
    draft: bool

    def nbytes(
        self, head_page_bytes: int, draft_page_bytes: int, pages: int, draft_pages: int
    ) -> int:
        """Bytes of this part for a piece of `pages` target and `draft_pages` draft pages."""
        draft = draft_page_bytes * draft_pages if self.draft else 0
        return head_page_bytes * self.num_heads * pages + draft


def link_parts(slices: list[HeadSlice], has_draft: bool) -> list[LinkPart]:
    """A piece's transfers, in the order both sides post them: one per pair in the plan, the
    draft's pages with the rank 0s' (the plan always has that pair: both hold head 0, and
    decode rank 0 takes it from its first holder, prefill rank 0)."""
    return [
        LinkPart(s.src, s.dst, s.first, s.count, has_draft and s.src == s.dst == 0) for s in slices
    ]


@dataclass(frozen=True)
class PeerLinks:
    """A peer worker's links as rank 0 knows them: their number (the ranks know the peer by
    it) and the plan between the two workers' ranks."""

    id: int
    slices: tuple[HeadSlice, ...]

    def pair_name(self, base: str, src: int, dst: int) -> str:
        """The pair group of prefill rank `src` and decode rank `dst` (the rank 0s' is
        `base`, as between two workers without tensor parallelism)."""
        return base if src == dst == 0 else f"{base}/{src}-{dst}"
