"""Disaggregated serving through the router equals colocated `pdserve serve`, token for token
(greedy), for the four tiny architectures and three transfer backends (gloo stands in for
nccl on CPU; ipc writes into decode's pools in shared memory, as it does over CUDA IPC):
prompts from 1 token to several chunked-prefill chunks, 16 requests at once, streaming and
not, native and OpenAI APIs. Afterwards every page is free on every worker."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.server.local_process import LocalServer
from tests.conftest import ARCHS, random_prompts
from tests.e2e.conftest import START_DEADLINE_S, Server
from tests.e2e.pd_cluster import begin_cluster
from tests.e2e.sse import stream_post

CHUNK = 16
# 1 token up to five chunked-prefill chunks; 16 requests in all.
LENGTHS = (1, 2, 5, 9, 15, 16, 17, 23, 31, 32, 33, 47, 50, 64, 71, 80)
WORKER_ARGS = ("--chunked-prefill-size", str(CHUNK), "--max-model-len", "256")
MAX_TOKENS = 10
BACKENDS = ("tcp", "gloo", "ipc")
PROMPT_VOCAB = 250  # prompt token ids in [3, 250): inside every tiny model's vocabulary


@pytest.fixture(scope="module", params=ARCHS)
def deployments(request, tiny_model_dirs):
    """A colocated server and one cluster per backend, for one architecture."""
    model = tiny_model_dirs(request.param)
    colocated = LocalServer(["serve", "--model-path", model, "--device", "cpu", *WORKER_ARGS])
    pending = {b: begin_cluster(model, backend=b, worker_args=WORKER_ARGS) for b in BACKENDS}
    clusters = {}
    try:
        reference = Server(colocated.wait_healthy(START_DEADLINE_S), model)
        for backend, cluster in pending.items():
            clusters[backend] = cluster.ready()
        yield reference, clusters
    finally:
        for cluster in clusters.values():
            cluster.stop()
        colocated.stop()


def _jobs(vocab_size: int) -> list[tuple[str, dict, bool]]:
    """(path, body, stream) per prompt: a mix of native/OpenAI and streamed/not."""
    jobs = []
    for i, prompt in enumerate(random_prompts(LENGTHS, vocab_size, seed=21)):
        stream = i % 2 == 1
        if i % 4 < 2:
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
            }
            jobs.append(("/generate", {**body, "stream": stream}, stream))
        else:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            jobs.append(("/v1/completions", {**body, "stream": stream}, stream))
    return jobs


def _result(base_url: str, job) -> tuple:
    """What to compare: output ids (native) or text (OpenAI), and the finish reason."""
    path, body, stream = job
    if not stream:
        response = httpx.post(base_url + path, json=body, timeout=120)
        assert response.status_code == 200, response.text
        data = response.json()
        if path == "/generate":
            return data["output_ids"], data["meta_info"]["finish_reason"]["type"]
        return data["choices"][0]["text"], data["choices"][0]["finish_reason"]
    status, events = stream_post(base_url + path, body, timeout=120)
    assert status == 200 and events and "error" not in events[-1], events[-1:]
    if path == "/generate":
        return events[-1]["output_ids"], events[-1]["meta_info"]["finish_reason"]["type"]
    text = "".join(e["choices"][0]["text"] for e in events)
    return text, events[-1]["choices"][0]["finish_reason"]


def _run_all(base_url: str, jobs) -> list:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: _result(base_url, job), jobs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_equals_colocated_for_16_concurrent_requests(deployments, backend):
    reference, clusters = deployments
    cluster = clusters[backend]
    jobs = _jobs(PROMPT_VOCAB)
    expected = _run_all(reference.url, jobs)
    got = _run_all(cluster.router.url, jobs)
    assert all(output for output, _ in expected)  # something was generated to compare
    assert got == expected
    cluster.wait_all_free()
    transferred = cluster.decode[0].metric("kv_transfers_total")
    assert transferred >= len(jobs)
