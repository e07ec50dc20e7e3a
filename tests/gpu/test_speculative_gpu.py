"""Speculative decoding on the GPU: every algorithm, chain and tree, equals the plain engine
token for token (float32, so no kernel difference can flip a near tie); on two GPUs the draft
KV and seed state cross over nccl from prefill (cuda:0) to decode (cuda:1) and the output
still equals a colocated plain server."""

from __future__ import annotations

import httpx
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.protocol.spec_settings import SpecSettings
from pdserve.server.local_process import LocalServer
from tests.conftest import random_prompts
from tests.e2e.conftest import START_DEADLINE_S, Server
from tests.e2e.pd_cluster import begin_cluster

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
SHAPES = {"chain": (4, 1, 5), "tree": (4, 4, 12)}
OPTIONS = {"device": "cuda", "dtype": "float32", "kv_cache_memory": 1 << 28}


@pytest.fixture(scope="module")
def drafts(spec_drafts):
    return spec_drafts


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"])
def test_gpu_speculation_is_exactly_the_target(algorithm, shape, drafts, tiny_model_dirs):
    model = tiny_model_dirs("llama")
    prompts = [*random_prompts((1, 8, 40, 130), 250, seed=40), [9, 8, 7, 6] * 10]
    plain = LLM(model, **OPTIONS).generate(prompts, GREEDY)
    steps, topk, tokens = SHAPES[shape]
    settings = SpecSettings(algorithm, drafts[algorithm], steps, topk, tokens)
    llm = LLM(model, speculative=settings, **OPTIONS)
    spec = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.kv_pages_in_use == 0
    if algorithm == "STANDALONE" and shape == "chain":
        # A copy of the target: every verify step emits num_steps + 1 tokens (the last may
        # be cut by max_new_tokens).
        assert all(o.spec_verify_ct == -(-31 // 5) for o in spec)


def test_two_gpus_carry_draft_state_over_nccl(drafts, tiny_model_dirs):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    model = tiny_model_dirs("llama")
    engine = ("--dtype", "float32", "--kv-cache-memory", str(1 << 28), "--max-model-len", "512")
    spec = (
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafts["EAGLE3"],
        "--speculative-num-steps", "4", "--speculative-eagle-topk", "4",
        "--speculative-num-draft-tokens", "12",
    )  # fmt: skip
    colocated = LocalServer(["serve", "--model-path", model, "--device", "cuda:0", *engine])
    pending = begin_cluster(
        model,
        backend="nccl",
        worker_args=(*engine, *spec),
        prefill_args=("--device", "cuda:0"),
        decode_args=("--device", "cuda:1"),
    )
    cluster = None
    try:
        reference = Server(colocated.wait_healthy(START_DEADLINE_S), model)
        cluster = pending.ready()
        for prompt in random_prompts((3, 50, 300), 250, seed=41):
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
            }
            want = httpx.post(reference.url + "/generate", json=body, timeout=120).json()
            got = httpx.post(cluster.router.url + "/generate", json=body, timeout=120).json()
            assert got["output_ids"] == want["output_ids"]
            assert got["meta_info"]["spec_verify_ct"] >= 1
        cluster.wait_all_free()
    finally:
        if cluster is not None:
            cluster.stop()
        colocated.stop()
