"""A prefill and a decode KV connector in one process, with no transfer layer between them:
the prefill side gathers a finished prompt's pages and scatters them straight into the pages
decode reserved. What the engines do around a handoff (request states, admission, joining the
batch, freeing pages) is then tested apart from how bytes travel."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.core.page_allocator import pages_needed
from pdserve.engine.core.request import RequestStatus
from pdserve.engine.kv_connector import KVConnector, KVLanded, KVReady, KVSent
from pdserve.prefill.connector import first_token_only
from pdserve.protocol.engine_messages import Bootstrap
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.metadata import MetadataRecord


@dataclass
class Link:
    """What the two sides share, by room: decode's reserved pages, the records sent."""

    reserved: dict[int, list[int]] = field(default_factory=dict)
    landed: dict[int, MetadataRecord] = field(default_factory=dict)
    decode_engine: object = None


class NullConnector(KVConnector):
    """What both local connectors (and a test's own) keep alike: rooms are bare numbers."""

    def __init__(self, engine, link: Link | None = None):
        super().__init__(engine)
        self.link = link
        self.ended_requests: list[tuple[str, Failure | None]] = []

    def rejected(self, request_id, bootstrap, error) -> Failure:
        return Failure(FailureKind.INVALID, FailureStage.BOOTSTRAP, str(error))

    def add(self, request, bootstrap: Bootstrap) -> Failure | None:
        request.transfer = bootstrap.room
        return None

    def ended(self, request, failure) -> bool:
        self.ended_requests.append((request.request_id, failure))
        return False

    def fail_room(self, msg) -> None:
        pass

    def stats(self):
        return None

    def stop(self) -> None:
        pass

    def _mine(self, status: RequestStatus):
        return [r for r in self.engine.requests.values() if r.status is status] + [
            r for r in self.engine.scheduler.transfers.values() if r.status is status
        ]


class LocalPrefill(NullConnector):
    role = "prefill"
    initial_status = RequestStatus.WAITING_FOR_PEER
    keeps_pages = True

    def __init__(self, engine, link: Link):
        super().__init__(engine, link)
        self.sent: list[str] = []
        self.records: dict[str, MetadataRecord] = {}

    def sampling_params(self, params):
        return first_token_only(params)

    def finished(self, request) -> None:
        engine = self.engine
        count = pages_needed(
            engine.kv_tokens_for_transfer(request.num_prompt_tokens), engine.config.page_size
        )
        decode_pages = self.link.reserved.pop(request.transfer)
        kv = KVStager([engine.kv_pool]).gather([request.pages[:count]])
        KVStager([self.link.decode_engine.kv_pool]).scatter([decode_pages[:count]], kv)
        wanted = request.sampling_params.logprobs
        record = MetadataRecord(
            first_token=request.output_token_ids[0],
            first_logprob=request.logprobs[0] if wanted is not None else None,
            first_top_logprobs=dict(request.top_logprobs[0]) if wanted else None,
            cached_tokens=request.num_cached_tokens,
        )
        self.records[request.request_id] = record
        self.link.landed[request.transfer] = record
        self.sent.append(request.request_id)

    def poll(self):
        events = [
            KVReady(r.request_id)
            for r in self._mine(RequestStatus.WAITING_FOR_PEER)
            if r.transfer in self.link.reserved
        ]
        events += [KVSent(request_id) for request_id in self.sent]
        self.sent = []
        return events


class LocalDecode(NullConnector):
    role = "decode"
    initial_status = RequestStatus.WAITING_FOR_PAGES

    def __init__(self, engine, link: Link):
        super().__init__(engine, link)
        link.decode_engine = engine
        # Applied to the next record that lands (a test's corruption), else None.
        self.tamper = None

    def admitted(self, request) -> Failure | None:
        self.link.reserved[request.transfer] = list(request.pages)
        return None

    def poll(self):
        events = []
        for request in self._mine(RequestStatus.RECEIVING_KV):
            record = self.link.landed.pop(request.transfer, None)
            if record is not None:
                if self.tamper is not None:
                    record, self.tamper = self.tamper(record), None
                events.append(KVLanded(request.request_id, record))
        return events


def pair(engine_p, engine_d) -> tuple[LocalPrefill, LocalDecode]:
    link = Link()
    return LocalPrefill(engine_p, link), LocalDecode(engine_d, link)


def hand_off(prefill: LocalPrefill, decode: LocalDecode, request_id, prompt, params, room):
    """One request through both engines to its end: decode's outputs, by request id."""
    boot = Bootstrap("127.0.0.1", 1, room)
    prefill.engine.add_request(request_id, prompt, params, boot)
    decode.engine.add_request(request_id, prompt, params, boot)
    outputs = []
    for _ in range(10_000):
        for engine in (decode.engine, prefill.engine):
            produced = engine.poll_transfers()
            if engine.has_unfinished():
                produced += engine.step()
            if engine is decode.engine:
                outputs += [o for o in produced if o.request_id == request_id]
        if outputs and outputs[-1].finished and not prefill.engine.has_transfers:
            return outputs
    raise AssertionError(f"request {request_id} did not finish")
