"""Disaggregated serving on two GPUs with the ipc backend: prefill on cuda:0 writes each room's
KV straight into the pages of decode on cuda:1 (CUDA IPC over NVLink). Greedy outputs equal a
colocated `pdserve serve` on cuda:0, token for token; streams the client drops mid-way and
the rest leave every page free on both workers; a decode worker that dies while prefill
writes into its pages leaves prefill healthy. Needs two GPUs (nvidia-h200-x2)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.conftest import random_prompts
from tests.e2e.conftest import engine_pid
from tests.e2e.pd_cluster import FAST_FAILURE, start_cluster
from tests.gpu.test_pd_two_gpus import (
    ENGINE,
    _generate,
    assert_16_concurrent_equal_colocated,
    colocated_and_disaggregated,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ipc_pair(tiny_model_dirs):
    with colocated_and_disaggregated(tiny_model_dirs("llama"), "ipc") as pair:
        yield pair


def test_ipc_handoff_equals_colocated_16_concurrent(ipc_pair):
    reference, cluster = ipc_pair
    info = cluster.prefill[0].get("/server_info").json()
    assert (info["device"], info["disaggregation_transfer_backend"]) == ("cuda:0", "ipc")
    assert_16_concurrent_equal_colocated(reference, cluster)


def _drop_after_first_event(base_url: str, prompt: list[int]) -> None:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                return  # the client leaves


def test_dropped_streams_free_every_page_on_both_gpus(ipc_pair):
    reference, cluster = ipc_pair
    prompts = random_prompts((900, 700, 500, 300, 100, 17, 900, 650), 250, seed=5)
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: _drop_after_first_event(cluster.router.url, p), prompts))
    cluster.wait_all_free()
    prompt = random_prompts((64,), 250, seed=6)[0]  # and it still serves exactly
    assert _generate(cluster.router.url, prompt, False) == _generate(reference.url, prompt, False)


def test_decode_killed_while_prefill_writes_into_its_pages(tiny_model_dirs):
    """Prefill on cuda:0 streams a long prompt's KV into decode's pages on cuda:1, one piece
    per 4-token chunk, and decode dies in the middle: the client gets an error within the
    deadline, and the prefill worker stays healthy (no CUDA error from a write into memory of
    a process gone) with every page free."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    streamed = ("--transfer-piece-bytes", "1", *FAST_FAILURE)
    cluster = start_cluster(
        tiny_model_dirs("llama"),
        backend="ipc",
        worker_args=(*ENGINE, *streamed),
        prefill_args=("--device", "cuda:0", "--chunked-prefill-size", "4"),
        decode_args=("--device", "cuda:1"),
        router_args=("--request-timeout", "60"),
    )
    try:
        prefill, decode = cluster.prefill[0], cluster.decode[0]
        body = {"input_ids": [7] * 900, "sampling_params": {"max_new_tokens": 8}}
        url = cluster.router.url + "/generate"
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(lambda: httpx.post(url, json=body, timeout=90))
            # NOTE: 225 chunks, each written into decode's pages as it is computed.
            wait_until(
                lambda: cluster.state(prefill)["num_prefilling"] == 1,
                "the prefill to start",
                describe=cluster.states,
            )
            engine = engine_pid(prefill)
            os.killpg(decode.process.pid, signal.SIGKILL)
            decode.process.wait(timeout=10)
            started = time.monotonic()
            response = answer.result(timeout=60)
        assert response.status_code in (502, 503), response.text
        assert "decode" in response.json()["error"]["message"]
        assert time.monotonic() - started < 30
        assert prefill.get("/health").status_code == 200
        cluster.wait_all_free()
        assert engine_pid(prefill) == engine  # NOTE: not restarted after a CUDA error
    finally:
        cluster.stop()
