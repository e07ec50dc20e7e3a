"""Build a colocated worker in its engine process: the engine, with the speculator its settings
ask for, behind the null handoff."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.handoff import Colocated
from pdserve.speculative.speculator import build_speculator


def build_worker(config: EngineConfig) -> Colocated:
    """A `WorkerFactory` (pdserve.engine.handoff)."""
    return Colocated(Engine(config, build_speculator(config.speculative)))
