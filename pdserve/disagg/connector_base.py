"""What the prefill and decode connectors keep alike: the transfer settings and counters, the
engine's transfer layout, the rooms in use, the rooms that ended lately, failures counted by
label (once per request), and the screen of a request's room before it is made."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from pdserve.disagg import rank_worker
from pdserve.disagg.handoff_common import engine_transfer_layout
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.ranks.rank_group import RankDiedError
from pdserve.protocol.engine_messages import Bootstrap, DisaggStats, FailRoom
from pdserve.protocol.failures import Failure, FailureKind, FailureStage, log_level
from pdserve.protocol.rank_messages import RankTransferStart
from pdserve.transfer.backends import make_backend
from pdserve.transfer.config import IPC_TENSOR_PARALLEL, TransferConfig
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.metrics import TransferMetrics
from pdserve.transfer.room_state import Tombstones

logger = logging.getLogger(__name__)


def counted_when_refused(kind: FailureKind) -> bool:
    """Whether a room failed by `FailRoom` counts as a failure at once: a front end's refusal
    of a request it received does; a router's abort (ABORTED) counts only once its request
    comes (`failed_before_it_came`), so that aborts for rooms that never come here (a flood
    of made-up ones) count nothing."""
    return kind is not FailureKind.ABORTED


class DisaggConnector(KVConnector):
    def __init__(self, engine, config: TransferConfig):
        super().__init__(engine)
        self.config = config
        # The requests whose rooms this connector serves, by id (their phase: `status`).
        self.requests: dict[str, Request] = {}
        self.metrics = TransferMetrics()
        self.transfer = engine_transfer_layout(engine, make_backend(config).per_rank)
        self.failures: Counter[str] = Counter()  # by Failure.label, "stage/kind"
        self.rooms_in_use: set[int] = set()
        # Rooms that ended here lately: a refusal the front end reports for one afterwards
        # (the failure output it turned into an error) is not a second failure.
        self.recently_ended = Tombstones(config.tombstone_ttl_s)
        # The endpoint whose orders for the other ranks this sends (`start_rank_links`).
        self._fanout, self._endpoint = None, None

    def ranks_host(self) -> str:
        """Where this worker's other ranks reach rank 0: loopback, unless they span nodes
        (then this node's reachable address; such a worker belongs on a private network)."""
        return "127.0.0.1" if self.engine.config.nnodes == 1 else self.config.bootstrap_host

    def start_rank_links(self, endpoint) -> None:
        """A tensor-parallel worker over torch.distributed: every rank opens its own links
        (`pdserve.disagg.rank_links`), reporting to the endpoint."""
        if endpoint.fanout is None:
            return
        module = self.engine.config.rank_worker_module
        if module != rank_worker.__name__:
            raise ValueError(
                f"the engine's other ranks run {module}, which has no KV links: build the engine "
                f"with rank_worker_module={rank_worker.__name__!r} (the worker factories do)"
            )
        start = RankTransferStart(
            endpoint.side,
            self.config.backend,
            self.config.progress_timeout_s,
            self.config.bootstrap_host,
            endpoint.fanout.address,
        )
        for rank in range(1, endpoint.fanout.tp_size):
            self.engine.ranks.send_to(rank, start)
        self._fanout, self._endpoint = endpoint.fanout, endpoint

    def send_rank_orders(self) -> None:
        """Send the other ranks what the endpoint queued for them (in order with the passes;
        the loop calls this before each step). A rank that died fails every room at once:
        its part of each will never move (and the engine's next step ends the worker)."""
        if self._fanout is None:
            return
        try:
            for rank, msg in self._fanout.take():
                self.engine.ranks.send_to(rank, msg)
        except RankDiedError as e:
            logger.error("KV links: %s", e)
            self._endpoint.fail_all_rooms(FailureKind.INTERNAL, str(e))

    def screen(self, bootstrap: Bootstrap) -> Failure | None:
        """A room in use here refuses the request (not the room's failure: it stays); one
        that failed here lately, before the request came (a router gave up on it, or the
        other side's refusal came first), fails it with that failure."""
        room = bootstrap.room
        if room in self.rooms_in_use:
            message = f"bootstrap_room {room} is already in use"
            return Failure(FailureKind.INVALID, FailureStage.BOOTSTRAP, message)
        failure = self.recently_ended.failure(room)
        if failure is not None and not counted_when_refused(failure.kind):
            self.failures[failure.label] += 1
        return failure

    def refused(self, request_id: str, failure: Failure) -> Failure:
        """A request that failed here: counted once, by its label."""
        self.failures[failure.label] += 1
        return failure

    def failed(self, request_id: str, failure: Failure) -> None:
        """A live request's handoff failed: counted and logged (at the level its kind
        deserves: a client's fault is no warning)."""
        logger.log(log_level(failure), "request %s failed: %s", request_id, failure.message)
        self.refused(request_id, failure)

    def in_phase(self, *statuses: RequestStatus) -> list[Request]:
        """This connector's requests in these phases."""
        return [r for r in self.requests.values() if r.status in statuses]

    def transfer_stats(self, **queues: int) -> DisaggStats:
        """The role's queue sizes, with the counters both roles report."""
        return DisaggStats(
            **queues,
            bytes_sent=self.metrics.bytes_sent,
            bytes_received=self.metrics.bytes_received,
            bytes_skipped=self.metrics.bytes_skipped,
            transfers_succeeded=self.metrics.rooms_succeeded,
            transfer_latencies=self.metrics.take_latencies(),
            failures=dict(self.failures),
            malformed_messages=self.metrics.malformed_messages,
        )


def ipc_pools(stager) -> list[torch.Tensor]:
    """The pools the `ipc` backend shares or writes from: every pool's whole storage tensor
    (a worker without tensor parallelism: the pairing of ranks is nccl's business)."""
    if not isinstance(stager, KVStager):
        raise ValueError(IPC_TENSOR_PARALLEL)
    return [pool.storage for pool in stager.pools]


def refusal_message(role: str, msg: FailRoom) -> str:
    """Why a room the front end refused (or a router gave up on) ended, naming this worker."""
    verb = "rejected the request" if msg.kind is FailureKind.INVALID else "ended the room"
    return f"{role} {verb}: {msg.reason}"
