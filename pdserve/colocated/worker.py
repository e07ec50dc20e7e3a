"""Build a colocated worker in its engine process: the engine, with the speculator its settings
ask for, and no KV connector (prefill and decode both happen here)."""

from __future__ import annotations

from pdserve.engine.core.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.speculative.speculator import build_speculator


def build_worker(config: EngineConfig) -> Engine:
    """A `WorkerFactory` (pdserve.engine.kv_connector)."""
    return Engine(config, build_speculator(config.speculative))
