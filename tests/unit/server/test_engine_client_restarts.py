"""The front end restarts a failed engine process a bounded number of times per window, and
never one that was stopped on purpose; /health's detail says which it is."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from types import SimpleNamespace

import pytest
import torch
import zmq

from pdserve.colocated.worker import build_worker
from pdserve.engine.core.config import EngineConfig
from pdserve.protocol.channel import Channel
from pdserve.server.engine_client import (
    SEND_TIMEOUT_MS,
    EngineClient,
    EngineClientConfig,
    EngineUnavailable,
)
from pdserve.server.role import WorkerRole

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


@pytest.fixture
def make_client(monkeypatch, tiny_model_dirs):
    made = []

    def make(options: EngineClientConfig) -> EngineClient:
        config = EngineConfig(model_path=tiny_model_dirs("llama"))
        client = EngineClient(config, WorkerRole("colocated", build_worker), options)
        _fake_processes(monkeypatch, client)
        made.append(client)
        return client

    yield make
    for client in made:
        client._sync_context.term()
        client._async_context.term()
        client._scratch.cleanup()


@pytest.fixture
def client(make_client):
    return make_client(EngineClientConfig(max_restarts=2, restart_window_s=300.0))


def _fake_processes(monkeypatch, client: EngineClient) -> None:
    spawned = []

    async def spawn():
        spawned.append(True)
        client._process = SimpleNamespace(is_alive=lambda: True, exitcode=None)
        return SimpleNamespace(role="colocated")

    async def stop_process():
        client._process = None

    monkeypatch.setattr(client, "_spawn", spawn)
    monkeypatch.setattr(client, "_stop_process", stop_process)
    client.spawned = spawned


def _die(client, exitcode: int) -> None:
    client._process = SimpleNamespace(is_alive=lambda: False, exitcode=exitcode)
    client._check_alive()


def test_a_crashed_engine_is_restarted_until_the_budget_is_spent(client):
    for _ in range(2):
        _die(client, 1)
        assert client.health_detail == "engine restarting after: engine process exited with code 1"
        asyncio.run(client._restart())
        assert client.failure is None and not client.gave_up
    assert len(client.spawned) == 2
    _die(client, -signal.SIGKILL)
    asyncio.run(client._restart())
    assert client.gave_up and len(client.spawned) == 2
    assert client.health_detail == (
        "engine down, not restarting: engine process exited with code -9 "
        "(after 2 restarts within 300 s)"
    )


def test_restarts_older_than_the_window_do_not_count(make_client):
    client = make_client(EngineClientConfig(max_restarts=1, restart_window_s=0.0))
    for _ in range(5):
        _die(client, 1)
        asyncio.run(client._restart())
    assert not client.gave_up and len(client.spawned) == 5


def test_an_engine_stopped_by_sigterm_is_not_restarted(client):
    _die(client, -signal.SIGTERM)
    assert client.gave_up
    assert client.health_detail == "engine down, not restarting: engine process stopped by SIGTERM"


def test_streams_end_as_a_shutdown_when_the_engine_stopped_with_its_process_group(client, caplog):
    """SIGTERM to the worker's whole process group (systemd's default, `kill -TERM -PGID`)
    stops the engine with the front end. At the shutdown timeout each stream still ends
    saying the server is shutting down, no abort waits out the send timeout on a socket
    nobody reads, and nothing is logged as an error: the stop was asked for."""
    client._push = Channel(client._sync_context, zmq.PUSH, send_timeout_ms=SEND_TIMEOUT_MS)
    client._push.bind(f"ipc://{os.path.join(client._scratch.name, 'nobody-reads')}")
    client._process = SimpleNamespace(is_alive=lambda: False, exitcode=-signal.SIGTERM)

    async def shut_down():
        client._queues["r1"] = asyncio.Queue()
        client.cancel_all("the server is shutting down")
        return client._queues["r1"].get_nowait()

    try:
        with caplog.at_level(logging.INFO, logger="pdserve.server.engine_client"):
            last = asyncio.run(shut_down())
    finally:
        client._push.close()
    assert last.finished and last.failure.message == "the server is shutting down"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert client.health_detail == "engine down, not restarting: engine process stopped by SIGTERM"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_engine_that_fails_to_start_reports_why(tiny_model_dirs):
    """Its one-line reason reaches the front end although the process exits right after
    sending it (it used to be dropped: 'exited with code 1 while starting')."""
    config = EngineConfig(model_path=tiny_model_dirs("llama"), device="cuda")
    client = EngineClient(config, WorkerRole("colocated", build_worker), EngineClientConfig())
    try:
        with pytest.raises(EngineUnavailable) as failed:
            asyncio.run(client.start())
        assert str(failed.value) == (
            "engine failed to start: "
            "RuntimeError: device 'cuda' requested but CUDA is not available"
        )
    finally:
        asyncio.run(client._stop_process())
        client._close_sockets()
        client._sync_context.term()
        client._async_context.term()
        client._scratch.cleanup()
