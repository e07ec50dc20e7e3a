"""Rank 0's side of a tensor-parallel worker's per-rank-pair KV links (docs/architecture/data-plane.md).

The data planes run on rank 0's IO thread, but a rank takes its orders in order with the
passes, from the engine thread (`RankGroup.send_to`). So the IO thread queues what a rank must
do (`post`: connect to a peer's rank, post a piece's receives, drop a room's parts) and rings
the endpoint's doorbell; the engine loop wakes and sends the queue (`take`) before its next
pass. What the ranks report back (`RankTransferReport`: a part sent or landed, a link that
failed) arrives on `reports`, a socket in the IO thread's poll.

A worker without tensor parallelism has no fanout: its rank 0 is every rank.
"""

from __future__ import annotations

import collections
import threading

import zmq

from pdserve.protocol.channel import Channel
from pdserve.protocol.rank_messages import RankTransferReport
from pdserve.transfer.doorbell import Doorbell


class RankFanout:
    def __init__(self, tp_size: int, context: zmq.Context, host: str, doorbell: Doorbell):
        """host: where the ranks reach rank 0 (the worker's bootstrap host)."""
        self.tp_size = tp_size
        self.reports = Channel(context, zmq.PULL, accepts=(RankTransferReport,))
        host = f"[{host}]" if ":" in host else host
        port = self.reports.bind_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._doorbell = doorbell
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def post(self, rank: int, msg) -> None:
        """Queue `msg` for rank `rank` (1.. tp_size - 1; IO thread)."""
        if not 0 < rank < self.tp_size:
            raise ValueError(f"rank {rank} of a worker at TP {self.tp_size}")
        with self._lock:
            self._queue.append((rank, msg))
        self._doorbell.ring()

    def take(self) -> list[tuple[int, object]]:
        """What to send, in order (engine thread)."""
        with self._lock:
            taken = list(self._queue)
            self._queue.clear()
        return taken

    def close(self) -> None:
        self.reports.close()
