"""Messages from a tensor-parallel worker's rank 0 to its other ranks (torch-free).

Rank 0 schedules and samples; the other ranks hold their share of the weights and of every KV
page and run the same forward passes. Before each pass rank 0 sends what the pass computes
(`RankForward`); the other ranks mirror each running request's page list from what changed
(`pages_kept`, `new_pages`), so a decode step sends a few ints per request, not its pages.
Tensors that are already on the device (tokens an overlapped step sampled, drafted
proposals) follow by a broadcast in the group, not here.
"""

from __future__ import annotations

from pdserve.protocol.codec import message
from pdserve.protocol.ids import PageIds, RoomId


@message("rank_plan")
class RankPlan:
    """Start-up, once rank 0 knows it: what every pass keeps for a draft, how many tokens a
    verification computes per request (0: no speculation), a request's most pages."""

    capture_kind: str
    capture_layers: list[int]
    verify_tokens: int
    max_pages_per_request: int


@message("rank_mask")
class RankMask:
    """A sequence's attention mask over its new tokens ([rows, width], row-major)."""

    seq: int
    rows: int
    width: int
    visible: list[bool]


@message("rank_forward")
class RankForward:
    """One forward pass. Per sequence: its request (empty: none), how many of the pages the
    ranks know for it still hold and the pages after them, its computed tokens, the tokens it
    computes now (negative: placeholders for the broadcast device tokens) and their explicit
    positions (none: its slots). Per-sequence lists of ints travel flat, each with its
    per-sequence counts (`new_pages` split by `new_page_counts`, ...), so that a decode step of
    a large batch decodes in a few passes over flat arrays, not a check per sequence.
    `graphs`: which graph runner rank 0 replays ("", "decode", "verify"). `ended`: requests
    that stopped running since the last pass."""

    request_ids: list[str]
    pages_kept: list[int]
    new_pages: PageIds
    new_page_counts: list[int]
    num_computed: list[int]
    token_ids: list[int]
    token_counts: list[int]
    positions: list[int]
    position_counts: list[int]
    masks: list[RankMask]
    capture_kind: str
    capture_layers: list[int]
    graphs: str
    device_tokens_shape: list[int]
    device_tokens_dtype: str
    ended: list[str]


def flatten(lists: list[list[int]]) -> tuple[list[int], list[int]]:
    """(values, counts): `lists` as `RankForward` carries them."""
    return [v for values in lists for v in values], [len(values) for values in lists]


def split(values: list[int], counts: list[int], what: str) -> list[list[int]]:
    """`flatten`'s inverse; raises ValueError naming `what` when the counts do not add up."""
    if any(count < 0 for count in counts) or sum(counts) != len(values):
        raise ValueError(f"{what}: counts {sum(counts)} do not match {len(values)} values")
    out, start = [], 0
    for count in counts:
        out.append(values[start : start + count])
        start += count
    return out


@message("rank_logits")
class RankLogits:
    """Logits of the last pass's `rows` (None: every row); the ranks gather the vocabulary."""

    rows: list[int] | None


@message("rank_move_kv")
class RankMoveKV:
    """Copy KV from flat slots `src` to `dst` (accepted tree-draft tokens)."""

    src: list[int]
    dst: list[int]


@message("rank_gather_kv")
class RankGatherKV:
    """A prefill worker sends these target pages: every rank gathers its KV heads of them
    (every layer, K and V) to rank 0, which lays them out as one rank holding every head."""

    pages: PageIds


@message("rank_scatter_kv")
class RankScatterKV:
    """A decode worker commits KV into these target pages: rank 0 hands every rank its KV
    heads of them, and each rank writes them into its pool."""

    pages: PageIds


# ---- per-rank-pair KV links (a disaggregated worker over nccl or gloo) --------------------
# Rank 0 keeps the control plane (rooms, ledgers, deadlines, metadata); each rank moves its
# own KV heads over links of its own to the peer worker's ranks (`head_slices`
# says which). These go to one rank each, in order with the passes; none is a collective.


@message("rank_transfer_start")
class RankTransferStart:
    """Open this rank's side of the links: `side` ("prefill" or "decode"), the torch.distributed
    `backend` and deadline, the address gloo listens on (empty: gloo's choice), and where to
    report (`RankTransferReport`, a ZMQ PULL socket on rank 0)."""

    side: str
    backend: str
    timeout_s: float
    local_host: str
    reports: str


@message("rank_link_connect")
class RankLinkConnect:
    """Join the pair group `pair` (at the decode worker's store) with rank `peer_rank` of the
    peer worker that rank 0 knows as `link`."""

    link: int
    peer_rank: int
    store: str
    pair: str


@message("rank_link_forget")
class RankLinkForget:
    """The peer worker `link` was dropped: close every link to its ranks."""

    link: int


@message("rank_send_slices")
class RankSendSlices:
    """Prefill: gather this rank's heads [first_heads[i], + num_heads[i]) (the model's head
    numbers) of these target pages and send them to decode rank `dsts[i]` of peer `link`."""

    link: int
    pages: PageIds
    dsts: list[int]
    first_heads: list[int]
    num_heads: list[int]


@message("rank_receive_slices")
class RankReceiveSlices:
    """Decode: post receives for piece `index` of `room` (`scratch`: a room that ended; what
    lands is dropped) from prefill ranks `srcs[i]` of peer `link`, `nbytes[i]` each, holding
    heads [first_heads[i], + num_heads[i])."""

    room: RoomId
    index: int
    scratch: bool
    link: int
    srcs: list[int]
    nbytes: list[int]
    first_heads: list[int]
    num_heads: list[int]


@message("rank_commit_slices")
class RankCommitSlices:
    """Decode: write what landed for these pieces of `room` into their target pages
    (`pages` flat, `page_counts` per piece), then let the buffers go; each piece has `parts`
    parts on this rank."""

    room: RoomId
    indices: list[int]
    pages: PageIds
    page_counts: list[int]
    parts: int


@message("rank_drop_slices")
class RankDropSlices:
    """Decode: `room` ended without a commit: drop what landed for it, and what lands later."""

    room: RoomId


@message("rank_transfer_report")
class RankTransferReport:
    """A rank -> rank 0: a transfer ended (`kind` "sent" or "landed", for piece `index` of
    `room` on decode), or a link could not be made ("link"); `error` None on success."""

    kind: str
    rank: int
    link: int
    peer_rank: int
    room: RoomId
    index: int
    nbytes: int
    error: str | None


@message("rank_stop")
class RankStop:
    reason: str
