"""Worker discovery through DNS: a name that resolves to one address per worker.

In Kubernetes that name is a headless Service (`clusterIP: None`): its DNS name resolves to
the addresses of the ready pods it selects, so a pool scaled up or down, or a pod replaced,
shows up in the next lookup without the router talking to the Kubernetes API (no RBAC, no
client library). The router resolves each name before every round of health checks: a new
address joins the pool out of rotation until its first good check; an address that vanished
leaves the pool; a failed lookup keeps the workers the last good one found (a DNS hiccup must
not empty the pool; the health checks still take dead workers out). Torch-free.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass

from pdserve.router.workers import WorkerPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceName:
    """`host:port`: a DNS name and the HTTP port every address it resolves to serves on."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> ServiceName:
        host, sep, port = text.rpartition(":")
        if not sep or not host or "/" in text:
            raise ValueError(
                f"a worker service is NAME:PORT (e.g. pdserve-decode:30000), got {text!r}"
            )
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"service port must be in [1, 65535], got {port!r} in {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def worker_url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


async def resolve(service: ServiceName, timeout_s: float) -> list[str]:
    """The worker URLs `service` resolves to now, sorted; raises OSError or TimeoutError.
    A name with both IPv4 and IPv6 addresses (a dual-stack host) counts by its IPv4 ones, so
    that one worker is not listed, and load-balanced, twice."""
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(
        loop.getaddrinfo(service.host, service.port, type=socket.SOCK_STREAM), timeout_s
    )
    v4 = [info for info in infos if info[0] == socket.AF_INET]
    return sorted({worker_url(info[4][0], service.port) for info in v4 or infos})


class Discovery:
    """Keeps each pool's discovered workers equal to what its services resolve to."""

    def __init__(self, sources: list[tuple[WorkerPool, ServiceName]], timeout_s: float):
        self.sources = sources
        self.timeout_s = timeout_s

    async def refresh(self) -> None:
        found = await asyncio.gather(*(self._lookup(service) for _, service in self.sources))
        per_pool: dict[WorkerPool, list[list[str] | None]] = {}
        for (pool, _), urls in zip(self.sources, found, strict=True):
            per_pool.setdefault(pool, []).append(urls)
        for pool, lookups in per_pool.items():
            if any(urls is None for urls in lookups):
                continue  # NOTE: a failed lookup keeps what the last good one found
            added, removed = pool.sync_discovered(set().union(*lookups))
            for url in added:
                logger.info("discovered %s worker %s", pool.role.value, url)
            for url in removed:
                logger.info("%s worker %s is gone from DNS; removed", pool.role.value, url)

    async def _lookup(self, service: ServiceName) -> list[str] | None:
        try:
            return await resolve(service, self.timeout_s)
        except (OSError, TimeoutError) as e:
            logger.warning("could not resolve worker service %s: %s", service, e)
            return None
