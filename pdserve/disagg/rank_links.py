"""A tensor-parallel rank's own KV links to a peer worker's ranks (docs/architecture/data-plane.md):
the part of a disaggregated handoff that runs on a rank other than 0.

Rank 0 keeps the control plane: rooms, ledgers, deadlines, the metadata record. It tells this
rank, in order with the passes (`pdserve.protocol.rank_messages`):

- on a prefill worker, to gather its heads of a piece's pages and send them to the decode
  ranks that hold them (`RankSendSlices`), right behind the passes that wrote them;
- on a decode worker, to post the receives of an announced piece (`RankReceiveSlices`), to
  write what landed into the room's pages once the room is whole (`RankCommitSlices`), or to
  drop it (`RankDropSlices`).

Each link is a `DistLinks` pair group with one rank of the peer worker (`RankLinkConnect`),
posted on in the order rank 0 gives, which is the order the peer's ranks post in (the control
channel between the rank 0s fixes it). Every transfer's end goes back to rank 0
(`RankTransferReport`, from the links' waiter threads): rank 0 counts a decode piece landed
once every rank's part did, and drops a peer whose link failed, failing its rooms on both
workers. Nothing here waits for a transfer; each has the links' deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import zmq

from pdserve.disagg.head_pages import gather_head_pages, scatter_head_pages
from pdserve.engine.ranks.tensor_parallel_kv import PageIdError
from pdserve.protocol.channel import Channel
from pdserve.protocol.rank_messages import (
    RankCommitSlices,
    RankDropSlices,
    RankLinkConnect,
    RankLinkForget,
    RankReceiveSlices,
    RankSendSlices,
    RankTransferReport,
    RankTransferStart,
    split,
)
from pdserve.transfer.backends import make_backend
from pdserve.transfer.backends.dist.dist_links import DistLinks
from pdserve.transfer.backends.dist.head_slices import kv_heads_of
from pdserve.transfer.buffer_pool import BufferPool

if TYPE_CHECKING:
    from pdserve.engine.ranks.rank_worker import RankWorker

logger = logging.getLogger(__name__)

REPORT_TIMEOUT_MS = 10_000
# A landed part that no commit or drop took within this many link deadlines is dropped: a
# room that succeeded and then ended without its commit (aborted meanwhile) must not leak.
UNCLAIMED_DEADLINES = 4


class RankLinkError(RuntimeError):
    """Rank 0 asked for something this rank cannot do (a bug, never a peer's doing)."""


@dataclass
class _Part:
    """A decode receive: its buffer, the heads it holds, and whether it landed."""

    buffer: torch.Tensor
    first_head: int
    num_heads: int
    landed_at: float | None = None


class RankLinks:
    messages = (
        RankTransferStart,
        RankLinkConnect,
        RankLinkForget,
        RankSendSlices,
        RankReceiveSlices,
        RankCommitSlices,
        RankDropSlices,
    )

    def __init__(self, worker: RankWorker):
        self.rank = worker.tp.rank
        self.pool = worker.kv_pool
        self.held = kv_heads_of(worker.tp.split.num_kv_heads, worker.tp.size, self.rank)
        self.links: DistLinks | None = None
        self.timeout_s = 0.0
        self._context: zmq.Context | None = None
        self._reports: Channel | None = None
        self._report_lock = threading.Lock()
        self._peer_ranks: dict[int, set[int]] = {}  # link -> the peer's ranks linked
        self._lock = threading.Lock()  # guards `_parts` against the waiter threads
        self._parts: dict[tuple[int, int, int], _Part] = {}  # (room, piece, prefill rank)
        self._buffers: BufferPool | None = None

    def handle(self, msg) -> None:
        if isinstance(msg, RankTransferStart):
            self._start(msg)
            return
        if self.links is None:
            raise RankLinkError(f"{type(msg).__name__} before the links were started")
        try:
            if isinstance(msg, RankLinkConnect):
                self._connect(msg)
            elif isinstance(msg, RankLinkForget):
                for peer_rank in self._peer_ranks.pop(msg.link, ()):
                    self.links.forget((msg.link, peer_rank))
            elif isinstance(msg, RankSendSlices):
                self._send(msg)
            elif isinstance(msg, RankReceiveSlices):
                self._receive(msg)
            elif isinstance(msg, RankCommitSlices):
                self._commit(msg)
            elif isinstance(msg, RankDropSlices):
                self._drop(lambda key: key[0] == msg.room)
        except (PageIdError, ValueError) as error:
            raise RankLinkError(f"{type(msg).__name__}: {error}") from None
        self._drop_unclaimed()

    # ---- set-up ----------------------------------------------------------------------

    def _start(self, msg: RankTransferStart) -> None:
        """(Again, for a new handoff over the same engine: the old links and parts go.)"""
        self.close()
        device = make_backend(msg.backend).send_device(self.pool.device)
        self.links = DistLinks(msg.backend, msg.side, msg.timeout_s, device, msg.local_host)
        self.timeout_s = msg.timeout_s
        self._buffers = BufferPool(device)
        self._context = zmq.Context()
        self._reports = Channel(self._context, zmq.PUSH, send_timeout_ms=REPORT_TIMEOUT_MS)
        self._reports.connect(msg.reports)

    def close(self) -> None:
        """Close every link (transfers in flight fail) and the report socket; what landed
        is dropped."""
        if self.links is None:
            return
        self.links.close()
        self._drop(lambda key: True)
        self._peer_ranks.clear()
        with self._report_lock:
            self._reports.close()
        self._context.term()
        self.links = None

    def _connect(self, msg: RankLinkConnect) -> None:
        self._peer_ranks.setdefault(msg.link, set()).add(msg.peer_rank)

        def done(error: str | None) -> None:
            if error is not None:
                self._report("link", msg.link, msg.peer_rank, error=error)

        self.links.connect((msg.link, msg.peer_rank), msg.store, msg.pair, done)

    def _report(
        self, kind: str, link: int, peer_rank: int, *, room=0, index=0, nbytes=0, error=None
    ) -> None:
        report = RankTransferReport(kind, self.rank, link, peer_rank, room, index, nbytes, error)
        with self._report_lock:
            try:
                self._reports.send(report)
            except zmq.ZMQError as e:  # NOTE: rank 0 is gone; the rank leaves with it
                logger.warning("rank %d could not report to rank 0: %s", self.rank, e)

    # ---- prefill ---------------------------------------------------------------------

    def _send(self, msg: RankSendSlices) -> None:
        count = len(msg.dsts)
        if len(msg.first_heads) != count or len(msg.num_heads) != count:
            raise ValueError("per-part lists of different lengths")
        for dst, first, num in zip(msg.dsts, msg.first_heads, msg.num_heads, strict=True):
            data = gather_head_pages(self.pool, self.held, msg.pages, first, num)
            ready = None
            if self.links.device.type != data.device.type:
                data = data.to(self.links.device)  # NOTE: gloo from a GPU: waits for the copy
            elif data.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(data.device))
            nbytes = data.numel()

            def done(error: str | None, data=data, dst=dst, nbytes=nbytes) -> None:
                del data  # NOTE: kept alive until the send ended
                self._report("sent", msg.link, dst, nbytes=nbytes, error=error)

            self.links.send((msg.link, dst), data, ready, done)

    # ---- decode ----------------------------------------------------------------------

    def _receive(self, msg: RankReceiveSlices) -> None:
        count = len(msg.srcs)
        if any(len(values) != count for values in (msg.nbytes, msg.first_heads, msg.num_heads)):
            raise ValueError("per-part lists of different lengths")
        for src, nbytes, first, num in zip(
            msg.srcs, msg.nbytes, msg.first_heads, msg.num_heads, strict=True
        ):
            # NOTE: rank 0 checked the piece against its reservation before asking.
            part = _Part(self._buffers.take(nbytes, writer=self.links.stream), first, num)
            key = (msg.room, msg.index, src)
            if not msg.scratch:
                with self._lock:
                    self._parts[key] = part
            self.links.receive((msg.link, src), part.buffer, self._landed(msg.link, key, part))

    def _landed(self, link: int, key: tuple[int, int, int], part: _Part):
        room, index, src = key

        def done(error: str | None) -> None:
            with self._lock:
                ours = self._parts.get(key) is part
                keep = ours and error is None
                if keep:
                    part.landed_at = time.monotonic()
                elif ours:
                    del self._parts[key]
            if not keep:
                # NOTE: scratch, dropped, or failed (the link is torn down): nothing writes it.
                self._buffers.give(part.buffer)
            if keep or error is not None:
                nbytes = part.buffer.numel()
                self._report(
                    "landed", link, src, room=room, index=index, nbytes=nbytes, error=error
                )

        return done

    def _commit(self, msg: RankCommitSlices) -> None:
        pages_of = dict(zip(msg.indices, split(msg.pages, msg.page_counts, "pages"), strict=True))
        with self._lock:
            keys = [key for key in self._parts if key[0] == msg.room and key[1] in pages_of]
            parts = [self._parts.pop(key) for key in keys]
        if len(parts) != msg.parts * len(pages_of):
            raise RankLinkError(
                f"commit of room {msg.room}: {len(parts)} parts here, {msg.parts} per piece "
                f"expected for {len(pages_of)} pieces"
            )
        for (_, index, _), part in zip(keys, parts, strict=True):
            if part.landed_at is None:
                raise RankLinkError(f"commit of room {msg.room} before piece {index} landed")
            pages = pages_of[index]
            scatter_head_pages(
                self.pool, self.held, pages, part.first_head, part.num_heads, part.buffer
            )
            self._buffers.give(part.buffer)

    def _drop(self, dropped) -> None:
        """Let go of the parts `dropped(key)` picks: landed ones now, the others as they land."""
        with self._lock:
            keys = [key for key in self._parts if dropped(key)]
            parts = [self._parts.pop(key) for key in keys]
        for part in parts:
            if part.landed_at is not None:
                self._buffers.give(part.buffer)

    def _drop_unclaimed(self) -> None:
        if not self._parts:
            return
        oldest = time.monotonic() - UNCLAIMED_DEADLINES * self.timeout_s
        with self._lock:
            stale = {k for k, p in self._parts.items() if p.landed_at and p.landed_at < oldest}
        if stale:
            logger.warning("rank %d drops %d KV parts no commit took", self.rank, len(stale))
            self._drop(stale.__contains__)
