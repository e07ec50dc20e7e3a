"""One table decides: a worker's failure reaches the client through the real router app with
the status its kind has in protocol/failures.py's table and the kind as `code`, and the router
tries a new pair exactly when the table says a retry may help. Fake workers; no torch."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pdserve.protocol.failures import OUTCOMES, FailureKind, Outcome
from pdserve.router.app import build_router_app
from pdserve.router.errors import worker_outcome
from tests.unit.fake_workers import FakeWorkers, failed_answer, router_metric

MAX_RETRIES = 2  # NOTE: more than one, so "retried" means every retry, not just the first


@pytest.fixture(scope="module")
def router():
    """Decode fails every request with the kind named by its prompt, streamed if asked."""

    async def decode(body: dict):
        return failed_answer(FailureKind(body["prompt"]), stream=body.get("stream") is True)

    fakes = FakeWorkers(decode=decode)
    config = fakes.config(max_retries=MAX_RETRIES)
    with TestClient(build_router_app(config, fakes.transport)) as client:
        yield fakes, client


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("kind", list(FailureKind))
def test_a_failure_has_its_kinds_status_and_is_retried_only_if_retryable(router, kind, stream):
    fakes, client = router
    outcome = OUTCOMES[kind]
    posts, retries = fakes.posts.count("decode"), router_metric(client, "retries_total")
    body = {"prompt": kind.value, "max_tokens": 2, "stream": stream}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == outcome.status, response.text
    assert response.json()["error"]["code"] == kind.value
    tries = 1 + MAX_RETRIES if outcome.retryable else 1
    assert fakes.posts.count("decode") - posts == tries
    assert router_metric(client, "retries_total") - retries == tries - 1


def test_the_kind_decides_over_the_status_a_worker_answered():
    assert worker_outcome({"code": "internal"}, 503) == OUTCOMES[FailureKind.INTERNAL]
    assert worker_outcome({"code": "timeout", "type": "invalid_request_error"}) == Outcome(
        503, True
    )


@pytest.mark.parametrize(
    ("error", "status", "outcome"),
    [
        ({"code": "internal_error"}, 500, Outcome(500, True)),  # a crash in a worker
        ({"code": "rate_limit_exceeded"}, 429, Outcome(429, False)),
        ({"code": None}, 400, Outcome(400, False)),
        (None, 502, Outcome(502, True)),  # a body that was not OpenAI's error
        ({"type": "invalid_request_error"}, None, Outcome(400, False)),  # an SSE event
        ({"type": "rate_limit_error"}, None, Outcome(429, False)),
        ({"type": "server_error", "code": ["odd"]}, None, Outcome(503, True)),
    ],
)
def test_an_error_without_a_failure_kind_keeps_the_status_rule(error, status, outcome):
    assert worker_outcome(error, status) == outcome
