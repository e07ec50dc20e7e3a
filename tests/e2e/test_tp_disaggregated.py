"""Tensor-parallel prefill and decode workers of different sizes behind the router (real
processes on loopback, gloo between each worker's ranks and for the KV): a prefill worker at
TP 2 hands its KV to a decode worker at TP 1, each prefill rank its own KV heads over its own
link, and the answer is colocated TP 1's, token for token. A prefill rank killed
mid-prefill (the worker held there: engine_process/hold_point.py) fails the request within
the deadline, every page is freed on both workers, and the prefill worker's restarted
engine (ranks and all) serves again."""

from __future__ import annotations

import os
import signal

import httpx

from pdserve import LLM, SamplingParams
from tests.e2e.conftest import rank_pids
from tests.e2e.pd_cluster import FAST_FAILURE, PrefillHold, start_cluster
from tests.e2e.test_pd_failures import (
    DEADLINE_S,
    HELD_PREFILL,
    _generate_body,
    long_request_while_prefilling,
)
from tests.waiting import wait_until

RESTART_DEADLINE_S = 120.0
PROMPTS = ([5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23])


def generated(cluster, prompt) -> list[int]:
    response = httpx.post(cluster.router.url + "/generate", json=_generate_body(prompt), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def test_prefill_tp2_to_decode_tp1_and_a_dead_prefill_rank(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs("llama")
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with LLM(model, device="cpu") as llm:
        expected = [o.token_ids for o in llm.generate(list(PROMPTS), greedy)]
    hold = PrefillHold(tmp_path)
    cluster = start_cluster(
        model,
        backend="gloo",
        worker_args=FAST_FAILURE,
        prefill_args=("--tp-size", "2", *HELD_PREFILL),
        prefill_env=hold.env,
        router_args=("--request-timeout", "60"),
    )
    prefill = cluster.prefill[0]
    try:
        assert [generated(cluster, p) for p in PROMPTS] == expected
        hold.arm()
        join = long_request_while_prefilling(cluster, hold)
        (rank,) = rank_pids(prefill.process.pid)
        os.kill(rank, signal.SIGKILL)
        hold.release()  # NOTE: rank 0 steps on, and its next collective finds rank 1 gone
        response, seconds = join()
        assert response.status_code in (502, 503), response.text
        assert seconds < DEADLINE_S
        cluster.wait_all_free(deadline_s=RESTART_DEADLINE_S)  # decode's pages, prefill's
        wait_until(
            lambda: prefill.get("/health").status_code == 200, "the restart", RESTART_DEADLINE_S
        )
        assert rank_pids(prefill.process.pid) not in ([], [rank])  # a new rank 1
        wait_until(
            lambda: all(
                w["healthy"]
                for pool in httpx.get(cluster.router.url + "/workers", timeout=10).json().values()
                for w in pool
            ),
            "the router to use prefill again",
            20,
        )
        assert [generated(cluster, p) for p in PROMPTS] == expected
        cluster.wait_all_free()
    finally:
        cluster.stop()
