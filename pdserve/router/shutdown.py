"""What the router still runs at its shutdown timeout ends well-formed (see
commands/http_shutdown.py): a stream being relayed with an SSE error event and `[DONE]`
(`Relay.end_streams`), a request still waiting for its workers' answer with a 503. Either way
its rooms are closed, which aborts them on the workers. Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from pdserve.edge.error_handlers import error_response
from pdserve.router.relay import Relay


class Shutdown:
    def __init__(self, relay: Relay):
        self.relay = relay
        self.reason: str | None = None
        self._opening: set[asyncio.Task] = set()
        self._ended: set[asyncio.Task] = set()

    @contextlib.contextmanager
    def opening(self) -> Iterator[None]:
        """Around a request's wait for its answer (until its response is ready to send)."""
        task = asyncio.current_task()
        self._opening.add(task)
        try:
            yield
        finally:
            self._opening.discard(task)

    def end_requests(self, reason: str) -> None:
        """End everything in flight (`http_shutdown.EndRequests`)."""
        self.reason = reason
        for task in self._opening:
            self._ended.add(task)
            task.cancel()
        self.relay.end_streams(reason)

    def caught(self) -> bool:
        """In `except CancelledError` of a request's task: whether the cancellation is the
        shutdown's (the task then goes on, to answer `response()`)."""
        task = asyncio.current_task()
        if task not in self._ended:
            return False
        self._ended.discard(task)
        task.uncancel()
        return True

    def response(self):
        return error_response(503, self.reason or "the router is shutting down", "unavailable")
