"""Send steps whose bytes are still being copied from the GPU into host memory (tcp or gloo
from a GPU prefill worker): a thread waits for each copy's event, in order, and then hands the
step to the IO thread, so neither the prefill loop nor the IO thread ever waits for the GPU."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from pdserve.transfer.io_thread import IOThread

logger = logging.getLogger(__name__)


class StagedSends:
    def __init__(self, io: IOThread):
        self._io = io
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="transfer-staging", daemon=True)
        self._thread.start()

    def submit(self, command: Callable[[], None], ready: torch.cuda.Event | None) -> None:
        """Run `command` on the IO thread after `ready` (and every earlier step)."""
        self._steps.put((command, ready))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._steps.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (step := self._steps.get()) is not None:
            command, ready = step
            try:
                if ready is not None:
                    ready.synchronize()
            except RuntimeError:
                logger.exception("waiting for a KV copy from the GPU failed")
            self._io.call(command)
