"""Typed failures: every kind has an outcome, and a failure crosses the wire as a checked
enum (an unknown kind or stage is refused, not passed on as text)."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.protocol.codec import PROTOCOL_VERSION, ProtocolError, decode, encode
from pdserve.protocol.engine_messages import TokenOutput
from pdserve.protocol.failures import (
    OUTCOMES,
    Failure,
    FailureKind,
    FailureStage,
    outcome_of_code,
)


def raw_failure(**body):
    return msgpack.packb({"t": "failure", "v": PROTOCOL_VERSION, "b": body})


def test_every_kind_has_an_outcome_and_only_client_faults_are_4xx():
    assert set(OUTCOMES) == set(FailureKind)
    for kind, outcome in OUTCOMES.items():
        assert (outcome.status < 500) == (kind is FailureKind.INVALID)
        assert not (outcome.retryable and outcome.status < 500)


# What each failure kind answers, written out: status and "retry on a new pair" are the HTTP
# API's (clients and the router act on them), so a change must be made here on purpose.
GOLDEN_OUTCOMES = {
    "invalid": (400, False),
    "no_pages": (503, True),
    "timeout": (503, True),
    "peer_lost": (503, True),
    "handshake": (503, True),
    "aborted": (503, True),
    "transfer": (503, True),
    "unavailable": (503, True),
    "internal": (500, False),
}


def test_every_kinds_outcome_is_the_golden_one():
    outcomes = {kind.value: (o.status, o.retryable) for kind, o in OUTCOMES.items()}
    assert outcomes == GOLDEN_OUTCOMES


def test_a_failure_round_trips_with_its_types():
    failure = Failure(FailureKind.PEER_LOST, FailureStage.TRANSFER, "prefill silent for 4.1 s")
    decoded = decode(encode(failure))
    assert decoded == failure
    assert type(decoded.kind) is FailureKind and type(decoded.stage) is FailureStage
    assert decoded.label == "transfer/peer_lost"
    assert decoded.status == 503 and OUTCOMES[decoded.kind].retryable


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"kind": "exploded", "stage": "engine", "message": "m"}, "not one of"),
        ({"kind": "timeout", "stage": "later", "message": "m"}, "not one of"),
        ({"kind": 3, "stage": "engine", "message": "m"}, "is not a FailureKind"),
        ({"kind": True, "stage": "engine", "message": "m"}, "is not a FailureKind"),
    ],
)
def test_an_unknown_kind_or_stage_is_refused(body, match):
    with pytest.raises(ProtocolError, match=match):
        decode(raw_failure(**body))


def test_outcome_of_code_knows_only_failure_kinds():
    assert outcome_of_code("invalid") == OUTCOMES[FailureKind.INVALID]
    assert outcome_of_code("rate_limited") is None
    assert outcome_of_code(None) is None


def test_an_engine_output_carries_its_failure_typed():
    failure = Failure(FailureKind.NO_PAGES, FailureStage.BOOTSTRAP, "no KV pages free for 5 s")
    output = decode(encode(TokenOutput("r", [], True, 3, 0, "abort", failure=failure)))
    assert output.failure == failure and type(output.failure.kind) is FailureKind
    assert output.error == failure.message
    body = {"request_id": "r", "new_token_ids": [], "finished": True, "num_prompt_tokens": 3}
    body |= {"num_output_tokens": 0, "failure": {"kind": "gone", "stage": "engine", "message": ""}}
    with pytest.raises(ProtocolError, match="not one of"):
        decode(msgpack.packb({"t": "token_output", "v": PROTOCOL_VERSION, "b": body}))
