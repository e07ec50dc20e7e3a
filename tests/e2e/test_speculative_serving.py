"""Speculative decoding through the HTTP servers: `pdserve serve` with the --speculative-*
flags, and a prefill/decode cluster behind the router where the draft KV and seed cross the
transfer (gloo). Outputs equal a plain server's; acceptance shows in the native API's
meta_info and as a histogram on /metrics; bad flags fail with the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.server.local_process import LocalServer
from pdserve.speculative.checkpoints import make_tiny_eagle_draft
from tests.conftest import random_prompts
from tests.e2e.conftest import START_DEADLINE_S, Server
from tests.e2e.pd_cluster import begin_cluster
from tests.e2e.sse import stream_post

ARGS = ("--max-model-len", "256", "--chunked-prefill-size", "16")
MAX_TOKENS = 13  # the first token from the prefill, then 3 verify steps of 4


@pytest.fixture(scope="module")
def servers(tiny_model_dirs, tmp_path_factory):
    model = tiny_model_dirs("llama")
    draft = make_tiny_eagle_draft(
        tmp_path_factory.mktemp("e2e-draft") / "eagle3", model, aux_layer_ids=[0, 1], seed=4
    )
    copy_draft = (
        "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model,
        "--speculative-num-steps", "3",
    )  # fmt: skip
    eagle_tree = (
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
    )  # fmt: skip
    plain = LocalServer(["serve", "--model-path", model, "--device", "cpu", *ARGS])
    spec = LocalServer(["serve", "--model-path", model, "--device", "cpu", *ARGS, *copy_draft])
    pending = begin_cluster(model, backend="gloo", worker_args=(*ARGS, *eagle_tree))
    started = [plain, spec]
    try:
        running = {
            "plain": Server(plain.wait_healthy(START_DEADLINE_S), model),
            "spec": Server(spec.wait_healthy(START_DEADLINE_S), model),
        }
        cluster = pending.ready()
        running["cluster"] = cluster
        yield running
        cluster.stop()
    finally:
        for local in started:
            local.stop()


def generate(server, prompt):
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    response = server.post("/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


PROMPTS = random_prompts((3, 20, 45), 250, seed=31)


def test_colocated_speculation_reports_acceptance(servers):
    for prompt in PROMPTS:
        want = generate(servers["plain"], prompt)
        got = generate(servers["spec"], prompt)
        assert got["output_ids"] == want["output_ids"]
        meta = got["meta_info"]
        # A copy of the target drafts 3 tokens that are all accepted, + 1 bonus: 4 per step.
        assert meta["spec_verify_ct"] == 3 and meta["spec_accept_length"] == 4.0
        assert "spec_verify_ct" not in want["meta_info"]
    assert servers["spec"].metric("spec_accept_length_count") == len(PROMPTS)
    assert servers["spec"].metric("spec_accept_length_sum") == 4.0 * len(PROMPTS)
    info = servers["spec"].get("/server_info").json()
    assert info["speculative_algorithm"] == "STANDALONE"


def test_streams_carry_several_tokens_per_event_and_the_same_text(servers):
    """A verify step emits several tokens at once: streamed chunks join to the plain text,
    with one logprob per token."""
    body = {
        "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 1,
    }  # fmt: skip
    want = servers["plain"].post("/v1/completions", body).json()["choices"][0]
    status, chunks = stream_post(servers["spec"].url + "/v1/completions", {**body, "stream": True})
    assert status == 200
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    assert "".join(c["text"] for c in choices) == want["text"]
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == want["logprobs"]["tokens"]
    assert any(c["logprobs"] and len(c["logprobs"]["tokens"]) > 1 for c in choices)


def test_disaggregated_speculation_through_the_router(servers):
    cluster = servers["cluster"]
    for prompt in PROMPTS:
        want = generate(servers["plain"], prompt)
        got = generate(cluster.router, prompt)
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["spec_verify_ct"] >= 1
    streamed = cluster.router.post(
        "/v1/completions",
        {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True},
    )
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    assert cluster.decode[0].metric("spec_accept_length_count") >= len(PROMPTS)
    cluster.wait_all_free()


def test_bad_speculative_flags_fail_with_the_reason(tiny_model_dirs):
    model = tiny_model_dirs("llama")
    cases = [
        (["--speculative-num-steps", "3"], "without --speculative-algorithm"),
        (["--speculative-algorithm", "EAGLE"], "needs --speculative-draft-model-path"),
        (["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "0"], "eagle-topk"),
    ]
    for flags, message in cases:
        done = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "generate", "--model-path", model,
             "--device", "cpu", *flags, "--prompt", "hello"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert message in done.stderr
    # A server refuses before starting any process.
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--model-path", model,
         "--speculative-algorithm", "NOPE"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "unknown speculative algorithm 'NOPE'" in done.stderr
