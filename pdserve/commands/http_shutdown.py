"""How an HTTP process (worker or router) stops on SIGTERM/SIGINT: new connections are refused
at once, requests in flight get `--shutdown-timeout` seconds, and what still runs then is
ended by the app itself, a stream with an SSE error event and `data: [DONE]`, a plain request
with a 503, so every client sees a well-formed end and nothing is cut mid-body.

uvicorn alone would cancel what still runs at the timeout: a stream's chunked body breaks off
and the server logs "Cancel N running task(s)" at ERROR. Its own cancel stays, as a backstop
`END_GRACE_S` after the timeout, for a request that did not end when told to.

uvicorn also raises the signal it caught again as its `serve` returns, which would end the
process before the app's shutdown (a worker's engine process would find its parent gone);
the signal is held until the app has shut down, then raised again (the exit status stays
the signal's, as a supervisor expects).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

import uvicorn

logger = logging.getLogger("pdserve")

# How long requests told to end at the shutdown timeout have to write their last event.
END_GRACE_S = 2.0
SHUTDOWN_REASON = "the server is shutting down"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# What an app gives to end what it still runs (`app.state.end_requests(reason)`).
EndRequests = Callable[[str], None]


class DrainingServer(uvicorn.Server):
    """uvicorn's server that, `shutdown_timeout` seconds into its shutdown, has the app end
    its requests in flight (`end_requests`, looked up then: the app's start-up sets it)."""

    def __init__(
        self,
        config: uvicorn.Config,
        shutdown_timeout: float,
        end_requests: Callable[[], EndRequests | None],
    ):
        config.timeout_graceful_shutdown = shutdown_timeout + END_GRACE_S
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.end_requests = end_requests

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.shutdown_timeout, self._end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _end_requests(self) -> None:
        end = self.end_requests()
        if end is not None and self.server_state.tasks:
            logger.info(
                "ending %d request(s) still running after the %gs shutdown timeout",
                len(self.server_state.tasks),
                self.shutdown_timeout,
            )
            end(SHUTDOWN_REASON)


@contextlib.contextmanager
def signals_held(server: uvicorn.Server) -> Iterator[list[int]]:
    """The stop signals that arrive inside (uvicorn raises the one it caught again as its
    `serve` returns) are recorded in the list this yields instead of acted on; the caller
    acts on them once the app has shut down (`exit_as_signalled`). Each is also handed to
    `server`, so that one arriving before uvicorn installs its own handlers still stops it."""
    held: list[int] = []

    def hold(sig: int, frame) -> None:
        held.append(sig)
        server.handle_exit(sig, frame)

    previous = {sig: signal.signal(sig, hold) for sig in STOP_SIGNALS}
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_as_signalled(held: list[int]) -> int:
    """After a graceful stop: SIGTERM raised again (the exit status a supervisor expects, as
    uvicorn leaves it); SIGINT (Ctrl-C) exits 130, without a KeyboardInterrupt traceback."""
    if signal.SIGTERM in held:
        signal.raise_signal(signal.SIGTERM)
    return 128 + signal.SIGINT if signal.SIGINT in held else 0
