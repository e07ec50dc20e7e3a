"""The `ipc` backend on the GPU: prefill (cuda:0) maps the decode engine's KV pool (the last
GPU: cuda:1 on two, cuda:0 itself on one) through CUDA IPC. Such a mapping keeps the memory
of a decode process that died allocated until it is closed, and torch leaves a
reference-counter file in /dev/shm for a killed exporter; once a killed decode engine is
restarted by its worker, the old pool's GPU memory comes back and nothing of it is left in
/dev/shm, within seconds (not when prefill's idle peer would time out, a minute later). The
CPU counterpart is tests/e2e/test_ipc_shared_memory.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.e2e.conftest import engine_pid
from tests.e2e.pd_cluster import FAST_FAILURE, start_cluster
from tests.e2e.test_ipc_shared_memory import RELEASE_DEADLINE_S, _complete, _segments_named_by
from tests.gpu.test_pd_two_gpus import ENGINE
from tests.waiting import wait_until

pytestmark = pytest.mark.gpu

POOL_BYTES = 1 << 30  # ENGINE's --kv-cache-memory: decode's whole pool


def _decode_gpu() -> int:
    return torch.cuda.device_count() - 1


def _free_bytes() -> int:
    """Free memory on decode's GPU (this process's own context there made beforehand). The
    restarted engine allocates a new pool either way, so what is missing after its restart is
    the old pool, unless it was released."""
    return torch.cuda.mem_get_info(_decode_gpu())[0]


def test_a_killed_decode_engines_gpu_pool_is_freed_once_it_restarted(tiny_model_dirs):
    _free_bytes()  # NOTE: this process's context on decode's GPU, before any measure
    cluster = start_cluster(
        tiny_model_dirs("llama"),
        backend="ipc",
        worker_args=(*ENGINE, *FAST_FAILURE),
        prefill_args=("--device", "cuda:0"),
        decode_args=("--device", f"cuda:{_decode_gpu()}"),
        router_args=("--request-timeout", "60"),
    )
    try:
        prefill, decode = cluster.prefill[0], cluster.decode[0]
        _complete(cluster, 0)  # decode registered: prefill mapped its pool
        prefill_engine, old = engine_pid(prefill), engine_pid(decode)
        assert _segments_named_by(old)  # torch's reference-counter file for the pool
        with_old_engine = _free_bytes()
        os.kill(old, signal.SIGKILL)
        wait_until(
            lambda: decode.get("/health").status_code == 200 and engine_pid(decode) != old,
            "the decode engine's restart",
            120,
            retry_on=(LookupError, OSError),
        )
        wait_until(
            lambda: _complete(cluster, 1) is None,
            "a request through the new engine",
            30,
            retry_on=(AssertionError,),  # NOTE: a 503 while the router takes decode back
        )

        def left() -> dict[str, object]:
            return {
                "GPU memory missing (MiB)": (with_old_engine - _free_bytes()) >> 20,
                "segments in /dev/shm": _segments_named_by(old),
            }

        wait_until(
            lambda: (
                left()["GPU memory missing (MiB)"] < (POOL_BYTES >> 20) // 2
                and not left()["segments in /dev/shm"]
            ),
            "the killed engine's pool to be released",
            RELEASE_DEADLINE_S,
            describe=left,
        )
        assert engine_pid(prefill) == prefill_engine  # no CUDA error from the dead mapping
        cluster.wait_all_free()
    finally:
        cluster.stop()
