"""Send steps whose bytes are still being copied from the GPU into host memory (tcp or gloo
from a GPU prefill worker): a thread waits for each copy's event, in order, and then hands the
step to the IO thread, so neither the prefill loop nor the IO thread ever waits for the GPU.
A copy that does not complete within the deadline runs the step's `expired` instead (the
room fails; nothing is sent from a buffer the GPU may still write)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from pdserve.transfer.io_thread import IOThread

logger = logging.getLogger(__name__)


_POLL_MAX_SLEEP_S = 1e-3


class StagedSends:
    def __init__(self, io: IOThread, timeout_s: float, max_sleep_s: float = _POLL_MAX_SLEEP_S):
        """max_sleep_s: the longest pause between two looks at a copy's event."""
        self._io = io
        self._timeout_s = timeout_s
        self._max_sleep_s = max_sleep_s
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="transfer-staging", daemon=True)
        self._thread.start()

    def submit(
        self,
        command: Callable[[], None],
        ready: torch.cuda.Event | None,
        expired: Callable[[], None] | None = None,
    ) -> None:
        """Run `command` on the IO thread after `ready` (and every earlier step); `expired`
        instead if `ready` does not complete within the deadline."""
        self._steps.put((command, ready, expired))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._steps.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (step := self._steps.get()) is not None:
            command, ready, expired = step
            if ready is not None and not self._wait(ready):
                logger.error("a KV copy from the GPU did not complete in %g s", self._timeout_s)
                command = expired or (lambda: None)
            self._io.call(command)

    def _wait(self, ready: torch.cuda.Event) -> bool:
        deadline = time.monotonic() + self._timeout_s
        sleep_s = min(1e-5, self._max_sleep_s)
        while not ready.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, self._max_sleep_s)
        return True
