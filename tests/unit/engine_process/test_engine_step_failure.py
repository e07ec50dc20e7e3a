"""A step that raises fails the requests of its batch (pages freed), not the engine loop; so
does a KV connector that raises. Driven through the loop's turn (`EngineLoop.tick`), as the engine
process runs it."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.core.request import RequestStatus
from pdserve.engine.kv_connector import KVReady
from pdserve.engine_process.loop import MAX_CONSECUTIVE_FAILURES, EngineLoop
from pdserve.prefill.connector import first_token_only
from pdserve.protocol.engine_messages import (
    AbortRequest,
    Bootstrap,
    GenerateRequest,
    Shutdown,
    TokenOutput,
)
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from tests.unit.local_connectors import NullConnector

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


DEVICE_LOST = "the engine failed while running this request: RuntimeError: device lost"


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=128).engine


@pytest.fixture
def loop(engine):
    return EngineLoop(engine)


def params(n: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def generate(request_id: str, prompt: list[int], n: int = 8, bootstrap=None) -> GenerateRequest:
    return GenerateRequest(request_id, prompt, dataclasses.asdict(params(n)), bootstrap)


def tick(loop: EngineLoop, *messages) -> list[TokenOutput]:
    sent = loop.tick(list(messages))
    return [] if sent is None else sent.outputs


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
    tick(loop, generate("a", [5, 6, 7]), generate("b", [8, 9, 10, 11]))
    assert engine.kv_pages_in_use > 0  # prefilled: both requests hold pages now
    break_next_steps(monkeypatch, engine, 1)
    outputs = tick(loop)
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    for output in outputs:
        assert output.finished
        assert output.failure == Failure(FailureKind.INTERNAL, FailureStage.ENGINE, DEVICE_LOST)
    assert engine.kv_pages_in_use == 0
    assert not engine.has_unfinished()
    outputs = tick(loop, generate("c", [5, 6, 7], 3))
    while engine.has_unfinished():
        outputs += tick(loop)
    assert outputs[-1].finished and outputs[-1].error is None
    assert outputs[-1].num_output_tokens == 3
    assert engine.kv_pages_in_use == 0


def test_a_request_admitted_in_the_failed_step_is_failed_too(engine, loop, monkeypatch):
    break_next_steps(monkeypatch, engine, 1)
    outputs = tick(loop, generate("fresh", [5, 6, 7]))
    assert [o.request_id for o in outputs] == ["fresh"]
    assert outputs[0].failure.kind is FailureKind.INTERNAL
    assert engine.kv_pages_in_use == 0 and not engine.requests


def test_consecutive_failures_end_the_loop(engine, loop, monkeypatch):
    break_next_steps(monkeypatch, engine, MAX_CONSECUTIVE_FAILURES)
    for i in range(MAX_CONSECUTIVE_FAILURES - 1):
        assert tick(loop, generate(f"x{i}", [5, 6]))[0].failure.kind is FailureKind.INTERNAL
    with pytest.raises(RuntimeError, match="device lost"):
        tick(loop, generate("last", [5, 6]))
    engine.abort_request("last")
    assert engine.kv_pages_in_use == 0


def test_a_step_that_succeeds_resets_the_failure_count(engine, loop, monkeypatch):
    break_next_steps(monkeypatch, engine, MAX_CONSECUTIVE_FAILURES - 1)
    for i in range(MAX_CONSECUTIVE_FAILURES - 1):
        assert tick(loop, generate(f"y{i}", [5, 6]))[0].failure.kind is FailureKind.INTERNAL
    outputs = tick(loop, generate("fine", [5, 6], 1))
    assert outputs[0].error is None and loop.consecutive_failures == 0


class BrokenConnector(NullConnector):
    """A prefill-like connector whose KV moves at once; `finished` (inside a step) or
    `poll` raises the next `count` times."""

    role = "prefill"
    initial_status = RequestStatus.WAITING_FOR_PEER
    keeps_pages = True

    def __init__(self, engine, broken: str, count: int):
        super().__init__(engine)
        self.broken, self.left = broken, count
        self.new: list[str] = []

    def _maybe_raise(self, method: str) -> None:
        if self.broken == method and self.left:
            self.left -= 1
            raise RuntimeError(f"{method} broke")

    def sampling_params(self, params):
        return first_token_only(params)

    def add(self, request, bootstrap):
        self.new.append(request.request_id)
        return super().add(request, bootstrap)

    def finished(self, request) -> None:
        self._maybe_raise("finished")

    def poll(self):
        self._maybe_raise("poll")
        ready, self.new = self.new, []
        return [KVReady(request_id) for request_id in ready]


@pytest.fixture
def fresh_engine(tiny_model_dirs):
    """An engine of its own: a connector connects to it for good."""
    return LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=128).engine


def test_a_connector_that_fails_on_a_steps_outputs_fails_their_requests(fresh_engine):
    engine = fresh_engine
    connector = BrokenConnector(engine, "finished", 1)
    loop = EngineLoop(engine)
    room = Bootstrap("127.0.0.1", 8998, 1)
    outputs = tick(
        loop, generate("a", [5, 6, 7], bootstrap=room), generate("b", [8, 9], bootstrap=room)
    )
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    for output in outputs:
        assert output.finished and output.failure.kind is FailureKind.INTERNAL
        assert output.error == (
            "the engine failed while running this request: RuntimeError: finished broke"
        )
        assert output.new_token_ids == []
    # Ended through the connector, and in the engine: nothing left, pages free.
    assert sorted(request_id for request_id, _ in connector.ended_requests) == ["a", "b"]
    assert not engine.has_unfinished() and not engine.has_transfers
    assert engine.kv_pages_in_use == 0
    assert loop.consecutive_failures == 1


def test_a_connector_whose_poll_keeps_failing_ends_the_loop(fresh_engine):
    BrokenConnector(fresh_engine, "poll", MAX_CONSECUTIVE_FAILURES)
    loop = EngineLoop(fresh_engine)
    for _ in range(MAX_CONSECUTIVE_FAILURES - 1):
        assert loop.tick([]) is None  # logged and counted; nothing to report
    assert loop.consecutive_failures == MAX_CONSECUTIVE_FAILURES - 1
    with pytest.raises(RuntimeError, match="poll broke"):
        loop.tick([])


def test_a_colocated_worker_refuses_bootstrap_fields(engine, loop):
    (output,) = tick(loop, generate("pd", [5, 6], bootstrap=Bootstrap("127.0.0.1", 8998, 1)))
    assert output.finished and output.failure.kind is FailureKind.INVALID
    assert output.error == "this is a colocated worker: requests must not carry bootstrap fields"
    assert not engine.has_unfinished()


def test_invalid_sampling_settings_are_refused_not_raised(engine, loop):
    bad = GenerateRequest("bad", [5, 6], {"max_new_tokens": 4, "temperature": -1.0})
    unknown = GenerateRequest("unknown", [5, 6], {"max_new_tokens": 4, "beam_width": 2})
    outputs = tick(loop, bad, unknown)
    assert [o.request_id for o in outputs] == ["bad", "unknown"]
    assert all(o.finished and o.failure.kind is FailureKind.INVALID for o in outputs)
    assert "temperature" in outputs[0].error and "beam_width" in outputs[1].error


def test_abort_and_shutdown_messages(engine, loop):
    tick(loop, generate("long", [5, 6, 7], 50))
    assert engine.kv_pages_in_use > 0
    assert tick(loop, AbortRequest("long")) == []
    assert not engine.has_unfinished() and engine.kv_pages_in_use == 0
    assert loop.running
    assert loop.tick([Shutdown("test")]) is None and not loop.running


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
        assert output.finished and output.failure.kind is FailureKind.INTERNAL
        assert output.token_ids and all(t >= 0 for t in output.token_ids)
    assert engine.in_flight is None and not engine.has_unfinished()
    assert engine.kv_pages_in_use == 0
    engine.add_request("c", [5, 6, 7], params(3))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert len(tokens) == 3
