"""Build a decode worker in its engine process: the engine, with the speculator its settings
ask for, and the decode connector that fetches KV from prefill workers."""

from __future__ import annotations

import dataclasses

from pdserve.decode.connector import DecodeConnector
from pdserve.disagg import rank_worker
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.speculative.speculator import build_speculator
from pdserve.transfer.config import TransferConfig


def build_worker(config: EngineConfig, transfer: TransferConfig) -> Engine:
    """A `WorkerFactory` (pdserve.engine.kv_connector) once `transfer` is bound:
    `functools.partial(build_worker, transfer=...)`."""
    # NOTE: the other ranks of a tensor-parallel worker move their own KV heads.
    config = dataclasses.replace(config, rank_worker_module=rank_worker.__name__)
    engine = Engine(config, build_speculator(config.speculative))
    try:
        DecodeConnector(engine, transfer)  # NOTE: it connects itself to the engine
    except BaseException:
        engine.close()
        raise
    return engine
