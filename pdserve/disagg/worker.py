"""What building a prefill or decode worker in its engine process takes beyond a colocated
one: rank workers that move their own KV heads, and the role's KV connector connected to the
engine."""

from __future__ import annotations

import dataclasses

from pdserve.disagg import rank_worker
from pdserve.disagg.connector_base import DisaggConnector
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.transfer.config import TransferConfig


def disaggregated_config(config: EngineConfig) -> EngineConfig:
    """NOTE: the other ranks of a tensor-parallel worker move their own KV heads."""
    return dataclasses.replace(config, rank_worker_module=rank_worker.__name__)


def connected(engine: Engine, transfer: TransferConfig, connector: type[DisaggConnector]) -> Engine:
    """`engine` with a `connector` over `transfer` (it connects itself to the engine)."""
    try:
        connector(engine, transfer)
    except BaseException:
        engine.close()  # NOTE: the other ranks do not outlive a failed start
        raise
    return engine
