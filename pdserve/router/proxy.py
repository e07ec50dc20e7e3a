"""One client request through the router: split into parts (`fanout`: one per prompt and
choice), each opened on a route (a
prefill/decode pair, or a colocated worker: `routes`), and answered, whole or streamed
(`relay`). docs/architecture/request-flow.md.

Failure rules: a failure that a new route may fix is retried once on a new one, but only while
nothing was sent to the client; a stream that breaks later ends with an SSE error event. Which
failures those are, a worker's error says by its `code`, a FailureKind whose entry in
protocol/failures.py's table gives the status and the retry; an error without one is retried
when it is a 5xx (a worker unreachable or failed), and a 4xx (the request's, or, 429, a full
worker's answer) is passed on as it is. A request that outlives `request_timeout_s` fails with
504. A client that disconnects, at any point, ends every part (their legs are cancelled, which
aborts them on the workers). Torch-free.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi.responses import Response

from pdserve.edge.error_handlers import error_response
from pdserve.protocol.log_limit import RateLimitedLog
from pdserve.router.access_log import AccessRecord
from pdserve.router.config import RouterConfig
from pdserve.router.errors import LegError
from pdserve.router.fanout import BadAnswer, StreamMerge, TooManyParts, merge_bodies
from pdserve.router.intake import ClientWatch
from pdserve.router.legs import Answer
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefix_index import routing_key
from pdserve.router.relay import EventStream, Relay
from pdserve.router.routes import PairRoute, WorkerRoute
from pdserve.router.workers import NoHealthyWorker, WorkersBusy

logger = logging.getLogger(__name__)


class Proxy:
    def __init__(
        self, config: RouterConfig, route: PairRoute | WorkerRoute, metrics: RouterMetrics
    ):
        self.config = config
        self.route = route
        self.metrics = metrics
        self.relay = Relay(route.legs, metrics)
        self.leg_warnings = RateLimitedLog(logger, per_second=0.1, burst=1)
        self.client_errors = RateLimitedLog(logger, per_second=1.0, burst=5)

    async def handle(
        self,
        endpoint: str,
        body: dict,
        headers: dict[str, str],
        watch: ClientWatch,
        access: AccessRecord,
    ) -> Response | EventStream:
        """watch: cancels this request when its client leaves; access: where the request's
        routes, retries and answer bytes are noted for its access line."""
        started = time.monotonic()
        deadline = started + self.config.request_timeout_s
        stream = body.get("stream") is True
        try:
            parts = self.route.split(endpoint, body)
        except TooManyParts as e:
            code = "too_many_rooms" if e.status == 400 else "body_too_large"
            response = error_response(e.status, str(e), code, _reply(headers), e.param)
            return self._done(endpoint, started, response)
        bodies = [part.body for part in parts]
        access.parts = len(bodies)
        try:
            answers = await self._open_all(endpoint, bodies, headers, stream, deadline, access)
        except asyncio.CancelledError:
            if not watch.caught():
                raise
            # NOTE: the client left before the first byte: every part's legs were cancelled,
            # which aborts them on the workers.
            return self._done(endpoint, started, Response(status_code=499))
        if isinstance(answers, Response):
            return self._done(endpoint, started, answers)
        if stream:
            if len(answers) == 1:
                relay = self.relay.one(endpoint, answers[0], deadline, started, access)
                return EventStream(relay, _reply(headers), watch, answers[0].finished)
            merge = StreamMerge(endpoint, parts)
            relay = self.relay.merged(endpoint, answers, merge, deadline, started, access)
            return EventStream(relay, _reply(headers), watch)
        watch.stop()  # NOTE: the answers were read whole: nothing is left to cancel
        await self.relay.close_all(answers)
        if len(answers) == 1:
            content = answers[0].head
        else:
            try:
                content = merge_bodies(endpoint, parts, [answer.head for answer in answers])
            except BadAnswer as e:
                response = error_response(502, str(e), "worker_failed", _reply(headers))
                return self._done(endpoint, started, response)
        for part, answer in enumerate(answers):
            access.saw(part, answer.head)
        response = Response(content, media_type="application/json", headers=_reply(headers))
        return self._done(endpoint, started, response)

    def _done(self, endpoint: str, started: float, response: Response) -> Response:
        self.metrics.ended(endpoint, str(response.status_code), time.monotonic() - started)
        return response

    # ---- attempts --------------------------------------------------------------------

    async def _open_all(
        self, endpoint, bodies, headers, stream, deadline, access
    ) -> list[Answer] | Response:
        """Open every part of a request at once: all their answers, or the first part's error
        that no retry fixed (every other part is then closed or cancelled, which aborts it on
        its workers)."""
        if len(bodies) == 1:  # NOTE: the common case, without a task of its own
            result = await self._attempts(endpoint, bodies[0], headers, stream, deadline, access, 0)
            return result if isinstance(result, Response) else [result]
        opening = [
            asyncio.ensure_future(
                self._attempts(endpoint, body, headers, stream, deadline, access, part)
            )
            for part, body in enumerate(bodies)
        ]
        opened = False
        try:
            for next_part in asyncio.as_completed(opening):
                result = await next_part
                if isinstance(result, Response):
                    return result
            opened = True
            return [part.result() for part in opening]
        finally:
            if not opened:
                await asyncio.shield(self._discard(opening))

    async def _discard(self, opening: list[asyncio.Future]) -> None:
        """Cancel the parts still opening and close the ones that opened."""
        for part in opening:
            part.cancel()
        results = await asyncio.gather(*opening, return_exceptions=True)
        await self.relay.close_all([r for r in results if isinstance(r, Answer)])

    async def _attempts(
        self, endpoint, body, headers, stream, deadline, access: AccessRecord, part: int
    ) -> Answer | Response:
        """Open part `part` on a route; retry once on a new route if that may help."""
        avoid = None
        key = routing_key(body)
        for attempt in range(self.config.max_retries + 1):
            try:
                route = self.route.choose(avoid, key)
            except NoHealthyWorker as e:
                return error_response(503, str(e), "no_healthy_worker", _reply(headers))
            except WorkersBusy as e:
                busy = {**_reply(headers), "Retry-After": "1"}
                return error_response(429, str(e), "rate_limit_exceeded", busy)
            access.routed(part, route)
            try:
                answer = await self.route.open(route, endpoint, body, headers, stream, deadline)
                # NOTE: only now, so that refused requests leave the cache-aware index alone
                self.route.accepted(route, key)
                return answer
            except LegError as e:
                request_id = headers.get("X-Request-Id")
                if e.status < 500:
                    # NOTE: the request's own answer (invalid, or a full worker's 429): no
                    # worker failed; requests_total counts it by status.
                    self.client_errors.info("request %s: %s", request_id, e, key=e.status)
                else:
                    self.metrics.leg_failures.labels(e.role, str(e.status)).inc()
                    self.leg_warnings.warning(
                        "request %s: %s", request_id, e, key=(e.role, e.status)
                    )
                if not e.retryable or attempt == self.config.max_retries:
                    return e.response(_reply(headers))
                if time.monotonic() >= deadline:
                    return error_response(504, "request timed out", "timeout", _reply(headers))
                self.metrics.retries.inc()
                access.retries += 1
                avoid = route
        raise AssertionError("unreachable")


def _reply(headers: dict[str, str]) -> dict[str, str]:
    """Response headers: the request id only (never echo the client's credentials)."""
    return {"X-Request-Id": headers["X-Request-Id"]}
