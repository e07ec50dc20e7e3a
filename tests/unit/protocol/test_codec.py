"""The wire codec refuses malformed, oversize, unknown and mistyped messages."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.protocol.codec import PROTOCOL_VERSION, ProtocolError, decode, encode
from pdserve.protocol.engine_messages import (
    AbortRequest,
    EngineStats,
    FinishReason,
    GenerateRequest,
    StepOutputs,
    TokenOutput,
)
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.protocol.rank_messages import RankForward, flatten, split


def raw(tag, body, version=PROTOCOL_VERSION):
    return msgpack.packb({"t": tag, "v": version, "b": body})


def output_body(**fields):
    """A token output's body on the wire, with `fields` replaced."""
    body = {
        "request_id": "r",
        "new_token_ids": [1],
        "finished": False,
        "num_prompt_tokens": 1,
        "num_output_tokens": 1,
    }
    return body | fields


def test_logprobs_keep_their_numbers_and_an_integer_logprob_becomes_a_float():
    body = output_body(new_logprobs=[-0.5, 0], new_top_logprobs=[[[3, -0.5], [4, 0]]])
    output = decode(raw("token_output", body))
    assert output.new_logprobs == [-0.5, 0.0] and type(output.new_logprobs[1]) is float
    assert output.new_top_logprobs == [[[3, -0.5], [4, 0]]]


def test_round_trip_with_nested_messages():
    msg = StepOutputs(
        [
            TokenOutput(
                "r",
                [1, 2],
                True,
                3,
                2,
                finish_reason="stop",
                stop_reason="x",
                new_logprobs=[-0.1, -0.2],
                new_top_logprobs=[[[1, -0.1]], [[2, -0.2]]],
            )
        ],
        EngineStats(1, 0, 5, 10),
    )
    assert decode(encode(msg)) == msg


def test_expected_type_is_enforced():
    with pytest.raises(ProtocolError, match="unexpected message type"):
        decode(encode(AbortRequest("r")), GenerateRequest)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xc1garbage", "undecodable"),
        (msgpack.packb([1, 2, 3]), "exactly the keys"),
        (
            raw("generate", {"request_id": "r", "prompt_token_ids": [1], "sampling": {}}, 99),
            "protocol version",
        ),
        (raw("no_such_type", {}), "unknown message type"),
        (raw("abort", {}), "missing field"),
        (raw("abort", {"request_id": "r", "extra": 1}), "unknown fields"),
        (raw("abort", {"request_id": 5}), "expected str"),
        (
            raw("generate", {"request_id": "r", "prompt_token_ids": [1, "x"], "sampling": {}}),
            "expected an integer",
        ),
        (
            raw("generate", {"request_id": "r", "prompt_token_ids": [True], "sampling": {}}),
            "expected an integer",
        ),
        (
            raw(
                "token_output",
                {
                    "request_id": "r",
                    "new_token_ids": [1],
                    "new_text": "text is made by the front end",
                    "finished": False,
                    "num_prompt_tokens": 1,
                    "num_output_tokens": 1,
                },
            ),
            "unknown fields",
        ),
        (raw("rank_stop", {"reason": ["a"]}), "expected str"),
        (raw("token_output", output_body(new_logprobs=[-0.5, "x"])), "expected a number"),
        (raw("token_output", output_body(new_top_logprobs=[[[3, True]]])), "does not match"),
        (raw("token_output", output_body(new_top_logprobs=[[[3, None]]])), "does not match"),
        (
            raw("rank_move_kv", {"src": [1, "x"], "dst": []}),
            "expected an integer",
        ),
        (
            raw(
                "engine_stats",
                {"num_running": 1.5, "num_waiting": 0, "kv_pages_used": 0, "kv_pages_total": 1},
            ),
            "expected an integer",
        ),
    ],
)
def test_malformed_messages_are_refused(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_oversize_array_is_refused_before_allocation(monkeypatch):
    import pdserve.protocol.codec as codec

    monkeypatch.setattr(codec, "MAX_ITEMS", 8)
    data = raw("generate", {"request_id": "r", "prompt_token_ids": list(range(9)), "sampling": {}})
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(data)


def test_oversize_message_is_refused(monkeypatch):
    import pdserve.protocol.codec as codec

    monkeypatch.setattr(codec, "MAX_MESSAGE_BYTES", 16)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(encode(GenerateRequest("r", list(range(100)), {})))


def test_protocol_package_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, pdserve.protocol.codec, pdserve.protocol.engine_messages; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_lists_of_strings_are_checked_item_by_item_when_one_is_not_a_string():
    ok = RankForward(
        request_ids=["a", "b"],
        pages_kept=[0, 0],
        new_pages=[4],
        new_page_counts=[0, 1],
        num_computed=[1, 2],
        token_ids=[7, 8],
        token_counts=[1, 1],
        positions=[],
        position_counts=[0, 0],
        masks=[],
        capture_kind="",
        capture_layers=[],
        graphs="decode",
        device_tokens_shape=[],
        device_tokens_dtype="",
        ended=["c"],
    )
    body = dict(vars(ok), request_ids=["a", 7])
    with pytest.raises(ProtocolError, match=r"request_ids\[\]: expected str"):
        decode(raw("rank_forward", body))
    assert decode(encode(ok)) == ok


def test_rank_forward_lists_travel_flat_and_split_back_or_name_the_mismatch():
    lists = [[3, 4], [], [5]]
    assert flatten(lists) == ([3, 4, 5], [2, 0, 1])
    assert split(*flatten(lists), "pages") == lists
    with pytest.raises(ValueError, match="pages: counts 4 do not match 3 values"):
        split([3, 4, 5], [2, 0, 2], "pages")
    with pytest.raises(ValueError, match="tokens"):
        split([1], [2, -1], "tokens")


def test_only_a_messages_fields_go_on_the_wire():
    output = TokenOutput("r", [1, 2], False, 3, 2)
    object.__setattr__(output, "note", "not a field")  # NOTE: frozen: set around it
    body = msgpack.unpackb(encode(StepOutputs([output], EngineStats(1, 0, 1, 8))))["b"]
    assert "note" not in body["outputs"][0]
    assert decode(encode(StepOutputs([output], EngineStats(1, 0, 1, 8)))).outputs[0] == output


def test_a_finish_reason_crosses_typed_and_an_unknown_one_is_refused():
    output = TokenOutput("r", [5], True, 3, 1, finish_reason=FinishReason.LENGTH)
    decoded = decode(encode(output))
    assert type(decoded.finish_reason) is FinishReason
    assert decoded.finish_reason is FinishReason.LENGTH
    body = {"request_id": "r", "new_token_ids": [5], "finished": True}
    body |= {"num_prompt_tokens": 3, "num_output_tokens": 1, "finish_reason": "tired"}
    raw = msgpack.packb({"t": "token_output", "v": PROTOCOL_VERSION, "b": body})
    with pytest.raises(ProtocolError, match=r"'tired' is not one of 'stop', 'length', 'abort'"):
        decode(raw)


def test_a_failed_output_says_why_and_counts_its_prompt():
    failure = Failure(FailureKind.UNAVAILABLE, FailureStage.ENGINE, "engine restarting")
    output = decode(encode(TokenOutput.failed("r", failure, num_prompt_tokens=7)))
    assert (output.finished, output.finish_reason, output.failure) == (True, "abort", failure)
    assert (output.new_token_ids, output.num_prompt_tokens, output.num_output_tokens) == ([], 7, 0)
