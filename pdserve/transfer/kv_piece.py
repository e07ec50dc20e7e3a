"""A room's KV travels in pieces: each piece is the bytes of a span of the room's pages (target
pool, then draft pool), gathered into one flat buffer by `KVStager`. A prefill worker sends a
piece as soon as prefill has written its pages, so the transfer runs while later chunks are
still being computed; a room sent whole is one piece.

The receiving side keeps a `PieceLedger` per room: every announced piece is checked against
the room's own reservation before a byte is allocated for it (its pages exist, none of them
was covered by an earlier piece, its size is what those pages hold), and the room is complete
when its pieces cover every page once and have all landed. Leading target pages the receiver
already holds (from its prefix cache) are not sent: a piece may not cover them. Pieces may
arrive in any order and interleaved with other rooms' pieces.

Over torch.distributed a piece travels in parts, one per pair of ranks of the two workers
(`head_slices`): rank 0 receives its own parts into buffers the ledger holds, the other ranks
receive theirs and report when they landed; a piece has landed when every part has.

Torch-free: a piece's buffers are the data plane's (it allocates and fills them); the ledger
only holds them, slices them and hands them to the stager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.protocol.failures import Failure
from pdserve.protocol.transfer_messages import KVPiece
from pdserve.transfer.room_state import room_failure

if TYPE_CHECKING:
    import torch

    from pdserve.transfer.backends.dist.head_slices import LinkPart


@dataclass(frozen=True)
class PageSpan:
    """Target pages [first, first + count) and draft pages [draft_first, draft_first +
    draft_count), as positions in a room's page lists (not page ids)."""

    first: int
    count: int
    draft_first: int = 0
    draft_count: int = 0

    def nbytes(self, page_bytes: list[int]) -> int:
        """Bytes of this span given the bytes per page of each pool (target, then draft)."""
        counts = (self.count, self.draft_count)[: len(page_bytes)]
        return sum(n * size for n, size in zip(counts, page_bytes, strict=True))

    def page_lists(self, pages: list[int], draft_pages: list[int], num_pools: int):
        """The page ids this span covers, one list per pool."""
        lists = [
            pages[self.first : self.first + self.count],
            draft_pages[self.draft_first : self.draft_first + self.draft_count],
        ]
        return lists[:num_pools]


@dataclass
class OutgoingPiece:
    """A gathered piece on its way out. `ready` is recorded on the producing CUDA stream
    after its bytes were written (None: written already, e.g. on the CPU); the data plane
    orders the sends after it.

    `data`: the piece whole (tcp). Per-rank-pair links instead: `sends`, rank 0's parts by
    the decode rank they go to; `remote`, how many parts the other ranks posted already (the
    piece must then be announced, so that the peer posts their receives); `nbytes`, the
    piece's bytes as one rank with every head holds them (what the ledgers count).

    Written into the peer's pages already (`ipc`): neither; `targets`, the peer's pools it
    was written into, kept mapped until the write completed; `event`, the handle of `ready`
    (an interprocess event, `ipc_events`), which decode opens."""

    span: PageSpan | None
    data: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    sends: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    remote: int = 0
    nbytes: int = -1
    targets: list[torch.Tensor] = field(default_factory=list)
    event: bytes = b""

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = self.data.numel()

    def announcement(self, room: int, index: int, event: bytes = b"") -> KVPiece:
        """The `KVPiece` that announces this piece as piece `index` of `room`."""
        span = self.span
        return KVPiece(
            room,
            index,
            span.first,
            span.count,
            span.draft_first,
            span.draft_count,
            self.nbytes,
            event,
        )


