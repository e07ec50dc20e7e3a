"""Decode worker connector: pages reserved for a request's KV (WAITING_FOR_PAGES), the KV
received into them (RECEIVING_KV), then the request joins the running batch without a forward
pass.

A request first waits for KV pages for its prompt (the scheduler's reservation queue, FIFO, as
pages and the running-request limit allow: our free memory throttles the prefill side, which
computes nothing before our reservation arrives). Where our prefix cache holds the start of
the prompt (the previous turn of a conversation decoded here), the reservation begins with
those cached pages and tells the prefill worker to skip them: only the pages after them
travel. With pages reserved it gets a receiver for its room; once the room succeeded the KV is
committed into the pages and the engine joins the request to the running batch with the first
token prefill sampled. From there the ordinary decode loop streams, stops and samples exactly
as in colocated mode. A room that fails frees its pages at once and drops its cached pages'
references (nothing writes a page before commit; with `ipc`, where prefill writes them, they
stay pinned until its writes are over).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field

from pdserve.disagg.connector_base import (
    DisaggConnector,
    counted_when_refused,
    ipc_pools,
    refusal_message,
)
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.kv_connector import KVFailed, KVLanded, PagesSettled, TransferEvent
from pdserve.protocol.engine_messages import Bootstrap, DisaggStats, FailRoom
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.transfer.backends import make_backend
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.decode_side import DecodeTransferClient, Receiver
from pdserve.transfer.peer_allow import PeerNotAllowed
from pdserve.transfer.room_state import TransferState

logger = logging.getLogger(__name__)


@dataclass
class _Handoff:
    """A decode request's handoff (`Request.transfer`)."""

    bootstrap: Bootstrap
    queued_at: float = field(default_factory=time.monotonic)
    receiver: Receiver | None = None
    landed: bool = False  # its KV was committed and the room released


