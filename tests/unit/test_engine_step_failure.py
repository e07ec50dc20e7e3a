"""A step that raises fails the requests of its batch (pages freed), not the engine loop."""

from __future__ import annotations

import pytest
import zmq

from pdserve import LLM, SamplingParams
from pdserve.server.engine_process import MAX_CONSECUTIVE_FAILURES, EngineLoop


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=128).engine


@pytest.fixture
def loop(engine):
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    yield EngineLoop(engine, inbox, outbox)
    inbox.close(0)
    outbox.close(0)
    context.term()


def params(n: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def break_next_steps(monkeypatch, engine, count: int) -> None:
    forward = engine.runner.forward
    left = [count]

    def failing_forward(batch, *args, **kwargs):
        if left[0]:
            left[0] -= 1
            raise RuntimeError("device lost\nsecond line of detail")
        return forward(batch, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing_forward)


def test_a_failed_step_fails_its_requests_and_frees_their_pages(engine, loop, monkeypatch):
    engine.add_request("a", [5, 6, 7], params())
    engine.add_request("b", [8, 9, 10, 11], params())
    loop._step()  # prefill: both requests hold pages now
    assert engine.allocator.num_used > 0
    break_next_steps(monkeypatch, engine, 1)
    outputs = loop._step()
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    for output in outputs:
        assert output.finished and output.error_kind == "internal"
        assert output.error == (
            "the engine failed while running this request: RuntimeError: device lost"
        )
    assert engine.allocator.num_used == 0
    assert not engine.has_unfinished()
    engine.add_request("c", [5, 6, 7], params(3))
    while engine.has_unfinished():
        finished = [o for o in loop._step() if o.finished]
    assert finished[0].error is None and len(finished[0].token_ids) == 3
    assert engine.allocator.num_used == 0


def test_a_request_admitted_in_the_failed_step_is_failed_too(engine, loop, monkeypatch):
    engine.add_request("fresh", [5, 6, 7], params())
    break_next_steps(monkeypatch, engine, 1)
    outputs = loop._step()
    assert [o.request_id for o in outputs] == ["fresh"]
    assert outputs[0].error_kind == "internal"
    assert engine.allocator.num_used == 0 and not engine.requests


def test_consecutive_failures_end_the_loop(engine, loop, monkeypatch):
    break_next_steps(monkeypatch, engine, MAX_CONSECUTIVE_FAILURES)
    for i in range(MAX_CONSECUTIVE_FAILURES - 1):
        engine.add_request(f"x{i}", [5, 6], params())
        assert loop._step()[0].error_kind == "internal"
    engine.add_request("last", [5, 6], params())
    with pytest.raises(RuntimeError, match="device lost"):
        loop._step()
    engine.abort_request("last")
    assert engine.allocator.num_used == 0


def test_a_failed_overlapped_step_fails_the_step_in_flight_too(tiny_model_dirs, monkeypatch):
    """Overlap scheduling: the step that raises had not landed the one before it; both
    steps' requests fail, with no placeholder token left in their outputs."""
    engine = LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=128).engine
    engine.overlap = True
    engine.add_request("a", [5, 6, 7], params())
    engine.add_request("b", [8, 9, 10, 11], params())
    engine.step()  # prefill launched
    engine.step()  # a decode step launched, the first tokens landed
    assert engine.in_flight is not None
    break_next_steps(monkeypatch, engine, 1)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    outputs = engine.fail_step("the engine failed")
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    for output in outputs:
        assert output.finished and output.error_kind == "internal"
        assert output.token_ids and all(t >= 0 for t in output.token_ids)
    assert engine.in_flight is None and not engine.has_unfinished()
    assert engine.allocator.num_used == 0
    engine.add_request("c", [5, 6, 7], params(3))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert len(tokens) == 3