@dataclass
class _Incoming:
    span: PageSpan
    # Rank 0's buffers, by the prefill rank they come from (tcp: one, from 0); a buffer is
    # gone once given back.
    buffers: dict[int, torch.Tensor]
    nbytes: int
    waiting: set[tuple[int, int]]  # parts (prefill rank, decode rank) not landed yet
    parts: list[LinkPart] | None = None  # torch.distributed: the piece's parts
    received: int = 0  # bytes landed (tcp, chunk by chunk)
    # Prefill ranks whose receive into `buffers` is posted and not done: whoever posted it
    # gives that buffer back.
    in_flight: set[int] = field(default_factory=set)
    ready: torch.cuda.Event | None = None  # `ipc`: the sender's write event


class PieceLedger:
    """The pieces of one room on the receiving side. Not thread-safe: the IO thread owns it."""

    def __init__(
        self, num_pages: int, num_draft_pages: int, page_bytes: list[int], num_cached: int = 0
    ):
        """num_cached: the room's first target pages, which the receiver holds already."""
        if not 0 <= num_cached < max(num_pages, 1):
            raise ValueError(f"{num_cached} cached pages of a room with {num_pages}")
        self.num_pages = num_pages
        self.num_draft_pages = num_draft_pages
        self.num_cached = num_cached
        self.page_bytes = page_bytes
        self.expected = PageSpan(num_cached, num_pages - num_cached, 0, num_draft_pages)
        self.expected_bytes = self.expected.nbytes(page_bytes)
        self._covered = [bytearray(num_pages), bytearray(num_draft_pages)]
        self.pieces: dict[int, _Incoming] = {}
        self.announced_bytes = 0
        self.landed_bytes = 0

    def check(self, index: int, span: PageSpan, nbytes: int) -> Failure | None:
        """What is wrong with announcing this piece, if anything (nothing is allocated)."""
        if index in self.pieces:
            return room_failure(f"KV piece {index} announced twice")
        bounds = ((span.first, span.count, self.num_pages),)
        bounds += ((span.draft_first, span.draft_count, self.num_draft_pages),)
        for first, count, reserved in bounds:
            if first < 0 or count < 0 or first + count > reserved:
                return room_failure(
                    f"KV piece {index} covers pages [{first}, {first + count}) of a room "
                    f"with {reserved} reserved"
                )
        if span.count and span.first < self.num_cached:
            return room_failure(
                f"KV piece {index} covers page {span.first}, but the first {self.num_cached} "
                "pages are the receiver's own (cached): they must not be sent"
            )
        if span.count + span.draft_count == 0:
            return room_failure(f"KV piece {index} covers no page")
        if nbytes != span.nbytes(self.page_bytes):
            return room_failure(
                f"KV piece {index} announced {nbytes} bytes for "
                f"{span.count}+{span.draft_count} pages ({span.nbytes(self.page_bytes)} bytes)"
            )
        for covered, first, count in (
            (self._covered[0], span.first, span.count),
            (self._covered[1], span.draft_first, span.draft_count),
        ):
            if any(covered[first : first + count]):
                return room_failure(f"KV piece {index} covers pages another piece already covered")
        return None

    def add(
        self, index: int, span: PageSpan, buffer: torch.Tensor, *, in_flight: bool = False
    ) -> None:
        """Record a piece `check` accepted, with the buffer its bytes land in (`in_flight`: a
        receive into it is posted; `landed` ends that)."""
        waiting = {(0, 0)}
        self._add(index, _Incoming(span, {0: buffer}, buffer.numel(), waiting))
        if in_flight:
            self.pieces[index].in_flight.add(0)

    def add_parts(
        self,
        index: int,
        span: PageSpan,
        parts: list[LinkPart],
        buffers: dict[int, torch.Tensor],
    ) -> None:
        """Record a piece `check` accepted that travels in `parts`, rank 0's landing in
        `buffers` (by prefill rank; receives into them are posted: `part_landed` ends each)."""
        nbytes = span.nbytes(self.page_bytes)
        waiting = {(part.src, part.dst) for part in parts}
        self._add(index, _Incoming(span, dict(buffers), nbytes, waiting, parts, 0, set(buffers)))

    def add_written(self, index: int, span: PageSpan, ready=None) -> None:
        """Record a piece `check` accepted whose bytes the sender wrote into our pages (`ipc`):
        it has landed, once `ready` (a CUDA event; None: already) has completed, and the commit
        has nothing to write for it but to order our work after `ready`."""
        nbytes = span.nbytes(self.page_bytes)
        self._add(index, _Incoming(span, {}, nbytes, set(), ready=ready))
        self.landed_bytes += nbytes

    def _add(self, index: int, piece: _Incoming) -> None:
        span = piece.span
        for covered, first, count in (
            (self._covered[0], span.first, span.count),
            (self._covered[1], span.draft_first, span.draft_count),
        ):
            covered[first : first + count] = b"\x01" * count
        self.pieces[index] = piece
        self.announced_bytes += piece.nbytes

    def chunk_target(self, index: int, offset: int, nbytes: int) -> torch.Tensor | Failure:
        """Where a tcp chunk of piece `index` goes (its slice of the piece's buffer), or what
        is wrong with it: chunks of a piece come in order and fill it exactly."""
        piece = self.pieces.get(index)
        buffer = None if piece is None or piece.parts else piece.buffers.get(0)
        if buffer is None:
            return room_failure(f"KV chunk for piece {index}, which was not announced")
        size = buffer.numel()
        if offset != piece.received or nbytes <= 0 or offset + nbytes > size:
            return room_failure(
                f"bad KV chunk for piece {index} (offset {offset}, {nbytes} bytes; expected "
                f"offset {piece.received} of {size})"
            )
        return buffer[offset : offset + nbytes]

    def landed(self, index: int, nbytes: int) -> None:
        """`nbytes` more of piece `index` arrived (tcp)."""
        piece = self.pieces[index]
        piece.received += nbytes
        piece.in_flight.clear()
        self.landed_bytes += nbytes
        if piece.received == piece.nbytes:
            piece.waiting.clear()

    def part_landed(self, index: int, src: int, dst: int) -> bool:
        """Part (src, dst) of piece `index` landed (torch.distributed); False if the piece
        has no such part waiting (nothing changes)."""
        piece = self.pieces.get(index)
        if piece is None or (src, dst) not in piece.waiting:
            return False
        piece.waiting.discard((src, dst))
        if dst == 0:
            piece.in_flight.discard(src)
        if not piece.waiting:
            self.landed_bytes += piece.nbytes
        return True

    @property
    def has_remote_parts(self) -> bool:
        """Parts of some piece went to ranks other than 0."""
        return any(p.parts and any(part.dst for part in p.parts) for p in self.pieces.values())

    @property
    def complete(self) -> bool:
        """Every page covered once, and every byte landed."""
        return self.announced_bytes == self.expected_bytes == self.landed_bytes

    def scatter(self, stager, room: int, pages: list[int], draft_pages: list[int]) -> None:
        """Write every piece into its pages (the room is complete): whole pieces through
        `stager.scatter`, pieces in parts through `stager.commit_parts` (every rank's)."""
        num_pools = len(stager.pools)
        in_parts = []
        for index, piece in self.pieces.items():
            lists = piece.span.page_lists(pages, draft_pages, num_pools)
            if piece.parts is None and not piece.buffers:
                # Written into the pages by the sender (`add_written`): our work waits for it.
                if piece.ready is not None:
                    stager.wait_for(piece.ready)
                continue
            if piece.parts is None:
                stager.scatter(lists, piece.buffers[0])
            else:
                in_parts.append((index, lists, piece.buffers, piece.parts))
        if in_parts:
            stager.commit_parts(room, in_parts)

    def buffers(self) -> list[torch.Tensor]:
        """Take every buffer held and not in flight (to give back)."""
        taken = []
        for piece in self.pieces.values():
            for src in [s for s in piece.buffers if s not in piece.in_flight]:
                taken.append(piece.buffers.pop(src))
        return taken
