"""Disaggregated serving on two GPUs with the ipc backend: prefill on cuda:0 writes each room's
KV straight into the pages of decode on cuda:1 (CUDA IPC over NVLink). Greedy outputs equal a
colocated `pdserve serve` on cuda:0, token for token; streams the client drops mid-way and
the rest leave every page free on both workers. Needs two GPUs (nvidia-h200-x2)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import random_prompts
from tests.gpu.test_pd_two_gpus import (
    _generate,
    assert_16_concurrent_equal_colocated,
    colocated_and_disaggregated,
)

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
