"""Engine processes on CPU take the cores less one, split between the engine processes that
share them (`pdserve.engine.runtime.cpu_threads`): applied by the engine, handed on by launch."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.core.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.runtime import cpu_threads

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may run on `n` cores; torch's thread count restored after."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    yield set_cores
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "n, processes, expected", [(2, 1, 1), (16, 1, 15), (16, 2, 7), (9, 3, 2), (2, 4, 1), (1, 1, 1)]
)
def test_cpu_threads_are_the_cores_less_one_split_between_engine_processes(
    cores, n, processes, expected
):
    cores(n)
    assert cpu_threads.engine_threads(CPU, None, processes) == expected


def test_the_flag_wins_on_cpu_omp_num_threads_next_and_cuda_takes_one(cores, monkeypatch):
    cores(16)
    assert cpu_threads.engine_threads(CPU, 3, 1) == 3
    assert cpu_threads.engine_threads(CUDA, 3, 1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    torch.set_num_threads(5)  # NOTE: what torch does with the variable when it starts
    assert cpu_threads.engine_threads(CPU, None, 1) == 5
    assert cpu_threads.engine_threads(CUDA, None, 1) == 5
    assert cpu_threads.engine_threads(CPU, 2, 1) == 2


def test_an_engine_on_cpu_sets_its_threads(cores, tiny_model_dirs):
    cores(6)
    torch.set_num_threads(3)
    Engine(EngineConfig(model_path=tiny_model_dirs("llama"), device="cpu"))
    assert torch.get_num_threads() == 5
    Engine(EngineConfig(model_path=tiny_model_dirs("llama"), device="cpu", cpu_threads=2))
    assert torch.get_num_threads() == 2


def test_cpu_threads_must_be_positive():
    with pytest.raises(ValueError, match="cpu_threads must be >= 1, got 0"):
        EngineConfig(model_path="m", cpu_threads=0)
