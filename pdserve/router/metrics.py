"""The router's Prometheus metrics: requests by endpoint and outcome, retries, latencies,
worker health and load. Torch-free.

Several router processes (`--router-processes`) sum theirs: each writes its values into a
directory they share (prometheus_client's multiprocess mode), and `/metrics`, whichever
process answers it, reads them all. Counters and histograms add up; a worker counts as in
rotation while every live process has it in rotation, and its requests in flight are the sum
over the live processes. Each process writes its worker gauges at every health-check round.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


@contextlib.contextmanager
def summed_across_processes() -> Iterator[Callable[[int], None]]:
    """Metrics of the router processes started within (forked: they inherit it) summed in a
    directory of their own, removed at the end. Yields what to call with a process's pid when
    it has ended."""
    directory = tempfile.mkdtemp(prefix="pdserve-router-metrics-")
    os.environ[MULTIPROCESS_DIR_ENV] = directory
    # NOTE: prometheus_client picks how values are kept when it is imported.
    values.ValueClass = values.get_value_class()
    try:
        yield lambda pid: multiprocess.mark_process_dead(pid, directory)
    finally:
        del os.environ[MULTIPROCESS_DIR_ENV]
        values.ValueClass = values.get_value_class()
        shutil.rmtree(directory, ignore_errors=True)


class RouterMetrics:
    def __init__(self) -> None:
        self.summed = MULTIPROCESS_DIR_ENV in os.environ
        self._rendered: set[tuple[str, str]] = set()
        self._children: dict[tuple, Counter | Histogram] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_router:requests_total",
            "Requests by endpoint and HTTP status returned",
            ["endpoint", "status"],
            registry=r,
        )
        self.retries = Counter(
            "pdserve_router:retries_total", "Requests retried on a new pair", registry=r
        )
        self.leg_failures = Counter(
            "pdserve_router:leg_failures_total",
            "Failed prefill/decode legs by role and kind",
            ["role", "kind"],
            registry=r,
        )
        self.latency = Histogram(
            "pdserve_router:request_latency_seconds",
            "Time from request arrival to the end of its response",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_byte_latency = Histogram(
            "pdserve_router:time_to_first_byte_seconds",
            "Time from request arrival to the first response byte from the decode worker",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_healthy = Gauge(
            "pdserve_router:worker_healthy",
            "1 while the worker is in rotation",
            ["role", "url"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.worker_in_flight = Gauge(
            "pdserve_router:worker_requests_in_flight",
            "Requests this router has in flight on the worker",
            ["role", "url"],
            registry=r,
            multiprocess_mode="livesum",
        )

    def ended(self, endpoint: str, status: str, seconds: float) -> None:
        """A request ended with `status` (sent, or the error a started stream ended with)
        `seconds` after its arrival."""
        self._child(self.requests, endpoint, status).inc()
        self._child(self.latency, endpoint).observe(seconds)

    def first_byte(self, endpoint: str, seconds: float) -> None:
        """The answering worker's first byte for a request came `seconds` after its arrival."""
        self._child(self.first_byte_latency, endpoint).observe(seconds)

    def _child(self, metric, *labels: str):
        # NOTE: labels() checks and locks on every call (the hot path calls this 3 times a
        # request); a child, once made, stays.
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def refresh(self, pools) -> None:
        """Set the worker gauges from the pools."""
        current = set()
        for pool in pools:
            for worker in pool.workers:
                labels = (pool.role.value, worker.url)
                current.add(labels)
                self.worker_healthy.labels(*labels).set(1 if worker.healthy else 0)
                self.worker_in_flight.labels(*labels).set(worker.in_flight)
        for labels in self._rendered - current:  # NOTE: workers DNS discovery dropped
            # NOTE: zeroed first: summed across processes, a value once written stays.
            for gauge in (self.worker_healthy, self.worker_in_flight):
                gauge.labels(*labels).set(0)
                gauge.remove(*labels)
        self._rendered = current

    def render(self, pools) -> bytes:
        self.refresh(pools)
        if not self.summed:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
