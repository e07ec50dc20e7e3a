"""The router's HTTP app: OpenAI endpoints and SGLang's /generate through a prefill/decode
pair, /v1/models and model info from the workers, /health, /liveness, /workers, /metrics,
/version. Torch-free.

`/health` is 200 while at least one prefill and one decode worker are in rotation (for
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
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pdserve import __version__
from pdserve.router.access_log import AccessLog, AccessRecord
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Discovery
from pdserve.router.errors import error_response, http_error_handler, internal_error_handler
from pdserve.router.health import HealthChecker
from pdserve.router.intake import ApiKeyMiddleware, BadBody, client_left, read_json_body
from pdserve.router.metrics import RouterMetrics
from pdserve.router.proxy import Proxy
from pdserve.router.transport import worker_transport
from pdserve.router.workers import Role, Worker, WorkerPool

logger = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/liveness", "/metrics", "/version"}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
INFO_PATHS = ("/get_model_info", "/model_info", "/get_server_info", "/server_info")


def build_router_app(
    config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """transport: how to reach the workers (tests pass fakes); default: TCP with dead-peer
    detection (`transport.worker_transport`)."""
    # NOTE: workers start out of rotation; the first health check (before serving) puts
    # the healthy ones in.
    prefill = WorkerPool(
        Role.PREFILL,
        [
            Worker(url.rstrip("/"), Role.PREFILL, port, healthy=False)
            for url, port in config.prefill
        ],
    )
    decode = WorkerPool(
        Role.DECODE, [Worker(url.rstrip("/"), Role.DECODE, healthy=False) for url in config.decode]
    )
    discovery = Discovery(
        [(prefill, service) for service in config.prefill_services]
        + [(decode, service) for service in config.decode_services],
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
        pooled = transport or worker_transport(config.dead_worker_timeout_s)
        unpooled = transport or worker_transport(config.dead_worker_timeout_s, keep_alive=False)
        async with (
            httpx.AsyncClient(timeout=timeout, transport=pooled) as client,
            httpx.AsyncClient(timeout=timeout, transport=unpooled) as fresh_client,
        ):
            checker = HealthChecker(config, [prefill, decode], client, discovery)
            await checker.check_all()
            health_task = asyncio.create_task(checker.run(), name="health-checks")
            app.state.proxy = Proxy(config, prefill, decode, client, metrics, fresh_client)
            app.state.client = client
            try:
                yield
            finally:
                health_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await health_task

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=OPEN_PATHS)
    app.add_middleware(AccessLog, paths=set(GENERATION_PATHS))  # NOTE: the outer one

    @app.get("/health")
    async def health() -> Response:
        up = bool(prefill.healthy()) and bool(decode.healthy())
        return Response(status_code=200 if up else 503)

    @app.get("/liveness")
    async def liveness() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({pool.role.value: _describe(pool) for pool in (prefill, decode)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render([prefill, decode])
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generation(request: Request) -> Response:
        access: AccessRecord = request.state.access
        headers = _leg_headers(request, access.request_id)
        try:
            body = await read_json_body(request, config.max_body_bytes)
        except BadBody as e:
            return e.response()
        except ClientDisconnect:
            return Response(status_code=499)  # NOTE: nobody is left to read it
        proxy: Proxy = request.app.state.proxy
        return await proxy.handle(
            request.url.path, body, headers, lambda: client_left(request.receive), access
        )

    for path in GENERATION_PATHS:
        app.add_api_route(path, generation, methods=["POST"])

    async def from_decode(request: Request) -> Response:
        """Model and server info come from a healthy decode worker (it serves the model)."""
        workers = decode.healthy()
        if not workers:
            return error_response(503, "no healthy decode worker")
        client: httpx.AsyncClient = request.app.state.client
        try:
            response = await client.get(
                workers[0].url + request.url.path,
                headers=_leg_headers(request),
                timeout=config.health_check_timeout_s * 5,
            )
        except httpx.HTTPError as e:
            return error_response(502, f"decode worker {workers[0].url} unreachable: {e}")
        try:
            return JSONResponse(response.json(), status_code=response.status_code)
        except ValueError:
            message = f"decode worker {workers[0].url} answered {request.url.path} without JSON"
            return error_response(502, message)

    for path in ("/v1/models", *INFO_PATHS):
        app.add_api_route(path, from_decode, methods=["GET"])
    return app


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


def _leg_headers(request: Request, request_id: str | None = None) -> dict[str, str]:
    """Headers for both legs (and the response): the request id (the client's, else a new
    one), and the client's key."""
    request_id = request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
    headers = {"X-Request-Id": request_id}
    if "authorization" in request.headers:
        headers["Authorization"] = request.headers["authorization"]
    return headers
