"""The router's HTTP app: OpenAI endpoints and SGLang's /generate through a prefill/decode
pair (or, in colocated mode, one `pdserve serve` worker), /v1/models, model info and vLLM's
/tokenize and /detokenize from the workers, /health, /liveness, /workers, /metrics,
/version. Torch-free.

`/health` is 200 while at least one worker of each role is in rotation (for
monitoring and load balancers in front of several routers); `/liveness` is 200 while this
process serves (the probe: a router must not be restarted because its workers are down, it
answers their absence with a clear 503). `/workers` lists the pools. `/health`, `/liveness`,
`/metrics` and `/version` stay open when an API key is set; the key is checked here and the
client's Authorization header is passed on to the workers (give them the same key, or none).
Each request to a generation endpoint gets one access line (`access_log`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve import __version__
from pdserve.edge.api_key import ApiKeyMiddleware
from pdserve.edge.error_handlers import error_response, http_error_handler, internal_error_handler
from pdserve.edge.request_ids import new_request_id
from pdserve.router.access_log import AccessLog, AccessRecord, header
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Discovery
from pdserve.router.health import HealthChecker
from pdserve.router.http1 import Http1Pool
from pdserve.router.intake import BadBody, ClientWatch, read_json_body
from pdserve.router.legs import Legs, TransportLegClient
from pdserve.router.metrics import RouterMetrics
from pdserve.router.proxy import Proxy
from pdserve.router.routes import PairRoute, WorkerRoute
from pdserve.router.shutdown import Shutdown
from pdserve.router.transport import worker_transport
from pdserve.router.workers import Role, Worker, WorkerPool

logger = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/liveness", "/metrics", "/version"}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
INFO_PATHS = ("/get_model_info", "/model_info", "/get_server_info", "/server_info")
# Answered by one worker, the body passed on as it is (vLLM's tokenizer endpoints).
TOKENIZER_PATHS = ("/tokenize", "/detokenize")


def build_router_app(
    config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """transport: how to reach the workers (tests pass fakes); default: TCP with dead-peer
    detection, `http1.Http1Pool` for legs and httpx (`transport.worker_transport`) for
    health checks and model info."""
    # NOTE: workers start out of rotation; the first health check (before serving) puts
    # the healthy ones in.
    if config.colocated:
        colocated = [
            Worker(url.rstrip("/"), Role.COLOCATED, healthy=False) for url in config.worker_urls
        ]
        pools = [WorkerPool(Role.COLOCATED, colocated)]
    else:
        prefill = WorkerPool(
            Role.PREFILL,
            [
                Worker(url.rstrip("/"), Role.PREFILL, port, healthy=False)
                for url, port in config.prefill
            ],
        )
        decode = WorkerPool(
            Role.DECODE,
            [Worker(url.rstrip("/"), Role.DECODE, healthy=False) for url in config.decode],
        )
        pools = [prefill, decode]
    answering = pools[-1]  # NOTE: the workers whose answers the client gets
    discovery = Discovery(
        [(pools[0], service) for service in config.prefill_services]
        + [(pools[-1], service) for service in config.decode_services],
        timeout_s=config.health_check_timeout_s,
    )
    metrics = RouterMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(
            connect=config.connect_timeout_s,
            read=None,  # NOTE: the request deadline bounds reads (see Proxy)
            write=config.connect_timeout_s * 6,
            pool=config.connect_timeout_s,
        )
        if transport is None:
            leg_client = Http1Pool(
                config.connect_timeout_s, timeout.write, config.dead_worker_timeout_s
            )
        else:
            leg_client = TransportLegClient(transport, transport, timeout)
        legs = Legs(config, leg_client)
        pooled = transport or worker_transport(config.dead_worker_timeout_s)
        async with httpx.AsyncClient(timeout=timeout, transport=pooled) as client:
            checker = HealthChecker(config, pools, client, discovery, on_silent=legs.cut)
            await checker.check_all()
            health_task = asyncio.create_task(
                checker.run(after_round=lambda: metrics.refresh(pools)), name="health-checks"
            )
            if config.colocated:
                route = WorkerRoute(config, legs, answering)
            else:
                route = PairRoute(config, legs, *pools)
            app.state.proxy = Proxy(config, route, metrics)
            # NOTE: what still runs at the shutdown timeout ends well-formed (router/shutdown).
            app.state.shutdown = Shutdown(app.state.proxy.relay)
            app.state.end_requests = app.state.shutdown.end_requests
            app.state.client = client
            try:
                yield
            finally:
                health_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await health_task
                await legs.aclose()

    generation = Generation(config)
    # The hot path's own chain: what FastAPI's stack does for it, and nothing else.
    fast_path = AccessLog(
        ApiKeyMiddleware(generation, api_key=config.api_key, open_paths=OPEN_PATHS),
        paths=set(GENERATION_PATHS),
        colocated=config.colocated,
    )
    app = RouterApp(fast_path, title="pdserve router", lifespan=lifespan)
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler("router"))
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=OPEN_PATHS)
    # NOTE: the outer one
    app.add_middleware(AccessLog, paths=set(GENERATION_PATHS), colocated=config.colocated)

    @app.get("/health")
    async def health() -> Response:
        up = all(pool.healthy() for pool in pools)
        return Response(status_code=200 if up else 503)

    @app.get("/liveness")
    async def liveness() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({pool.role.value: _describe(pool) for pool in pools})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render(pools)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    for path in GENERATION_PATHS:
        # NOTE: RouterApp answers POSTs itself; these routes give other methods their 405.
        app.router.routes.append(Route(path, generation, methods=["POST"]))

    async def from_workers(request: Request) -> Response:
        """Model and server info, and the tokenizer endpoints, come from a healthy answering
        worker (it serves the model)."""
        workers = answering.healthy()
        if not workers:
            return error_response(503, f"no healthy {answering.role.value} worker")
        client: httpx.AsyncClient = request.app.state.client
        body = None
        if request.method == "POST":
            length = header(request.scope["headers"], b"content-length")
            try:
                body = await read_json_body(request.receive, length, config.max_body_bytes)
            except BadBody as e:
                return e.response()
            except ClientDisconnect:
                return Response(status_code=499)  # NOTE: nobody is left to read it
        try:
            response = await client.request(
                request.method,
                workers[0].url + request.url.path,
                json=body,
                headers=_leg_headers(request.scope["headers"]),
                timeout=config.health_check_timeout_s * 5,
            )
        except httpx.HTTPError as e:
            message = f"{answering.role.value} worker {workers[0].url} unreachable: {e}"
            return error_response(502, message)
        try:
            return JSONResponse(response.json(), status_code=response.status_code)
        except ValueError:
            message = (
                f"{answering.role.value} worker {workers[0].url} answered {request.url.path} "
                "without JSON"
            )
            return error_response(502, message)

    for path in ("/v1/models", *INFO_PATHS):
        app.add_api_route(path, from_workers, methods=["GET"])
    for path in TOKENIZER_PATHS:
        app.add_api_route(path, from_workers, methods=["POST"])
    return app


class RouterApp(FastAPI):
    """The router's app. A POST to a generation endpoint (every request and every chunk it
    streams) goes through `fast_path` (the access log, the API key, the handler) without
    FastAPI's routing and middleware stack around it; on an error before the response started
    the client gets the 500 FastAPI would send. Everything else is FastAPI's. Measured at 32
    streams: FastAPI's chain in front of the handler was ~5% of the router's CPU."""

    def __init__(self, fast_path: ASGIApp, **kwargs):
        super().__init__(**kwargs)
        self.fast_path = fast_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATION_PATHS
        ):
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        try:
            await self.fast_path(scope, receive, send)
        except Exception as error:
            # NOTE: the access log's record knows whether the response started.
            record: AccessRecord | None = scope.get("state", {}).get("access")
            if record is None or record.status is None:
                response = await internal_error_handler("router")(Request(scope), error)
                await response(scope, receive, send)
            raise  # NOTE: the server logs the traceback, as under FastAPI's own stack


class Generation:
    """A request to a generation endpoint, as plain ASGI (a class, so that Starlette calls
    it as it is): the router's hot path, without FastAPI's request handling around it. From
    the body's end to the answer's, a `ClientWatch` ends the request if its client leaves."""

    def __init__(self, config: RouterConfig):
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        access: AccessRecord = scope["state"]["access"]
        headers = _leg_headers(scope["headers"], access.request_id)
        try:
            length = header(scope["headers"], b"content-length")
            body = await read_json_body(receive, length, self.config.max_body_bytes)
        except BadBody as e:
            response = e.response()
        except ClientDisconnect:
            response = Response(status_code=499)  # NOTE: nobody is left to read it
        else:
            proxy: Proxy = scope["app"].state.proxy
            shutdown: Shutdown = scope["app"].state.shutdown
            watch = ClientWatch(receive)
            try:
                with shutdown.opening():
                    response = await proxy.handle(scope["path"], body, headers, watch, access)
                await response(scope, receive, send)
            except asyncio.CancelledError:
                if shutdown.caught():
                    await shutdown.response()(scope, receive, send)
                elif not watch.caught():
                    raise
                # NOTE: the client left mid-stream; the stream's cleanup ended its rooms.
            finally:
                watch.stop()
            return
        await response(scope, receive, send)


def _describe(pool: WorkerPool) -> list[dict]:
    return [
        {
            "url": w.url,
            "healthy": w.healthy,
            "last_error": w.last_error,
            "in_flight": w.in_flight,
            "bootstrap_port": w.bootstrap_port,
            "discovered": w.discovered,
        }
        for w in pool.workers
    ]


def _leg_headers(raw: list[tuple[bytes, bytes]], request_id: str | None = None) -> dict[str, str]:
    """Headers for both legs (and the response): the request id (the client's, else a new
    one), and the client's key. raw: the request's headers as the server gives them."""
    request_id = request_id or header(raw, b"x-request-id") or new_request_id()
    headers = {"X-Request-Id": request_id}
    authorization = header(raw, b"authorization")
    if authorization is not None:
        headers["Authorization"] = authorization
    return headers
