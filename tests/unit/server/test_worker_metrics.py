"""A worker's /metrics from the engine's cumulative counters, and a failing counter that must
not cost anyone their tokens."""

from __future__ import annotations

from pdserve.colocated.worker import build_worker
from pdserve.engine.core.config import EngineConfig
from pdserve.protocol.engine_messages import DisaggStats, EngineStats
from pdserve.server.engine_client import EngineClient
from pdserve.server.metrics import ServerMetrics
from pdserve.server.role import WorkerRole


def disagg_stats(scale: int) -> EngineStats:
    counters = DisaggStats(
        bytes_sent=10 * scale,
        bytes_received=20 * scale,
        bytes_skipped=30 * scale,
        transfers_succeeded=scale,
        failures={"transfer/peer_lost": scale},
        malformed_messages=scale,
        transfer_latencies=[0.01] * scale,
    )
    return EngineStats(0, 0, 0, 8, disagg=counters)


def test_every_transfer_counter_advances_by_what_the_engine_counted():
    metrics = ServerMetrics("m", disaggregated=True)
    for scale in (1, 3):  # cumulative: the second report adds the difference
        metrics.observe_stats(disagg_stats(scale))
    text = metrics.render(disagg_stats(3)).decode()
    expected = {
        'kv_transfer_bytes_total{direction="sent",model_name="m"}': 30.0,
        'kv_transfer_bytes_total{direction="received",model_name="m"}': 60.0,
        'kv_transfer_skipped_bytes_total{model_name="m"}': 90.0,
        'kv_transfers_total{model_name="m"}': 3.0,
        'kv_transfer_malformed_messages_total{model_name="m"}': 3.0,
        'kv_transfer_failures_total{kind="peer_lost",model_name="m",stage="transfer"}': 3.0,
    }
    for name, value in expected.items():
        line = next(line for line in text.splitlines() if line.startswith(f"pdserve:{name} "))
        assert float(line.rsplit(" ", 1)[1]) == value, line


def test_a_stats_listener_that_raises_does_not_stop_the_reader(tiny_model_dirs):
    client = EngineClient(
        EngineConfig(model_path=tiny_model_dirs("llama")), WorkerRole("colocated", build_worker)
    )
    try:
        seen = []

        def broken(stats):
            raise ValueError("a bug in a counter")

        client.stats_listeners += [broken, seen.append]
        stats = disagg_stats(1)
        client._set_stats(stats)  # NOTE: the reader calls this before routing the outputs
        assert client.stats is stats and seen == [stats]
    finally:
        client._sync_context.term()
        client._async_context.term()
        client._scratch.cleanup()
