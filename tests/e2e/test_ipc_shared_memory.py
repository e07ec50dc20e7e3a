"""The `ipc` backend on CPU: a decode engine shares its KV pools in shared memory and the
prefill engine maps them; once that decode engine is gone (killed and restarted by its
worker, or its worker stopped with SIGTERM) nothing of it may stay on the host: no segment
in /dev/shm, no mapping of it in the prefill engine, no torch shared-memory manager. (The
GPU's counterpart, CUDA IPC mappings, is in tests/gpu/test_ipc_release_gpu.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from tests.e2e.conftest import engine_pid
from tests.e2e.pd_cluster import FAST_FAILURE, start_cluster
from tests.waiting import wait_until

RESTART_DEADLINE_S = 120.0
RELEASE_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    running = start_cluster(
        tiny_model_dirs("llama"), backend="ipc", worker_args=FAST_FAILURE, num_decode=2
    )
    yield running
    running.stop()


def _complete(cluster, i: int) -> None:
    body = {"prompt": f"hello {i}", "max_tokens": 2, "temperature": 0}
    response = cluster.router.post("/v1/completions", body)
    assert response.status_code == 200, response.text


def _segments_named_by(pid: int) -> list[str]:
    """Names in /dev/shm that process `pid` created (torch names them torch_<pid>_...)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"torch_{pid}_*"))


def _mapped_segments_of(reader: int, owner: int) -> set[str]:
    """The shared-memory files of process `owner` that process `reader` maps or holds open."""
    held = {f"mapped {line.split(None, 5)[5]}" for line in _lines(f"/proc/{reader}/maps")}
    for fd in Path(f"/proc/{reader}/fd").iterdir():
        with contextlib.suppress(OSError):  # NOTE: a descriptor closed meanwhile
            held.add(f"descriptor {fd.name}: {os.readlink(fd)}")
    return {entry for entry in held if f"/dev/shm/torch_{owner}_" in entry}


def _lines(path: str) -> list[str]:
    return [line for line in Path(path).read_text().splitlines() if "/dev/shm/" in line]


def _children_named(pid: int, name: bytes) -> list[int]:
    """The processes called `name` whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and name in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _registered_engine(cluster, decode) -> tuple[int, int, list[int]]:
    """(prefill engine, decode engine, its shm managers) once prefill mapped its pools."""
    prefill = engine_pid(cluster.prefill[0])
    owner = engine_pid(decode)
    requests = iter(range(1000))

    def mapped_after_a_request() -> set[str]:
        _complete(cluster, next(requests))  # NOTE: the router picks the decode worker
        return _mapped_segments_of(prefill, owner)

    wait_until(mapped_after_a_request, "prefill to map decode's pools", 30, poll_s=0)
    return prefill, owner, _children_named(owner, b"torch_shm_manager")


def _left_behind(prefill: int, gone: int, managers: list[int]) -> dict[str, object]:
    return {
        "segments in /dev/shm": _segments_named_by(gone),
        "mapped by prefill": sorted(_mapped_segments_of(prefill, gone)),
        "shm managers alive": [pid for pid in managers if _alive(pid)],
    }


def _nothing_left(prefill: int, gone: int, managers: list[int]) -> None:
    wait_until(
        lambda: not any(_left_behind(prefill, gone, managers).values()),
        "the gone decode engine's shared memory to be released",
        RELEASE_DEADLINE_S,
        describe=lambda: _left_behind(prefill, gone, managers),
    )


def test_a_decode_engine_killed_and_restarted_leaves_no_shared_memory(cluster):
    decode = cluster.decode[0]
    prefill, old, managers = _registered_engine(cluster, decode)
    os.kill(old, signal.SIGKILL)
    wait_until(
        lambda: decode.get("/health").status_code == 200 and engine_pid(decode) != old,
        "the decode engine's restart",
        RESTART_DEADLINE_S,
        retry_on=(LookupError, OSError),
    )
    _, new, _ = _registered_engine(cluster, decode)
    _nothing_left(prefill, old, managers)
    assert _mapped_segments_of(prefill, new)  # the new engine's pools are in use
    assert engine_pid(cluster.prefill[0]) == prefill


def test_a_decode_worker_stopped_with_sigterm_leaves_no_shared_memory(cluster):
    decode = cluster.decode[1]
    prefill, owner, managers = _registered_engine(cluster, decode)
    decode.local.stop()  # SIGTERM to its process group: a graceful shutdown
    assert decode.process.returncode is not None
    _nothing_left(prefill, owner, managers)
    assert engine_pid(cluster.prefill[0]) == prefill
