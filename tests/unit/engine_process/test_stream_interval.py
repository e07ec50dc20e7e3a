"""`--stream-interval N`: the engine process sends a request's tokens N at a time, its first
and last output at once, the tokens before a failure ahead of it, every token and logprob
exactly once; what it held for an aborted request is dropped."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine_process.loop import EngineLoop
from pdserve.engine_process.stream_interval import StreamInterval
from pdserve.protocol.engine_messages import AbortRequest, GenerateRequest, TokenOutput
from pdserve.protocol.failures import Failure, FailureKind, FailureStage

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


FAILURE = Failure(FailureKind.INTERNAL, FailureStage.ENGINE, "device lost")


def out(request_id: str, tokens: list[int], done: int, finished=False, failure=None):
    return TokenOutput(
        request_id,
        tokens,
        finished,
        4,
        done,
        finish_reason="length" if finished else None,
        failure=failure,
        new_logprobs=[-0.5 * t for t in tokens],
    )


def sent_sizes(hold: StreamInterval, steps, live=("a", "b")) -> list[tuple[str, list[int]]]:
    """What `hold` passes on over `steps` (each a list of outputs): (request, tokens) each."""
    return [(o.request_id, o.new_token_ids) for s in steps for o in hold.pass_on(s, live)]


def test_tokens_go_out_n_at_a_time_first_and_last_at_once():
    hold = StreamInterval(3)
    steps = [[out("a", [1], 1), out("b", [7], 1)]]
    steps += [[out("a", [t], t), out("b", [t + 6], t)] for t in range(2, 6)]
    steps += [[out("a", [6], 6, finished=True)], [out("b", [12, 13], 7, finished=True)]]
    assert sent_sizes(hold, steps) == [
        ("a", [1]),
        ("b", [7]),
        ("a", [2, 3, 4]),
        ("b", [8, 9, 10]),
        ("a", [5, 6]),
        ("b", [11, 12, 13]),
    ]
    assert hold.num_held == 0


def test_logprobs_and_the_later_state_travel_with_the_held_tokens():
    hold = StreamInterval(2)
    hold.pass_on([out("a", [1], 1)], {"a"})
    assert hold.pass_on([out("a", [2], 2)], {"a"}) == []
    (sent,) = hold.pass_on([out("a", [3], 3)], {"a"})
    assert sent == dataclasses.replace(out("a", [2, 3], 3))


def test_the_tokens_before_a_failure_go_out_ahead_of_it():
    hold = StreamInterval(4)
    failed = TokenOutput("a", [], True, 4, 2, finish_reason="abort", failure=FAILURE)
    steps = [[out("a", [1], 1)], [out("a", [2], 2)], [failed]]
    assert sent_sizes(hold, steps) == [("a", [1]), ("a", [2]), ("a", [])]
    assert hold.num_held == 0


def test_what_an_aborted_request_held_is_dropped():
    hold = StreamInterval(4)
    hold.pass_on([out("a", [1], 1), out("b", [1], 1)], {"a", "b"})
    hold.pass_on([out("a", [2], 2), out("b", [2], 2)], {"a", "b"})
    hold.drop("a")  # NOTE: the abort message
    assert hold.num_held == 1
    hold.pass_on([], live=set())  # NOTE: "b" left the engine without a last output
    assert hold.num_held == 0


def test_an_interval_of_one_passes_every_output_as_it_is():
    outputs = [out("a", [1], 1), out("a", [2], 2)]
    assert StreamInterval(1).pass_on(outputs, set()) is outputs
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        StreamInterval(0)


# ---- through the engine process's loop -----------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return LLM(tiny_model_dirs("llama"), device="cpu", max_model_len=128, stream_interval=4).engine


def generate(request_id: str, params: SamplingParams) -> GenerateRequest:
    return GenerateRequest(request_id, [5, 6, 7, 8], dataclasses.asdict(params))


def run(loop: EngineLoop, messages: list, until) -> list[TokenOutput]:
    sent = []
    for _ in range(200):
        result = loop.tick(messages)
        messages = []
        sent += result.outputs if result is not None else []
        if until(sent):
            return sent
    raise AssertionError(f"not done after 200 turns: {sent}")


def test_a_workers_loop_sends_every_token_and_logprob_four_at_a_time(engine):
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    (want,) = LLM(engine.config.model_path, device="cpu", max_model_len=128).generate(
        [[5, 6, 7, 8]], params
    )
    sent = run(EngineLoop(engine), [generate("r", params)], lambda s: s[-1].finished)
    assert [len(o.new_token_ids) for o in sent] == [1, 4, 4, 1]
    assert [t for o in sent for t in o.new_token_ids] == want.token_ids
    logprobs = [lp for o in sent for lp in o.new_logprobs]
    assert logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert [len(top) for o in sent for top in o.new_top_logprobs] == [2] * 10


def test_an_aborted_request_leaves_nothing_held(engine):
    loop = EngineLoop(engine)
    params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    run(loop, [generate("r", params)], lambda s: loop.stream_interval.num_held == 1)
    assert loop.tick([AbortRequest("r")]) is None  # NOTE: an aborted request gets no output
    assert loop.stream_interval.num_held == 0 and not engine.has_unfinished()
