"""Non-blocking sends to one peer, with a bounded queue for what its socket cannot take yet.

The IO thread serves every peer, so it never waits for one: a send that would block is
queued here and retried as the IO loop turns. A peer whose queue overflows, or that takes
nothing for `stuck_after_s`, is failed by the caller (`PeerBlocked`). Frames are queued by
reference (KV frames are views of a buffer the room keeps alive until the end).
"""

from __future__ import annotations

import time
from collections import deque

import zmq

# Messages queued for one slow peer before it counts as stuck (KV chunks are views, not copies).
OUTBOX_MESSAGES = 4096


class PeerBlocked(RuntimeError):
    """A peer does not take what we send: its queue is full or has not moved for too long."""


class Outbox:
    def __init__(self, stuck_after_s: float, max_messages: int = OUTBOX_MESSAGES):
        self.max_messages = max_messages
        self.stuck_after_s = stuck_after_s
        self._queue: deque[tuple[list, bool]] = deque()
        self._blocked_since: float | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def send(self, socket: zmq.Socket, frames: list, *, copy: bool = True) -> None:
        """Send now, or queue behind what waits. PeerBlocked on overflow; a ZMQError (e.g. an
        unknown ROUTER peer) propagates."""
        if self._queue:
            self._enqueue(frames, copy)
            self.flush(socket)
            return
        try:
            socket.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            self._enqueue(frames, copy)

    def flush(self, socket: zmq.Socket) -> None:
        """Send what the socket takes now; PeerBlocked when nothing moved for too long."""
        while self._queue:
            frames, copy = self._queue[0]
            try:
                socket.send_multipart(frames, zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                break
            self._queue.popleft()
            self._blocked_since = time.monotonic() if self._queue else None
        if self._blocked_since is not None:
            stuck = time.monotonic() - self._blocked_since
            if stuck > self.stuck_after_s:
                raise PeerBlocked(f"the peer took no message for {stuck:.1f} s")

    def clear(self) -> None:
        self._queue.clear()
        self._blocked_since = None

    def _enqueue(self, frames: list, copy: bool) -> None:
        if len(self._queue) >= self.max_messages:
            raise PeerBlocked(f"the peer's send queue is full ({self.max_messages} messages)")
        if self._blocked_since is None:
            self._blocked_since = time.monotonic()
        self._queue.append((frames, copy))
