"""Build a decode worker in its engine process: the engine, with the speculator its settings
ask for, and the decode handoff that fetches KV from prefill workers."""

from __future__ import annotations

import dataclasses

from pdserve.decode.handoff import DecodeHandoff
from pdserve.disagg import rank_worker
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.speculative.speculator import build_speculator
from pdserve.transfer.config import TransferConfig


def build_worker(config: EngineConfig, transfer: TransferConfig) -> DecodeHandoff:
    """A `WorkerFactory` (pdserve.engine.handoff) once `transfer` is bound:
    `functools.partial(build_worker, transfer=...)`."""
    # NOTE: the other ranks of a tensor-parallel worker move their own KV heads.
    config = dataclasses.replace(config, rank_worker_module=rank_worker.__name__)
    return DecodeHandoff(Engine(config, build_speculator(config.speculative)), transfer)
