"""Build a prefill worker in its engine process: the engine, with the speculator its settings
ask for, and the prefill connector serving its KV on the bootstrap port."""

from __future__ import annotations

from pdserve.disagg.worker import connected, disaggregated_config
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.prefill.connector import PrefillConnector
from pdserve.speculative.speculator import build_speculator
from pdserve.transfer.config import TransferConfig


def build_worker(config: EngineConfig, transfer: TransferConfig) -> Engine:
    """A `WorkerFactory` (pdserve.engine.kv_connector) once `transfer` is bound:
    `functools.partial(build_worker, transfer=...)`."""
    config = disaggregated_config(config)
    return connected(
        Engine(config, build_speculator(config.speculative)), transfer, PrefillConnector
    )
