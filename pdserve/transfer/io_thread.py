"""A background thread that owns a side's ZMQ sockets, plus a thread-safe way to hand it work.

ZMQ sockets are not thread-safe, so every send and receive of a side happens on this one
thread; the scheduler thread only enqueues commands (never blocks on the network) and reads
room states. `wake()` interrupts the thread's poll so commands run at once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)


class IOThread:
    def __init__(self, name: str, context: zmq.Context):
        self.name = name
        self.context = context
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        address = f"inproc://wake-{uuid.uuid4().hex}"
        self._wake_rx = context.socket(zmq.PULL)
        self._wake_rx.bind(address)
        self._wake_tx = context.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.SNDHWM, 0)
        self._wake_tx.connect(address)
        self._wake_lock = threading.Lock()
        self.poller = zmq.Poller()
        self.poller.register(self._wake_rx, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(
        self, on_socket: Callable[[zmq.Socket], None], on_tick: Callable[[], None], tick_s: float
    ) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(on_socket, on_tick, tick_s), name=self.name, daemon=True
        )
        self._thread.start()

    @property
    def is_current(self) -> bool:
        """Whether the caller runs on this IO thread."""
        return threading.current_thread() is self._thread

    def call(self, command: Callable[[], None]) -> None:
        """Run `command` on the IO thread soon (from any thread; after `stop`, never)."""
        self.commands.put(command)
        with self._wake_lock:
            if not self._wake_tx.closed:
                # NOTE: Again means nobody is there to wake: the thread ended (on its own
                # tick after `stop` was asked, say) and closed its end.
                with contextlib.suppress(zmq.Again):
                    self._wake_tx.send(b"", zmq.NOBLOCK)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.call(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout_s)
        # NOTE: the waking socket belongs to the callers' side: closed here, under its lock,
        # never by the IO thread (which may exit on its own tick while a caller sends).
        with self._wake_lock:
            self._wake_tx.close(0)
        if self._thread is None:
            self._wake_rx.close(0)  # NOTE: else the thread closes it as it ends

    def _run(self, on_socket, on_tick, tick_s: float) -> None:
        timeout_ms = max(1, int(tick_s * 1000))
        while not self._stop.is_set():
            try:
                ready = dict(self.poller.poll(timeout_ms))
                if self._wake_rx in ready:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                while not self.commands.empty():
                    self.commands.get_nowait()()
                for socket in ready:
                    if socket is not self._wake_rx:
                        on_socket(socket)
                on_tick()
            except Exception:
                logger.exception("%s: error in the transfer IO loop", self.name)
        self._wake_rx.close(0)
