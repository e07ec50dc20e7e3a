"""How many torch intra-op threads an engine process runs.

torch starts one OpenMP thread per core in every process. An engine is rarely alone on its
cores: a worker's HTTP front end (tokenizing, streaming) runs beside it, a launch runs several
workers, a TP worker on CPU runs one process per rank. OpenMP threads meet at a barrier after
every op, so when another process holds one of their cores, every op waits for it: on a busy
2-core machine a 64-token generation took 10-40x longer with 2 threads than with 1
(`benchmarks/RESULTS.md`, "Engine threads on CPU"). So, as vLLM's CPU backend reserves a core
for its front end, an engine process on CPU takes the cores this process may run on, less one,
split between the engine processes that share them (`engine_processes`), at least one; on
CUDA one (the host's tensor work is bookkeeping there). `--cpu-threads` or OMP_NUM_THREADS
choose otherwise. Torch is imported only where threads are set: the launcher and the router
use `default_cpu_threads` without it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def usable_cores() -> int:
    """The cores this process may run on (its affinity; all of them where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_cpu_threads(engine_processes: int) -> int:
    """Threads of each of `engine_processes` engine processes on this machine's CPU."""
    return max(1, (usable_cores() - 1) // max(1, engine_processes))


def engine_threads(device: torch.device, cpu_threads: int | None, engine_processes: int) -> int:
    """The intra-op threads of an engine process on `device`: `cpu_threads` if given (CPU),
    else OMP_NUM_THREADS's if set, else one on CUDA and the default split on CPU."""
    import torch

    if device.type == "cpu" and cpu_threads is not None:
        return cpu_threads
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()  # NOTE: torch read it at start-up
    if device.type == "cuda":
        return 1
    return default_cpu_threads(engine_processes)


def set_engine_threads(device: torch.device, cpu_threads: int | None, engine_processes: int) -> int:
    """Apply `engine_threads` to this process; returns the count."""
    import torch

    threads = engine_threads(device, cpu_threads, engine_processes)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
