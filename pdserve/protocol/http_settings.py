"""What every pdserve HTTP process (worker or router) is told about serving: where it binds,
its API key, how long SIGTERM waits, what a client's connection may hold (`http_guard`), and,
for workers, the model name and queue bound.
Torch-free: the router reads it too."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.flags import option

# The flags a router has no use for (it reports its workers' model and has no queue).
WORKER_ONLY = ("served_model_name", "max_queued_requests", "chat_template")


@dataclass(frozen=True)
class HttpSettings:
    host: str = option("127.0.0.1", "address to bind (default: loopback)")
    port: int = option(30000, "port to serve HTTP on")
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' (/health, /health_generate, /metrics and "
        "/version stay open)",
        secret_env="PDSERVE_API_KEY",
    )
    shutdown_timeout: float = option(
        5.0,
        "seconds in-flight requests may take to finish after SIGTERM (new connections are "
        "refused at once); then streams end with an SSE error event and [DONE], other "
        "requests with 503; keep it a few seconds under the pod's "
        "terminationGracePeriodSeconds",
    )
    header_timeout: float = option(
        10.0,
        "seconds a client may take to send a request's headers (from connecting, or from the "
        "request's first byte); then 408 and the connection is closed",
    )
    body_timeout: float = option(
        30.0,
        "seconds a client may take to send a request's body, from the end of its headers; "
        "then 408 and the connection is closed (the response's time is not bounded)",
    )
    max_header_bytes: int = option(
        64 * 1024, "request line and headers over this many bytes are refused with 431"
    )
    max_header_count: int = option(256, "requests with more headers are refused with 431")
    max_connections: int = option(
        0,
        "open client connections at most; past it a new one closes the longest-idle one "
        "(or is refused with 503). 0: a quarter of the open-file limit, at most 16384",
    )
    served_model_name: str | None = option(
        None, "model name the API reports and accepts (default: the model path)"
    )
    max_queued_requests: int = option(1024, "waiting requests beyond this are refused with 429")
    chat_template: str | None = option(
        None,
        "the chat template: a file, or the Jinja template itself (default: the tokenizer's)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(
                f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}"
            )
        for flag, seconds in (
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
        ):
            if not seconds > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {seconds}")
        for flag, value in (
            ("--max-header-bytes", self.max_header_bytes),
            ("--max-header-count", self.max_header_count),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.max_connections < 0:
            raise ValueError(f"--max-connections must be >= 0, got {self.max_connections}")
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
