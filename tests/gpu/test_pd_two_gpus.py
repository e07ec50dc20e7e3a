"""Disaggregated serving on two GPUs with the nccl backend: prefill on cuda:0, decode on
cuda:1, a router in front. Greedy outputs equal a colocated `pdserve serve` on cuda:0, token
for token; seeded sampling with logprobs, n > 1 and a prompt list (the router's fan-out) equal
it field for field; every page is free afterwards. A TP 2 worker (both GPUs) pairs with a TP 1
worker either way round. Needs two GPUs (nvidia-h200-x2)."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pdserve.server.local_process import LocalServer
from tests.conftest import random_prompts
from tests.e2e.answers import assert_same, normalized, openai_stream
from tests.e2e.conftest import START_DEADLINE_S, Server
from tests.e2e.pd_cluster import begin_cluster
from tests.e2e.sse import stream_post

pytestmark = pytest.mark.gpu

LENGTHS = (1, 2, 9, 16, 17, 40, 64, 100, 150, 200, 257, 300, 400, 500, 700, 900)
# float32 so that batching differences cannot flip a near-tie; chunks of 128 tokens.
ENGINE = (
    "--dtype",
    "float32",
    "--kv-cache-memory",
    str(1 << 30),
    "--chunked-prefill-size",
    "128",
    "--max-model-len",
    "1024",
)
MAX_TOKENS = 24


@contextlib.contextmanager
def colocated_and_disaggregated(model: str, backend: str):
    """(reference, cluster): a colocated `pdserve serve` on cuda:0, and prefill on cuda:0 +
    decode on cuda:1 with this transfer backend behind a router; both stopped after."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    colocated = LocalServer(["serve", "--model-path", model, "--device", "cuda:0", *ENGINE])
    pending = begin_cluster(
        model,
        backend=backend,
        worker_args=ENGINE,
        prefill_args=("--device", "cuda:0"),
        decode_args=("--device", "cuda:1"),
    )
    cluster = None
    try:
        reference = Server(colocated.wait_healthy(START_DEADLINE_S), model)
        cluster = pending.ready()
        yield reference, cluster
    finally:
        if cluster is not None:
            cluster.stop()
        colocated.stop()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def two_gpus(request, tiny_model_dirs):
    with colocated_and_disaggregated(tiny_model_dirs(request.param), "nccl") as pair:
        yield pair


def _generate(base_url: str, prompt: list[int], stream: bool) -> list[int]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    if stream:
        status, events = stream_post(base_url + "/generate", {**body, "stream": True}, 120)
        assert status == 200 and "error" not in events[-1], events[-1]
        return events[-1]["output_ids"]
    response = httpx.post(base_url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def test_workers_run_where_asked(two_gpus):
    _, cluster = two_gpus
    prefill_info = cluster.prefill[0].get("/server_info").json()
    decode_info = cluster.decode[0].get("/server_info").json()
    assert (prefill_info["device"], decode_info["device"]) == ("cuda:0", "cuda:1")
    assert prefill_info["disaggregation_transfer_backend"] == "nccl"
    assert decode_info["disaggregation_mode"] == "decode"


def test_nccl_handoff_equals_colocated_one_at_a_time(two_gpus):
    reference, cluster = two_gpus
    for i, prompt in enumerate(random_prompts(LENGTHS[:6], 250, seed=3)):
        expected = _generate(reference.url, prompt, stream=False)
        assert _generate(cluster.router.url, prompt, stream=i % 2 == 1) == expected
    cluster.wait_all_free()


def test_nccl_handoff_equals_colocated_16_concurrent(two_gpus):
    assert_16_concurrent_equal_colocated(*two_gpus)


def assert_16_concurrent_equal_colocated(reference, cluster) -> None:
    """16 prompts of every length at once, half streamed, equal colocated token for token;
    afterwards every page is free and each room went through the transfer."""
    prompts = random_prompts(LENGTHS, 250, seed=4)
    with ThreadPoolExecutor(len(prompts)) as pool:
        expected = list(pool.map(lambda p: _generate(reference.url, p, False), prompts))
        jobs = [(p, i % 2 == 1) for i, p in enumerate(prompts)]
        got = list(pool.map(lambda job: _generate(cluster.router.url, *job), jobs))
    assert got == expected
    assert all(len(ids) == MAX_TOKENS for ids in got)
    cluster.wait_all_free()
    assert cluster.decode[0].metric("kv_transfers_total") >= len(prompts)


# NOTE: fp32 on two GPUs: matmuls of other batch shapes round differently, by about 1e-6.
GPU_TOLERANCE = 1e-4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_seeded_fanout_with_logprobs_equals_colocated(two_gpus, stream):
    reference, cluster = two_gpus
    body = {
        "prompt": random_prompts((5, 140), 250, seed=6),
        "n": 3,
        "max_tokens": 12,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 17,
        "logprobs": 3,
        "ignore_eos": True,
    }
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        answers = []
        for server in (reference, cluster.router):
            status, events = stream_post(server.url + "/v1/completions", body, 120)
            assert status == 200 and "error" not in events[-1], events[-1]
            answers.append(openai_stream(events))
    else:
        answers = []
        for server in (reference, cluster.router):
            response = server.post("/v1/completions", body)
            assert response.status_code == 200, response.text
            answers.append(normalized(response.json()))
    want, got = answers
    assert_same(got, want, tolerance=GPU_TOLERANCE)
    cluster.wait_all_free()


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"),
    [(2, 1), (1, 2), (2, 2)],
    ids=["prefill-tp2", "decode-tp2", "both-tp2"],
)
def test_nccl_handoff_across_tp_sizes_equals_colocated(prefill_tp, decode_tp, tiny_model_dirs):
    """A TP 2 worker and a TP 1 or TP 2 worker on GPUs of their own, either way round: each
    prefill rank sends its KV heads to the decode ranks that hold them over NCCL links of
    their own (two processes on one GPU cannot share an NCCL group, so the workers need
    `prefill_tp + decode_tp` GPUs: run on nvidia-h100-x4)."""
    if torch.cuda.device_count() < prefill_tp + decode_tp:
        pytest.skip(f"needs {prefill_tp + decode_tp} GPUs (run on nvidia-h100-x4)")
    model = tiny_model_dirs("qwen3")

    def placement(first: int, size: int) -> tuple[str, ...]:
        return ("--device", f"cuda:{first}", "--tp-size", str(size))

    colocated = LocalServer(["serve", "--model-path", model, "--device", "cuda:0", *ENGINE])
    pending = begin_cluster(
        model,
        backend="nccl",
        worker_args=ENGINE,
        prefill_args=placement(0, prefill_tp),
        decode_args=placement(prefill_tp, decode_tp),
    )
    cluster = None
    try:
        reference = Server(colocated.wait_healthy(START_DEADLINE_S), model)
        cluster = pending.ready()
        prompts = random_prompts(LENGTHS, 250, seed=6)
        with ThreadPoolExecutor(8) as pool:
            expected = list(pool.map(lambda p: _generate(reference.url, p, False), prompts))
            got = list(pool.map(lambda p: _generate(cluster.router.url, p, False), prompts))
        assert got == expected
        cluster.wait_all_free()
    finally:
        if cluster is not None:
            cluster.stop()
        colocated.stop()
