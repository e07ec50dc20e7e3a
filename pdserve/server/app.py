"""The worker's HTTP app: OpenAI + SGLang-native routes, health, metrics, API key, errors.

The engine runs in its own process (`engine_process`); this process only parses, tokenizes,
streams and counts. `/health`, `/health_generate`, `/metrics` and `/version` stay open when an
API key is set (Kubernetes probes and Prometheus scrapes carry no key).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

from pdserve import __version__
from pdserve.edge.api_key import ApiKeyMiddleware
from pdserve.edge.error_handlers import http_error_handler, internal_error_handler
from pdserve.engine.checkpoint.model_files import resolve_model_dir
from pdserve.engine.core.config import EngineConfig
from pdserve.server import native_api, openai_api, tokenize_api
from pdserve.server.access_log import RequestIdMiddleware
from pdserve.server.engine_client import EngineClient, EngineClientConfig
from pdserve.server.errors import (
    APIError,
    api_error_handler,
    validation_error_handler,
)
from pdserve.server.generation import ServerState
from pdserve.server.metrics import ServerMetrics
from pdserve.server.role import WorkerRole

logger = logging.getLogger(__name__)

# NOTE: probes carry no credentials: /health_generate is the readiness probe.
OPEN_PATHS = {"/health", "/health_generate", "/metrics", "/version"}


def build_app(
    engine_config: EngineConfig,
    role: WorkerRole,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued_requests: int = 1024,
    chat_template: str | None = None,
    server_args: dict[str, Any] | None = None,
    client_options: EngineClientConfig | None = None,
) -> FastAPI:
    """A worker's HTTP app; `role` says whether it is colocated, prefill or decode, and
    builds its engine. chat_template: replaces the tokenizer's (`--chat-template`)."""
    name = served_model_name or engine_config.model_path

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = EngineClient(engine_config, role, client_options)
        ready = await client.start()
        metrics = ServerMetrics(name, disaggregated=role.disaggregated)
        client.stats_listeners.append(metrics.observe_stats)
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(engine_config.model_path))
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        app.state.pdserve = ServerState(
            client=client,
            tokenizer=tokenizer,
            served_model_name=name,
            max_model_len=ready.max_model_len,
            metrics=metrics,
            max_queued_requests=max_queued_requests,
            role=role,
            server_args=dict(server_args or {}),
        )
        # NOTE: what still runs at the shutdown timeout ends well-formed (commands/http_shutdown).
        app.state.end_requests = client.cancel_all
        logger.info(
            "%s worker ready%s: serving %s (%s on %s)%s",
            role.kind,
            _served_at(server_args or {}),
            name,
            ready.architecture,
            ready.device,
            f", bootstrap port {ready.bootstrap_port}" if ready.bootstrap_port else "",
        )
        try:
            yield
        finally:
            await client.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler("worker"))

    app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=OPEN_PATHS)
    # NOTE: outermost, so that every answer (a 401 too) carries the request's id.
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while the engine serves; else 503 saying whether it is being restarted or
        has failed for good (then the worker's supervisor should replace it)."""
        client = request.app.state.pdserve.client
        if client.healthy:
            return Response(status_code=200)
        return Response(client.health_detail, status_code=503, media_type="text/plain")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: ServerState = request.app.state.pdserve
        body = state.metrics.render(state.client.stats)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai_api.router)
    app.include_router(native_api.router)
    app.include_router(tokenize_api.router)
    return app


def _served_at(server_args: dict[str, Any]) -> str:
    """` on http://HOST:PORT` when the command line said where it serves, else nothing."""
    host, port = server_args.get("host"), server_args.get("port")
    if host is None or port is None:
        return ""
    return f" on http://[{host}]:{port}" if ":" in host else f" on http://{host}:{port}"
