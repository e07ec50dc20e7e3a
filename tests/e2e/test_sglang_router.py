"""SGLang's own router (`pip install sglang-router`) drives pdserve prefill and decode workers
unchanged. Skipped where sglang-router is not installed (it is not a pdserve dependency);
`PDSERVE_SGLANG_ROUTER_PYTHON` may name another interpreter that has it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import httpx
import pytest

from pdserve.server.local_process import free_port
from tests.e2e.pd_cluster import start_cluster
from tests.e2e.sse import stream_post
from tests.waiting import wait_until

PYTHON = os.environ.get("PDSERVE_SGLANG_ROUTER_PYTHON", sys.executable)


def _has_sglang_router() -> bool:
    if sys.executable != PYTHON:
        return os.path.exists(PYTHON)
    return importlib.util.find_spec("sglang_router") is not None


pytestmark = pytest.mark.skipif(not _has_sglang_router(), reason="sglang-router not installed")


@pytest.fixture(scope="module")
def sglang_routed(tiny_model_dirs):
    cluster = start_cluster(tiny_model_dirs("llama"))
    port = free_port()
    command = [PYTHON, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    command += ["--prefill", cluster.prefill[0].url, str(cluster.bootstrap_ports[0])]
    command += ["--decode", cluster.decode[0].url, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    router = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, "sglang-router to start", deadline_s=60, poll_s=0.2)
        yield url, cluster
    finally:
        router.terminate()
        router.wait(timeout=30)
        cluster.stop()


def test_sglang_router_generates_what_our_router_does(sglang_routed):
    url, cluster = sglang_routed
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    ours = cluster.router.post("/generate", body).json()["output_ids"]
    theirs = httpx.post(url + "/generate", json=body, timeout=60).json()["output_ids"]
    assert theirs == ours and len(ours) == 8
    status, events = stream_post(url + "/generate", {**body, "stream": True})
    assert status == 200 and events[-1]["output_ids"] == ours
    chat = {
        "model": cluster.model_path,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    response = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 200, response.text
    assert (
        response.json()["choices"][0]["message"]["content"]
        == (
            cluster.router.post("/v1/chat/completions", chat).json()["choices"][0]["message"][
                "content"
            ]
        )
    )
    cluster.wait_all_free()
