"""Decode worker handoff: pre-allocation queue -> transfer queue -> prebuilt entry in the
running batch.

A request first waits for KV pages for its prompt (FIFO, as pages and the running-request
limit allow: our free memory throttles the prefill side, which computes nothing before our
reservation arrives). Where our prefix cache holds the start of the prompt (the previous turn
of a conversation decoded here), the reservation begins with those cached pages and tells the
prefill worker to skip them: only the pages after them travel. With pages reserved it gets a
receiver for its room; once the room succeeded the KV is committed into the pages and the
request joins the running batch without a forward pass, with the first token prefill sampled.
From there the ordinary decode loop streams, stops and samples exactly as in colocated mode. A
room that fails frees its pages at once and drops its cached pages' references (nothing writes
a page before commit).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.disagg.handoff_base import (
    DisaggHandoff,
    PendingRequest,
    counted_when_refused,
    ipc_pools,
    refusal_message,
)
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.prefix_cache import PromptPages
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.engine_messages import Bootstrap, DisaggStats, FailRoom
from pdserve.protocol.failures import Failure, FailureKind, FailureStage, log_level
from pdserve.speculative.state import DraftBatch
from pdserve.transfer.backends import make_backend
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.decode_side import DecodeTransferClient
from pdserve.transfer.peer_allow import PeerNotAllowed
from pdserve.transfer.receiver_room import ReceiverRoom
from pdserve.transfer.room_state import TransferState

logger = logging.getLogger(__name__)


@dataclass
class _Pending(PendingRequest):
    bootstrap: Bootstrap
    queued_at: float = field(default_factory=time.monotonic)
    reserved: PromptPages | None = None  # given back when the room ends, unless committed
    receiver: ReceiverRoom | None = None


class DecodeHandoff(DisaggHandoff):
    role = "decode"

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
        self.prealloc: OrderedDict[str, _Pending] = OrderedDict()
        self.transferring: dict[str, _Pending] = {}
        # Reservations of rooms that ended while a prefill write into them may be in flight
        # (`ipc`): freed once `ReceiverRoom.pages_settled`.
        self.held_back: list[tuple[PromptPages, ReceiverRoom]] = []

    # ---- requests --------------------------------------------------------------------

    def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, bootstrap: Bootstrap
    ) -> RequestOutput | None:
        """Queue a request for pages; returns a failure output if it is refused at once."""
        if bootstrap.room in self.rooms_in_use:
            return self.room_in_use(request_id, prompt_ids, bootstrap.room)
        early = self.failed_before_it_came(request_id, prompt_ids, bootstrap.room)
        if early is not None:
            return early  # NOTE: before any reservation: the prefill worker was told already
        try:
            self.engine.validate_prompt(prompt_ids)
            # NOTE: resolved once here; the address, never the name again, is contacted.
            address = self.client.allow_list.resolve(bootstrap.host)
        except (InvalidRequestError, PeerNotAllowed) as e:
            message = f"decode rejected the request: {e}"
            failure = Failure(FailureKind.INVALID, FailureStage.BOOTSTRAP, message)
            self.ended.add(bootstrap.room)
            return self.refused(request_id, prompt_ids, failure)
        bootstrap = dataclasses.replace(bootstrap, host=address)
        self.rooms_in_use.add(bootstrap.room)
        self.prealloc[request_id] = _Pending(request_id, prompt_ids, params, bootstrap)
        return None

    def fail_room(self, msg: FailRoom) -> None:
        """Tell the prefill worker that we refused this room's request (we reserved nothing),
        so its leg ends now instead of at its deadline."""
        if msg.room in self.rooms_in_use or not msg.host:
            return  # a live request owns it: not ours to fail
        failure = Failure(msg.kind, FailureStage.BOOTSTRAP, refusal_message("decode", msg))
        if msg.room not in self.ended:  # else it failed, and was counted, here already
            self.ended.add(msg.room, failure)
            if counted_when_refused(msg.kind):
                self.failures[failure.label] += 1
        try:
            self.client.abort_room(msg.room, msg.host, msg.port, failure.kind, failure.message)
        except PeerNotAllowed as e:
            logger.warning("not telling prefill about room %d: %s", msg.room, e)

    def abort(self, request_id: str) -> bool:
        pending = self.prealloc.pop(request_id, None)
        if pending is not None:
            self.rooms_in_use.discard(pending.bootstrap.room)
            return True
        pending = self.transferring.get(request_id)
        if pending is None:
            return self.engine.abort_request(request_id)  # in the batch, or unknown
        pending.receiver.abort(FailureKind.ABORTED, "the decode request was aborted (client gone)")
        self._end(pending)
        return True

    @property
    def busy(self) -> bool:
        return bool(self.prealloc or self.transferring or self.held_back)

    # ---- progress --------------------------------------------------------------------

    def poll(self) -> list[RequestOutput]:
        self.send_rank_orders()
        self._free_settled()
        outputs: list[RequestOutput] = []
        self._admit(outputs)
        arrived = []
        for pending in list(self.transferring.values()):
            state = pending.receiver.poll()
            if state is TransferState.SUCCESS:
                arrived.append(pending)
            elif state is TransferState.FAILED:
                outputs.append(self._fail(pending, pending.receiver.failure))
        if arrived:
            outputs.extend(self._commit(arrived))
        return outputs

    def _admit(self, outputs: list[RequestOutput]) -> None:
        """Reserve pages for queued requests, oldest first, while pages and the running
        limit allow; fail those that waited past the deadline."""
        now = time.monotonic()
        for pending in list(self.prealloc.values()):
            if now - pending.queued_at > self.config.progress_timeout_s:
                del self.prealloc[pending.request_id]
                self.rooms_in_use.discard(pending.bootstrap.room)
                self.ended.add(pending.bootstrap.room)
                message = (
                    f"no KV pages free on the decode worker for "
                    f"{self.config.progress_timeout_s:g} s (timed out waiting)"
                )
                failure = Failure(FailureKind.NO_PAGES, FailureStage.BOOTSTRAP, message)
                outputs.append(self.refused(pending.request_id, pending.prompt_ids, failure))
        while self.prealloc:
            running = len(self.engine.scheduler.running) + len(self.engine.scheduler.waiting)
            if running + len(self.transferring) >= self.engine.config.max_running_requests:
                return
            pending = next(iter(self.prealloc.values()))
            reserved = self.engine.reserve_for_prompt(pending.prompt_ids)
            if reserved is None:
                return  # FIFO: later requests wait behind the oldest
            del self.prealloc[pending.request_id]
            pending.reserved = reserved
            boot, pages = pending.bootstrap, reserved.pages
            try:
                # NOTE: no cached pages with a draft pool (the engine caches no draft KV).
                draft_pages = pages if len(self.stager.pools) > 1 else None
                pending.receiver = self.client.receiver(
                    boot.room, boot.host, boot.port, pages, draft_pages, len(reserved.cached)
                )
            except ValueError as e:  # the room is in use here
                failure = Failure(FailureKind.INVALID, FailureStage.BOOTSTRAP, str(e))
                outputs.append(self._fail(pending, failure))
                continue
            self.transferring[pending.request_id] = pending

    def _commit(self, arrived: list[_Pending]) -> list[RequestOutput]:
        """Write the rooms' KV into their pages and join them to the running batch; with
        speculative decoding, the algorithm's hook first turns their metadata into the first
        draft inputs (all rooms of this poll at once)."""
        outputs, records, ready = [], [], []
        for pending in arrived:
            try:
                records.append(pending.receiver.commit(self.stager))
                ready.append(pending)
            except (ValueError, RuntimeError) as e:
                failure = _failure(FailureKind.TRANSFER, f"could not commit the KV: {e}")
                outputs.append(self._fail(pending, failure))
        try:
            states = self._draft_inputs(ready, records)
        except ValueError as e:
            failure = _failure(FailureKind.INTERNAL, f"could not seed the draft: {e}")
            return outputs + [self._fail(p, failure) for p in ready]
        for pending, record, state in zip(ready, records, states, strict=True):
            try:
                output = self.engine.add_prebuilt(
                    pending.request_id,
                    pending.prompt_ids,
                    pending.params,
                    pending.reserved.pages,
                    record.first_token,
                    record.first_logprob,
                    record.first_top_logprobs,
                    draft_state=state,
                    num_cached_tokens=record.cached_tokens,
                    cached_pages=pending.reserved.cached,
                )
            except (InvalidRequestError, RuntimeError) as e:
                failure = _failure(FailureKind.INTERNAL, f"could not join the batch: {e}")
                outputs.append(self._fail(pending, failure))
                continue
            # NOTE: the engine owns the pages now (freed when the request ends).
            skipped = len(pending.reserved.cached)
            self.metrics.bytes_skipped += skipped * self.stager.page_bytes[0]
            pending.reserved = None
            self._end(pending)
            outputs.append(output)
        return outputs

    def _draft_inputs(self, ready: list[_Pending], records: list) -> list:
        if self.engine.speculator is None or not ready:
            return [None] * len(ready)
        algorithm = self.engine.speculator.algorithm
        batch = DraftBatch(
            [p.request_id for p in ready], self.transfer.metadata, self.engine.device
        )
        states = algorithm.build_disagg_draft_input(
            batch, [r.first_token for r in records], records
        )
        if states is None or len(states) != len(ready):
            raise ValueError(
                f"{algorithm.name}.build_disagg_draft_input returned "
                f"{'None' if states is None else len(states)} inputs for {len(ready)} requests"
            )
        missing = [p.request_id for p, s in zip(ready, states, strict=True) if s is None]
        if missing:
            raise ValueError(
                f"{algorithm.name}.build_disagg_draft_input returned None for {missing[:3]}"
            )
        return states

    # ---- endings ---------------------------------------------------------------------

    def _fail(self, pending: _Pending, failure: Failure) -> RequestOutput:
        logger.log(log_level(failure), "request %s failed: %s", pending.request_id, failure.message)
        self._end(pending)
        return self.refused(pending.request_id, pending.prompt_ids, failure)

    def _end(self, pending: _Pending) -> None:
        self.transferring.pop(pending.request_id, None)
        receiver = pending.receiver
        if pending.reserved is not None:
            if receiver is None or receiver.pages_settled:
                self.engine.release_reserved(pending.reserved)
            else:
                logger.warning(
                    "room %d: its pages stay reserved until prefill's writes into them are over",
                    pending.bootstrap.room,
                )
                self.held_back.append((pending.reserved, receiver))
            pending.reserved = None
        self.client.release(pending.bootstrap.room)
        self.rooms_in_use.discard(pending.bootstrap.room)
        self.ended.add(pending.bootstrap.room)

    def _free_settled(self) -> None:
        """Free the held-back reservations no prefill write can reach any more."""
        if not self.held_back:
            return
        still = []
        for reserved, receiver in self.held_back:
            if receiver.pages_settled:
                self.engine.release_reserved(reserved)
                self.client.forget_unsettled(receiver.room)
            else:
                still.append((reserved, receiver))
        self.held_back = still

    # ---- reporting -------------------------------------------------------------------

    def stats(self) -> DisaggStats:
        return self.transfer_stats(
            num_prealloc=len(self.prealloc),
            num_transferring=len(self.transferring),
            num_held_back=len(self.held_back),
        )

    def stop(self) -> None:
        for pending in list(self.transferring.values()):
            pending.receiver.abort(FailureKind.UNAVAILABLE, "the decode worker is shutting down")
        self.client.stop()


def _failure(kind: FailureKind, message: str) -> Failure:
    """A failure after the KV arrived (committing it, joining the batch)."""
    return Failure(kind, FailureStage.TRANSFER, message)
