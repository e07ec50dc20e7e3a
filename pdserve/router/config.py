"""Router settings: the workers, pairing policies, deadlines. One frozen dataclass whose
fields declare their own flags (`protocol.flags`); `pdserve.commands.router` adds the worker
lists and policies, which take several values each. Torch-free.

Two modes: disaggregated (prefill and decode workers, found by URL or DNS) or colocated
(`worker_urls`: ordinary `pdserve serve` workers, each request on one of them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.edge.strict_json import MAX_BODY_BYTES as DEFAULT_MAX_BODY_BYTES
from pdserve.protocol.flags import option
from pdserve.router.discovery import ServiceName
from pdserve.router.policies import POLICIES

MAX_ROUTER_PROCESSES = 64


@dataclass(frozen=True)
class RouterConfig:
    """prefill: (url, bootstrap port or None to ask the worker's /server_info).
    worker_urls: colocated workers instead of prefill and decode ones; `policy` picks one
    per request.
    prefill_services / decode_services: DNS names whose addresses are workers (discovery).
    request_timeout_s: the most a request may take, both legs and all of its stream.
    health_check_interval_s / health_failure_threshold: a worker leaves rotation after that
    many failures in a row (failed checks, or requests that could not reach it even on a new
    connection) and comes back after one good check.
    dead_worker_timeout_s: a connection to a worker whose kernel stops answering (host or
    link down) fails after about this long (see `transport`).
    max_body_bytes: a request body over this is refused with 413 while it streams in.
    max_requests_per_worker: requests this router keeps in flight on one worker at most
    (0: no bound); beyond it on every worker of a role, 429.
    max_rooms_per_request: a request with several prompts or n > 1 takes a room per (prompt,
    choice); more than this many is refused with 400.
    router_processes: processes serving the port (`router/processes.py`), each routing on its
    own: it counts only its own requests in flight (each keeps `max_requests_per_worker //
    router_processes` at most, so that together they keep the bound), and cache_aware's
    prefix index would see only its share of the requests, so that policy takes one process."""

    prefill: tuple[tuple[str, int | None], ...] = ()
    decode: tuple[str, ...] = ()
    prefill_services: tuple[ServiceName, ...] = ()
    decode_services: tuple[ServiceName, ...] = ()
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    worker_urls: tuple[str, ...] = ()
    policy: str = "round_robin"
    api_key: str | None = None
    request_timeout_s: float = option(
        600.0,
        "seconds a request may take, both legs and all of its stream",
        name="--request-timeout",
    )
    connect_timeout_s: float = option(
        5.0,
        "seconds to open a connection to a worker before it counts as unreachable",
        name="--connect-timeout",
    )
    dead_worker_timeout_s: float = option(
        15.0,
        "seconds after which a connection to a worker that stopped answering (host or link "
        "down: no TCP keepalive replies, data unacknowledged) fails",
        name="--dead-worker-timeout",
    )
    health_check_interval_s: float = option(
        2.0, "seconds between health checks of every worker", name="--health-check-interval"
    )
    health_check_timeout_s: float = option(
        2.0,
        "seconds a worker's /health (and a DNS lookup) may take",
        name="--health-check-timeout",
    )
    health_failure_threshold: int = 2
    max_retries: int = 1
    max_body_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES,
        "request bodies over this many bytes are refused with 413 as they stream in",
        name="--max-body-size",
        metavar="BYTES",
    )
    max_requests_per_worker: int = option(
        0,
        "requests this router keeps in flight on one worker at most; when every worker of a "
        "role is at it, new requests get 429 (0: no bound)",
    )
    max_rooms_per_request: int = option(
        256,
        "a request with several prompts or n > 1 takes one prefill/decode room per (prompt, "
        "choice); requests asking for more get 400",
    )
    router_processes: int = option(
        1,
        "router processes serving the port, each routing the connections it accepts on its "
        "own (round robin, health checks and in-flight counts per process; metrics summed)",
        name="--router-processes",
    )
    cache_threshold: float = option(
        0.5,
        "cache_aware: send a request to the worker that has seen the longest prefix of it "
        "when that covers more than this fraction of it (else to the emptiest index)",
    )
    balance_abs_threshold: int = option(
        32, "cache_aware: loads count as imbalanced when max - min exceeds this"
    )
    balance_rel_threshold: float = option(
        1.0001, "cache_aware: ... and max exceeds min times this (then: least loaded)"
    )

    @property
    def colocated(self) -> bool:
        return bool(self.worker_urls)

    def __post_init__(self) -> None:
        self._check_workers()
        for url in [u for u, _ in self.prefill] + list(self.decode) + list(self.worker_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must start with http:// or https://, got {url!r}")
        for _, port in self.prefill:
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"bootstrap port must be in [1, 65535], got {port}")
        for name in (self.prefill_policy, self.decode_policy, self.policy):
            if name not in POLICIES:
                raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "dead_worker_timeout_s",
            "health_check_interval_s",
            "health_check_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.health_failure_threshold < 1 or self.max_retries < 0:
            raise ValueError("health_failure_threshold must be >= 1 and max_retries >= 0")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance-abs-threshold must be >= 0 and balance-rel-threshold >= 1")
        if self.max_rooms_per_request < 1:
            raise ValueError(
                f"max_rooms_per_request must be >= 1, got {self.max_rooms_per_request}"
            )
        if self.max_requests_per_worker < 0:
            raise ValueError(
                f"max_requests_per_worker must be >= 0 (0: no bound), got "
                f"{self.max_requests_per_worker}"
            )
        self._check_processes()

    def _check_processes(self) -> None:
        processes = self.router_processes
        if not 1 <= processes <= MAX_ROUTER_PROCESSES:
            raise ValueError(
                f"--router-processes must be in [1, {MAX_ROUTER_PROCESSES}], got {processes}"
            )
        if processes == 1:
            return
        policies = {self.prefill_policy, self.decode_policy, self.policy}
        if "cache_aware" in policies:
            raise ValueError(
                "the cache_aware policy keeps one prefix index per router process, which would "
                f"see 1/{processes} of the requests: use --router-processes 1 with it"
            )
        if 0 < self.max_requests_per_worker < processes:
            raise ValueError(
                f"--max-requests-per-worker {self.max_requests_per_worker} is split among "
                f"--router-processes {processes}: give at least one per process"
            )

    def per_process(self) -> RouterConfig:
        """What one of `router_processes` processes enforces: its share of the in-flight
        bound (together, at most the whole)."""
        bound = self.max_requests_per_worker // self.router_processes
        return dataclasses.replace(self, max_requests_per_worker=bound, router_processes=1)

    def _check_workers(self) -> None:
        disaggregated = {
            "--prefill": self.prefill,
            "--decode": self.decode,
            "--prefill-service": self.prefill_services,
            "--decode-service": self.decode_services,
        }
        given = [flag for flag, workers in disaggregated.items() if workers]
        if self.worker_urls:
            if given:
                raise ValueError(
                    f"--worker-urls (colocated workers) and {'/'.join(given)} (prefill/decode "
                    "workers) are mutually exclusive: give one or the other"
                )
            return
        if not self.prefill and not self.prefill_services:
            raise ValueError(
                "give at least one --prefill worker URL or --prefill-service (or colocated "
                "workers with --worker-urls)"
            )
        if not self.decode and not self.decode_services:
            raise ValueError("give at least one --decode worker URL or --decode-service")
