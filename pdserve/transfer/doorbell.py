"""A doorbell a transfer endpoint rings when one of its rooms changes state, so that the
worker's engine loop, waiting for its next message, wakes at once instead of at its next poll.
Torch-free.

Rooms change on the endpoint's IO and waiter threads (decode's KV landed, prefill was acked,
a peer failed); the engine loop acts on them between steps (commits, first tokens, failures).
When the engine has nothing to step the loop sleeps in its socket poll, and the doorbell's
file descriptor sits in that poll beside the front end's socket. Rings before the loop
answered are one ring: the loop moves every room along when it wakes.
"""

from __future__ import annotations

import contextlib
import os
import threading


class Doorbell:
    def __init__(self):
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()
        self._rung = False
        self._closed = False

    def fileno(self) -> int:
        """What the listener polls (readable once rung)."""
        return self._read

    def ring(self) -> None:
        """From any thread; a no-op once closed."""
        with self._lock:
            if self._rung or self._closed:
                return
            self._rung = True
            # NOTE: a full pipe means a byte is already waiting: the bell is rung anyway.
            with contextlib.suppress(BlockingIOError):
                os.write(self._write, b"\0")

    def answer(self) -> None:
        """The listener woke: later rings ring again. Call before moving the rooms along."""
        with self._lock:
            if self._closed:
                return
            self._rung = False
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read, 4096):
                    pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read)
            os.close(self._write)
