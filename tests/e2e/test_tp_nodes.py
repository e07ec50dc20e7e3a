"""A tensor-parallel worker that spans two "nodes" on loopback (CPU, gloo): node 0 serves HTTP
with rank 0, node 1 (`pdserve serve --node-rank 1`) runs rank 1 with rank 0's settings. It
answers as a TP 1 engine does, token for token; stopping node 0 ends node 1."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.core.config import EngineConfig
from pdserve.server.local_process import LocalServer, free_port
from tests.conftest import random_prompts
from tests.e2e.conftest import START_DEADLINE_S

ENGINE = ("--device", "cpu", "--page-size", "4", "--chunked-prefill-size", "16")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nnodes": 2, "tp_size": 2}, "needs --dist-init-addr HOST:PORT"),
        ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, "does not split evenly"),
        ({"nnodes": 2, "node_rank": 2, "tp_size": 2}, r"--node-rank must be in \[0, --nnodes=2\)"),
    ],
)
def test_node_flags_that_cannot_work_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path="m", **fields)


def test_a_worker_over_two_nodes_equals_tp1_and_ends_with_node0(tiny_model_dirs):
    model = tiny_model_dirs("llama")
    prompts = random_prompts([3, 18, 40], 500, seed=4)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with LLM(model, device="cpu", page_size=4, chunked_prefill_size=16) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, greedy)]
    nodes = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
    serve = [sys.executable, "-m", "pdserve.cli", "serve", "--model-path", model, *ENGINE]
    node1 = subprocess.Popen([*serve, *nodes, "--node-rank", "1"])
    node0 = LocalServer(["serve", "--model-path", model, *ENGINE, *nodes, "--node-rank", "0"])
    try:
        node0.wait_healthy(START_DEADLINE_S)
        for prompt, want in zip(prompts, expected, strict=True):
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            }
            response = httpx.post(node0.url + "/generate", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["output_ids"] == want
    finally:
        node0.stop()
        try:
            assert node1.wait(timeout=30) == 0
        finally:
            node1.kill()
