"""The front end's one pipeline (`server/pipeline.py`), on a fake worker state: what an `Ask`
becomes, and what it refuses before any prompt is tokenized."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.server.errors import APIError
from pdserve.server.pipeline import Ask, prepare

MAX_MODEL_LEN = 64


def _state(kind: str = "colocated", queued: int = 8):
    client = SimpleNamespace(
        ready=SimpleNamespace(vocab_size=100),
        healthy=True,
        health_detail="running",
        num_in_flight=0,
        stats=SimpleNamespace(num_running=0),
    )
    role = SimpleNamespace(kind=kind, disaggregated=kind != "colocated")
    return SimpleNamespace(
        client=client, max_model_len=MAX_MODEL_LEN, role=role, max_queued_requests=queued
    )


def _run(state, **fields):
    fields.setdefault("tokenize", lambda: [[1, 2, 3, 4, 5]])
    fields.setdefault("sampling", {})
    fields.setdefault("max_new_tokens", None)
    fields.setdefault("id_base", "cmpl-r1")
    return asyncio.run(prepare(state, Ask(**fields)))


def test_without_max_tokens_each_prompt_gets_the_rest_of_the_context():
    prepared = _run(_state(), sampling={"min_new_tokens": 40, "temperature": 0.0})
    [(request_id, prompt, sampling)] = prepared.jobs
    assert (request_id, prompt) == ("cmpl-r1", [1, 2, 3, 4, 5])
    assert sampling["max_new_tokens"] == MAX_MODEL_LEN - 5 and sampling["min_new_tokens"] == 40
    assert prepared.bootstrap is None and not prepared.exact_ids


def test_prompts_and_choices_become_jobs_named_after_the_request():
    prepared = _run(
        _state(), tokenize=lambda: [[1], [2, 3]], sampling={"seed": 7}, max_new_tokens=4, n=2
    )
    assert [job[0] for job in prepared.jobs] == [f"cmpl-r1-{i}" for i in range(4)]
    assert [job[1] for job in prepared.jobs] == [[1], [1], [2, 3], [2, 3]]
    assert [job[2]["seed"] for job in prepared.jobs] == [7, 8, 7, 8]


def test_bad_sampling_is_refused_before_any_prompt_is_tokenized():
    def tokenize():
        raise AssertionError("tokenized a request whose sampling settings were wrong")

    with pytest.raises(APIError, match="temperature") as refused:
        _run(_state(), tokenize=tokenize, sampling={"temperature": -1.0})
    assert refused.value.status == 400


def test_a_prompt_over_the_context_and_a_full_queue_are_refused():
    with pytest.raises(APIError, match="maximum context length is 64") as refused:
        _run(_state(), tokenize=lambda: [[1] * 60], max_new_tokens=10)
    assert refused.value.param == "max_tokens"
    with pytest.raises(APIError, match="waiting queue is full") as refused:
        _run(_state(queued=1), n=2, max_new_tokens=2)
    assert refused.value.status == 429


def test_a_disaggregated_worker_needs_its_bootstrap_fields():
    with pytest.raises(APIError, match="need bootstrap_host"):
        _run(_state("decode"), max_new_tokens=2)
    prepared = _run(_state("decode"), max_new_tokens=2, bootstrap=("10.0.0.1", 8998, 42))
    assert (prepared.bootstrap.host, prepared.bootstrap.port, prepared.bootstrap.room) == (
        "10.0.0.1",
        8998,
        42,
    )