class DecodeConnector(DisaggConnector):
    role = "decode"
    initial_status = RequestStatus.WAITING_FOR_PAGES

    def __init__(self, engine, config: TransferConfig):
        super().__init__(engine, config)
        self.stager = self.transfer.stager
        backend = make_backend(config)
        receive_device = backend.receive_device(engine.device)
        self.client = DecodeTransferClient(
            config,
            self.transfer.layout,
            self.transfer.metadata,
            f"decode-{uuid.uuid4().hex[:8]}",
            self.stager.page_bytes,
            self.metrics,
            device=receive_device,
            tp_size=engine.config.tp_size,
            ranks_host=self.ranks_host(),
            pools=ipc_pools(self.stager) if backend.needs_pools else None,
        )
        self.client.start()
        self.start_rank_links(self.client)
        self.doorbell = self.client.doorbell
        # Failed requests whose pages stay pinned while a prefill write into them may be in
        # flight (`ipc`): released once `Receiver.pages_settled`.
        self.held_back: list[tuple[Request, Receiver]] = []

    # ---- requests --------------------------------------------------------------------

    def rejected(self, request_id: str, bootstrap: Bootstrap, error: Exception) -> Failure:
        message = f"decode rejected the request: {error}"
        failure = Failure(FailureKind.INVALID, FailureStage.BOOTSTRAP, message)
        self.recently_ended.add(bootstrap.room)
        return self.refused(request_id, failure)

    def add(self, request: Request, bootstrap: Bootstrap) -> Failure | None:
        try:
            # NOTE: resolved once here; the address, never the name again, is contacted.
            address = self.client.allow_list.resolve(bootstrap.host)
        except PeerNotAllowed as e:
            return self.rejected(request.request_id, bootstrap, e)
        request.transfer = _Handoff(dataclasses.replace(bootstrap, host=address))
        self.rooms_in_use.add(bootstrap.room)
        self.requests[request.request_id] = request
        return None

    def fail_room(self, msg: FailRoom) -> None:
        """Tell the prefill worker that we refused this room's request (we reserved nothing),
        so its leg ends now instead of at its deadline."""
        if msg.room in self.rooms_in_use or not msg.host:
            return  # a live request owns it: not ours to fail
        failure = Failure(msg.kind, FailureStage.BOOTSTRAP, refusal_message("decode", msg))
        if msg.room not in self.recently_ended:  # else it failed, and was counted, here already
            self.recently_ended.add(msg.room, failure)
            if counted_when_refused(msg.kind):
                self.failures[failure.label] += 1
        try:
            self.client.abort_room(msg.room, msg.host, msg.port, failure.kind, failure.message)
        except PeerNotAllowed as e:
            logger.warning("not telling prefill about room %d: %s", msg.room, e)

    def admitted(self, request: Request) -> Failure | None:
        """Pages reserved: start receiving the room's KV into them."""
        handoff: _Handoff = request.transfer
        boot, pages = handoff.bootstrap, request.pages
        # NOTE: no cached pages with a draft pool (the engine caches no draft KV).
        draft_pages = pages if len(self.stager.pools) > 1 else None
        try:
            handoff.receiver = self.client.receiver(
                boot.room, boot.host, boot.port, pages, draft_pages, len(request.cached_pages)
            )
        except ValueError as e:  # the room is in use here
            return Failure(FailureKind.INVALID, FailureStage.BOOTSTRAP, str(e))
        return None

    def ended(self, request: Request, failure: Failure | None) -> bool:
        handoff: _Handoff = request.transfer
        self.requests.pop(request.request_id, None)
        if failure is not None:
            self.failed(request.request_id, failure)
        if handoff.landed:
            return False  # NOTE: its room was released when its KV was committed
        if request.status is RequestStatus.WAITING_FOR_PAGES and failure is None:
            self.rooms_in_use.discard(handoff.bootstrap.room)  # nothing reserved, nothing asked
            return False
        receiver = handoff.receiver
        if receiver is not None and failure is None:
            receiver.abort(FailureKind.ABORTED, "the decode request was aborted (client gone)")
        self._release_room(handoff)
        if receiver is None or receiver.pages_settled:
            return False
        logger.warning(
            "request %s (room %d): its pages stay reserved until prefill's writes into them "
            "are over",
            request.request_id,
            handoff.bootstrap.room,
        )
        self.held_back.append((request, receiver))
        return True

    # ---- progress --------------------------------------------------------------------

    def poll(self) -> list[TransferEvent]:
        self.send_rank_orders()
        events: list[TransferEvent] = self._settled()
        now = time.monotonic()
        for request in list(self.requests.values()):
            handoff: _Handoff = request.transfer
            if request.status is RequestStatus.WAITING_FOR_PAGES:
                if now - handoff.queued_at > self.config.progress_timeout_s:
                    events.append(KVFailed(request.request_id, self._no_pages()))
                continue
            state = handoff.receiver.poll()
            if state is TransferState.SUCCESS:
                events.append(self._commit(request, handoff))
            elif state is TransferState.FAILED:
                events.append(KVFailed(request.request_id, handoff.receiver.failure))
        return events

    def _no_pages(self) -> Failure:
        message = (
            f"no KV pages free on the decode worker for "
            f"{self.config.progress_timeout_s:g} s (timed out waiting)"
        )
        return Failure(FailureKind.NO_PAGES, FailureStage.BOOTSTRAP, message)

    def _commit(self, request: Request, handoff: _Handoff) -> TransferEvent:
        """Write the room's KV into the request's pages (the engine joins it to the batch)."""
        try:
            record = handoff.receiver.commit(self.stager)
        except (ValueError, RuntimeError) as e:
            message = f"could not commit the KV: {e}"
            return KVFailed(
                request.request_id, Failure(FailureKind.TRANSFER, FailureStage.TRANSFER, message)
            )
        handoff.landed = True
        self.requests.pop(request.request_id)
        self._release_room(handoff)
        self.metrics.bytes_skipped += len(request.cached_pages) * self.stager.page_bytes[0]
        return KVLanded(request.request_id, record)

    def _settled(self) -> list[TransferEvent]:
        """The pinned pages no prefill write can reach any more may go."""
        if not self.held_back:
            return []
        events, still = [], []
        for request, receiver in self.held_back:
            if receiver.pages_settled:
                self.client.forget_unsettled(receiver.room)
                events.append(PagesSettled(request.request_id))
            else:
                still.append((request, receiver))
        self.held_back = still
        return events

    def _release_room(self, handoff: _Handoff) -> None:
        self.client.release(handoff.bootstrap.room)
        self.rooms_in_use.discard(handoff.bootstrap.room)
        self.recently_ended.add(handoff.bootstrap.room)

    # ---- reporting -------------------------------------------------------------------

    def stats(self) -> DisaggStats:
        return self.transfer_stats(
            num_prealloc=len(self.in_phase(RequestStatus.WAITING_FOR_PAGES)),
            num_transferring=len(self.in_phase(RequestStatus.RECEIVING_KV)),
            num_held_back=len(self.held_back),
        )

    def stop(self) -> None:
        for request in self.in_phase(RequestStatus.RECEIVING_KV):
            message = "the decode worker is shutting down"
            request.transfer.receiver.abort(FailureKind.UNAVAILABLE, message)
        self.client.stop()
