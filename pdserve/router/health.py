"""Periodic health checks: a worker leaves rotation after `health_failure_threshold` failures
in a row (failed `/health` checks, or requests that could not reach it, see `proxy`) and
returns after one good check. A worker out of rotation whose check timed out (it accepts
connections but answers nothing: SIGSTOP, a wedged process) has its legs cut (`on_silent`),
so requests in flight there end within a few checks instead of at their deadline. A prefill
worker whose bootstrap port was not given is asked for
it (`/server_info`) until it answers. Each round first refreshes the pools from DNS
(`discovery`; a no-op without services). Torch-free."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Discovery
from pdserve.router.workers import Role, Worker, WorkerPool

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        config: RouterConfig,
        pools: list[WorkerPool],
        client: httpx.AsyncClient,
        discovery: Discovery,
        on_silent: Callable[[Worker], None] = lambda worker: None,
    ):
        self.config = config
        self.pools = pools
        self.client = client
        self.discovery = discovery
        self.on_silent = on_silent

    async def run(self, after_round: Callable[[], None] = lambda: None) -> None:
        """Checks every interval; the first round is the caller's (before serving)."""
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            await self.check_all()
            after_round()

    async def check_all(self) -> None:
        await self.discovery.refresh()  # NOTE: nothing to do without --*-service
        checks = [self._check(pool, w) for pool in self.pools for w in pool.workers]
        await asyncio.gather(*checks)

    async def _check(self, pool: WorkerPool, worker: Worker) -> None:
        error, silent = None, False
        try:
            response = await self.client.get(
                worker.url + "/health", timeout=self.config.health_check_timeout_s
            )
            if response.status_code != 200:
                error = f"/health answered {response.status_code}"
            elif pool.role is Role.PREFILL and worker.bootstrap_port is None:
                error = await self._discover_bootstrap_port(worker)
        except httpx.HTTPError as e:
            error = f"/health failed: {type(e).__name__}: {e}"
            # NOTE: connected (or sent) but no answer in time; not a refused connection
            silent = isinstance(e, (httpx.ReadTimeout, httpx.WriteTimeout))
        if error is None:
            # NOTE: a worker out of rotation without an error has not been in it yet.
            back = worker.last_error is not None
            if pool.mark(worker, True):
                where = "back in rotation" if back else "in rotation"
                logger.info("%s worker %s is %s", pool.role.value, worker.url, where)
            return
        if pool.note_failure(worker, error, self.config.health_failure_threshold):
            logger.warning("%s worker %s out of rotation: %s", pool.role.value, worker.url, error)
        if silent and not worker.healthy:
            self.on_silent(worker)

    async def _discover_bootstrap_port(self, worker: Worker) -> str | None:
        # NOTE: /server_info is behind the API key the router and its workers share.
        key = self.config.api_key
        response = await self.client.get(
            worker.url + "/server_info",
            headers={"Authorization": f"Bearer {key}"} if key else None,
            timeout=self.config.health_check_timeout_s,
        )
        if response.status_code != 200:
            return f"/server_info answered {response.status_code}"
        try:
            port = response.json().get("disaggregation_bootstrap_port")
        except (ValueError, AttributeError):  # NOTE: not a JSON object: a wrong server
            port = None
        if not isinstance(port, int):
            return "the prefill worker did not report its bootstrap port"
        worker.bootstrap_port = port
        return None
