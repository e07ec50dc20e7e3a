"""Build a prefill worker in its engine process: the engine, with the speculator its settings
ask for, and the prefill handoff serving its KV on the bootstrap port."""

from __future__ import annotations

import dataclasses

from pdserve.disagg import rank_worker
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.prefill.handoff import PrefillHandoff
from pdserve.speculative.speculator import build_speculator
from pdserve.transfer.config import TransferConfig


def build_worker(config: EngineConfig, transfer: TransferConfig) -> PrefillHandoff:
    """A `WorkerFactory` (pdserve.engine.handoff) once `transfer` is bound:
    `functools.partial(build_worker, transfer=...)`."""
    # NOTE: the other ranks of a tensor-parallel worker move their own KV heads.
    config = dataclasses.replace(config, rank_worker_module=rank_worker.__name__)
    return PrefillHandoff(Engine(config, build_speculator(config.speculative)), transfer)
