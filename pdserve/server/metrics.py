"""Prometheus metrics with vLLM's names under a `pdserve:` prefix.

Latencies are measured in the front end, where a client would see them; queue sizes and KV
usage come from the engine's latest stats, read at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

ACCEPT_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class ServerMetrics:
    def __init__(self, model_name: str, disaggregated: bool = False):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels

        def gauge(name, doc):
            return Gauge(f"pdserve:{name}", doc, list(labels), registry=self.registry).labels(
                **labels
            )

        def counter(name, doc, extra=()):
            metric = Counter(f"pdserve:{name}", doc, [*labels, *extra], registry=self.registry)
            return metric if extra else metric.labels(**labels)

        def histogram(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(
                f"pdserve:{name}",
                doc,
                list(labels),
                buckets=buckets,
                registry=self.registry,
            ).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV pages in use (0-1)")
        self.kv_pages_used = gauge("kv_cache_pages_used", "KV pages in use")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens processed")
        self.cached_prompt_tokens = counter(
            "prefix_cache_hit_tokens_total",
            "Prompt tokens taken from the prefix cache (hit rate: over prompt_tokens_total)",
        )
        self.kv_pages_cached = gauge(
            "kv_cache_pages_cached", "KV pages the prefix cache holds (in use or not)"
        )
        self.prefix_cache_evictions = counter(
            "prefix_cache_evicted_pages_total", "KV pages evicted from the prefix cache"
        )
        self._evictions_seen = 0
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated")
        self._success = counter(
            "request_success_total", "Finished requests by finish reason", ("finished_reason",)
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first token"
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between a request's consecutive outputs (one per engine step; several tokens "
            "with speculative decoding, or when its stream fell behind)",
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its last token"
        )
        self.spec_accept_length = histogram(
            "spec_accept_length",
            "Speculative decoding: a finished request's mean tokens per verify step",
            ACCEPT_LENGTH_BUCKETS,
        )
        self.disagg = _DisaggMetrics(gauge, counter, histogram, labels) if disaggregated else None

    def observe_stats(self, stats) -> None:
        """Every stats message from the engine (counters advance by their deltas)."""
        evictions = stats.prefix_cache_evictions
        if evictions > self._evictions_seen:
            self.prefix_cache_evictions.inc(evictions - self._evictions_seen)
        self._evictions_seen = evictions
        if self.disagg is not None and stats.disagg is not None:
            self.disagg.observe(stats.disagg)

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=finish_reason).inc()

    def render(self, stats) -> bytes:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_pages_used.set(stats.kv_pages_used)
        self.kv_pages_cached.set(stats.kv_pages_cached)
        total = stats.kv_pages_total or 1
        self.kv_cache_usage.set(stats.kv_pages_used / total)
        if self.disagg is not None and stats.disagg is not None:
            self.disagg.set_queues(stats.disagg)
        return generate_latest(self.registry)


class _DisaggMetrics:
    """Prefill/decode handoff: queue sizes, KV bytes and latency, failures by stage and kind
    (`protocol/failures.py`), malformed peer messages."""

    def __init__(self, gauge, counter, histogram, model_labels: dict[str, str]):
        self._model = model_labels
        self.queues = {
            "num_bootstrapping": gauge(
                "num_requests_bootstrapping", "Prefill: requests waiting for decode's pages"
            ),
            "num_prefilling": gauge(
                "num_requests_prefilling", "Prefill: requests computing before their send"
            ),
            "num_prealloc": gauge(
                "num_requests_prealloc", "Decode: requests waiting for free KV pages"
            ),
            "num_transferring": gauge(
                "num_requests_transferring", "Requests whose KV is in flight"
            ),
            "num_held_back": gauge(
                "num_rooms_held_back",
                "Decode (ipc): failed rooms whose pages wait until prefill's writes are over",
            ),
        }
        self.bytes = counter(
            "kv_transfer_bytes_total", "KV bytes moved, by direction", ("direction",)
        )
        self.skipped = counter(
            "kv_transfer_skipped_bytes_total",
            "KV bytes a decode worker did not receive: its prefix cache held them already",
        )
        self.transfers = counter("kv_transfers_total", "KV transfers that succeeded")
        self.latency = histogram(
            "kv_transfer_latency_seconds", "Time from a room's start to its successful end"
        )
        self.failures = counter(
            "kv_transfer_failures_total",
            "Failed rooms by stage (bootstrap, transfer, engine) and failure kind",
            ("stage", "kind"),
        )
        self.malformed = counter(
            "kv_transfer_malformed_messages_total",
            "Peer messages dropped because they failed the schema checks",
        )
        self._seen: dict[str, float] = {}

    def set_queues(self, stats) -> None:
        for name, metric in self.queues.items():
            metric.set(getattr(stats, name))

    def observe(self, stats) -> None:
        model = self._model
        self._advance("sent", stats.bytes_sent, self.bytes.labels(**model, direction="sent"))
        received = self.bytes.labels(**model, direction="received")
        self._advance("received", stats.bytes_received, received)
        self._advance("skipped", stats.bytes_skipped, self.skipped)
        self._advance("succeeded", stats.transfers_succeeded, self.transfers)
        self._advance("malformed", stats.malformed_messages, self.malformed)
        for key, count in stats.failures.items():
            stage, _, kind = key.partition("/")
            self._advance(key, count, self.failures.labels(**model, stage=stage, kind=kind))
        for latency in stats.transfer_latencies:
            self.latency.observe(latency)
        self.set_queues(stats)

    def _advance(self, key: str, total: float, counter) -> None:
        """Add to `counter` (a labelled child) what the cumulative `total` grew by."""
        delta = total - self._seen.get(key, 0)
        if delta <= 0:
            return
        self._seen[key] = total
        counter.inc(delta)
