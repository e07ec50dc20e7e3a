"""A request's stream from the engine (`EngineClient.generate`): one output per engine step
while the stream keeps up; what piled up while it fell behind comes as one output, every
token and logprob in order, the tokens before a failure still ahead of it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.protocol.engine_messages import TokenOutput
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.server.engine_client import EngineClientConfig
from tests.unit.server.test_engine_client_restarts import make_client  # noqa: F401 (a fixture)


def step(tokens: list[int], done: int, finished: bool = False, **kw) -> TokenOutput:
    return TokenOutput(
        "r",
        tokens,
        finished,
        4,
        done,
        finish_reason="length" if finished else None,
        new_logprobs=[-0.5 * t for t in tokens],
        new_top_logprobs=[[[t, -0.5 * t]] for t in tokens],
        **kw,
    )


def stream_of(client):
    """The request's stream, and its queue once the request went out."""
    client._process = SimpleNamespace(is_alive=lambda: True, exitcode=None)
    client._send = lambda msg: None
    return client.generate("r", [1, 2, 3, 4], {})


def test_a_stream_that_keeps_up_gets_every_step_and_one_that_fell_behind_gets_them_joined(
    make_client,  # noqa: F811
):
    client = make_client(EngineClientConfig())

    async def go():
        stream = stream_of(client)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        queue = client._queues["r"]
        queue.put_nowait(step([10], 1))
        assert await first == step([10], 1)
        for output in (step([11, 12], 3), step([13], 4), step([14], 5, finished=True)):
            queue.put_nowait(output)
        assert await anext(stream) == step([11, 12, 13, 14], 5, finished=True)
        with pytest.raises(StopAsyncIteration):  # NOTE: finished: the stream ends with it
            await anext(stream)
        assert "r" not in client._queues

    asyncio.run(go())


def test_the_tokens_before_a_failure_go_out_before_it(make_client):  # noqa: F811
    client = make_client(EngineClientConfig())
    failure = Failure(FailureKind.UNAVAILABLE, FailureStage.ENGINE, "engine died")

    async def go():
        stream = stream_of(client)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        queue = client._queues["r"]
        failed = TokenOutput("r", [], True, 4, 0, finish_reason="abort", failure=failure)
        for output in (step([10], 1), step([11], 2), failed):
            queue.put_nowait(output)
        assert await first == step([10, 11], 2)
        assert await anext(stream) == failed

    asyncio.run(go())


def test_joining_keeps_the_later_state_and_logprobs_only_where_asked():
    joined = step([1], 1, spec_verify_ct=1).followed_by(step([2, 3], 3, spec_verify_ct=2))
    assert joined == step([1, 2, 3], 3, spec_verify_ct=2)
    plain = TokenOutput("r", [1], False, 4, 1)
    assert plain.followed_by(TokenOutput("r", [2], True, 4, 2)).new_logprobs is None
    assert plain.followed_by(TokenOutput("r", [2], True, 4, 2)).new_token_ids == [1, 2]
