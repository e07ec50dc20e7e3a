"""What the engine asks of a disaggregated worker's KV handoff: one `KVConnector`.

A prefill or decode worker's requests pass through the handoff's states inside the engine
(`RequestStatus`: WAITING_FOR_PEER, SENDING_KV on prefill; WAITING_FOR_PAGES, RECEIVING_KV on
decode), so the engine's request table is the one answer to "where is request X". The engine
calls its connector at each change it makes and asks it, between steps, what the transfers
did (`poll`): events by request id, which the engine applies. A colocated engine has none.

    engine                         connector (pdserve.prefill / pdserve.decode)
    add_request(.., bootstrap) ->  add(request, bootstrap)        a room for the request
    reservation (decode)        ->  admitted(request)             receive into the pages
    schedule: compute begins    ->  started(request)              prefill: its clock restarts
    step: chunk computed        ->  computed(request)             prefill: stream pages
    step: last token            ->  finished(request)             prefill: send the rest
    abort / failure             ->  ended(request, failure)       end the room; pin pages?
    poll_transfers()            <-  poll(): KVReady | KVLanded | KVSent | KVFailed |
                                            PagesSettled

Torch-free: the connector's byte path (`pdserve.transfer`) is its own business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.protocol.engine_messages import Bootstrap, DisaggStats, FailRoom
from pdserve.protocol.failures import Failure

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine


@dataclass(frozen=True)
class KVReady:
    """Prefill: decode reserved pages for the request's KV; its prompt may be computed."""

    request_id: str


@dataclass(frozen=True)
class KVLanded:
    """Decode: the prompt's KV is in the request's pages; it joins the batch with prefill's
    first token. `metadata`: the transfer's record (first token, its logprobs, prefill's
    cached tokens, the draft's seed state)."""

    request_id: str
    metadata: Any


@dataclass(frozen=True)
class KVSent:
    """Prefill: decode holds the request's KV whole; its pages may go, its output out."""

    request_id: str


@dataclass(frozen=True)
class KVFailed:
    """The request's transfer failed (its room did, or it waited past its deadline)."""

    request_id: str
    failure: Failure


@dataclass(frozen=True)
class PagesSettled:
    """Decode: no write of prefill's can reach a failed request's pinned pages any more."""

    request_id: str


TransferEvent = KVReady | KVLanded | KVSent | KVFailed | PagesSettled


class KVConnector(ABC):
    """A worker's KV handoff, as the engine drives it. Single-threaded: the engine calls it
    between steps (and inside a step, at the points named), never concurrently."""

    # "prefill" or "decode": what the worker announces (`EngineReady.role`).
    role: ClassVar[str]
    # The status a new request starts in (WAITING_FOR_PEER or WAITING_FOR_PAGES).
    initial_status: ClassVar[RequestStatus]
    # Whether a request's pages outlive its last token (prefill: until its KV was sent).
    keeps_pages: ClassVar[bool] = False
    # Where peers fetch this worker's KV (a prefill worker's bootstrap port), else None.
    bootstrap_port: int | None = None
    # What wakes the loop's wait for messages when a room changes (a transfer endpoint's
    # `Doorbell`: `fileno()` to poll, `answer()` once awake), else None.
    doorbell = None

    def __init__(self, engine: Engine):
        self.engine = engine
        engine.connect(self)

    # ---- requests ----------------------------------------------------------------------

    def screen(self, bootstrap: Bootstrap) -> Failure | None:
        """Before a request is made: why its room refuses it at once (in use, failed here
        already), if it does. Nothing is held for it yet."""
        return None

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """What this worker samples for a request (prefill: its first token only)."""
        return params

    @abstractmethod
    def rejected(self, request_id: str, bootstrap: Bootstrap, error: Exception) -> Failure:
        """The engine refused the request (`InvalidRequestError`): tell its room; the failure
        it reports."""

    @abstractmethod
    def add(self, request: Request, bootstrap: Bootstrap) -> Failure | None:
        """A new request of this worker, in `initial_status`: make its room; a Failure
        refuses it at once."""

    def admitted(self, request: Request) -> Failure | None:
        """Decode: the scheduler reserved the request's pages (RECEIVING_KV now): receive
        its KV into them. A Failure ends it."""
        return None

    def started(self, request: Request) -> None:
        """Prefill: the scheduler began computing the request."""
        return None

    def computed(self, request: Request) -> None:
        """Prefill: a step computed a chunk of the request's prompt (it still runs)."""
        return None

    def finished(self, request: Request) -> None:
        """Prefill: the step that sampled the request's last token is over (its draft caught
        up); its pages are pinned (SENDING_KV, see `keeps_pages`) until `KVSent`, and its
        output with them."""
        return None

    @abstractmethod
    def ended(self, request: Request, failure: Failure | None) -> bool:
        """The request ends before its handoff finished (`failure`, or None: aborted by its
        client or the worker's shutdown), wherever it is: end its room. True: its pages stay
        pinned until `PagesSettled` (a write into them may still land)."""

    @abstractmethod
    def poll(self) -> list[TransferEvent]:
        """What the transfers did since the last poll."""

    # ---- the worker --------------------------------------------------------------------

    @abstractmethod
    def fail_room(self, msg: FailRoom) -> None:
        """The front end refused a request of this room before it reached the engine: tell
        whoever waits for the room."""

    @abstractmethod
    def stats(self) -> DisaggStats:
        """Queues and transfer counters for `EngineStats`."""

    @abstractmethod
    def stop(self) -> None:
        """The worker is shutting down: end what is in flight, release endpoints."""


# Builds a worker's engine (with its connector, if disaggregated) in the engine process.
# NOTE: it travels to a spawned process, so it must pickle: a module-level function, or a
# functools.partial of one over picklable settings.
WorkerFactory = Callable[[EngineConfig], "Engine"]
