"""A step that raises fails the requests of its batch (pages freed), not the engine loop; so
does a handoff that raises. Driven through the loop's turn (`EngineLoop.tick`), as the engine
process runs it."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.handoff import Colocated
from pdserve.protocol.engine_messages import (
    AbortRequest,
    Bootstrap,
    GenerateRequest,
    Shutdown,
    TokenOutput,
)
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.server.engine_process import MAX_CONSECUTIVE_FAILURES, EngineLoop

DEVICE_LOST = "the engine failed while running this request: RuntimeError: device lost"


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=128).engine


@pytest.fixture
def loop(engine):
    return EngineLoop(Colocated(engine))


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


class BrokenHandoff(Colocated):
    """The null handoff, but `poll` or `on_step` raises the next `count` times."""

    def __init__(self, engine, broken: str, count: int):
        super().__init__(engine)
        self.broken, self.left = broken, count
        self.aborted: list[str] = []

    def _maybe_raise(self, method: str) -> None:
        if self.broken == method and self.left:
            self.left -= 1
            raise RuntimeError(f"{method} broke")

    def poll(self):
        self._maybe_raise("poll")
        return super().poll()

    def on_step(self, outputs):
        self._maybe_raise("on_step")
        return super().on_step(outputs)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return super().abort(request_id)


def test_a_handoff_that_fails_on_a_steps_outputs_fails_their_requests(engine):
    handoff = BrokenHandoff(engine, "on_step", 1)
    loop = EngineLoop(handoff)
    outputs = tick(loop, generate("a", [5, 6, 7]), generate("b", [8, 9]))
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    for output in outputs:
        assert output.finished and output.failure.kind is FailureKind.INTERNAL
        assert output.error == (
            "the engine failed while running this request: RuntimeError: on_step broke"
        )
        assert output.new_token_ids == []
    # Aborted through the handoff, which ends them in the engine: nothing left, pages free.
    assert sorted(handoff.aborted) == ["a", "b"]
    assert not engine.has_unfinished() and engine.kv_pages_in_use == 0
    assert loop.consecutive_failures == 1


def test_a_handoff_whose_poll_keeps_failing_ends_the_loop(engine):
    loop = EngineLoop(BrokenHandoff(engine, "poll", MAX_CONSECUTIVE_FAILURES))
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
