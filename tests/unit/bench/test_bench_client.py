"""pdserve.bench's client and runner against an in-process fake server (httpx.MockTransport).

The fake streams SSE events on a script of (time, event) pairs and moves a fake clock to each
event's time before sending it; the client reads that clock, so TTFT, ITL and E2E are exact."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.bench.client import BenchClient, ClientSettings
from pdserve.bench.metrics import SLO, format_summary, summarize
from pdserve.bench.runner import Load, run_load
from pdserve.bench.workloads import Conversation, Turn

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


DONE = "[DONE]"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def text_chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def usage(prompt: int, completion: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def scripted(script, clock: FakeClock, seen: list | None = None, status: int = 200):
    """A transport answering every request with `script`: (time, event) pairs, an event a
    dict (a JSON data line), DONE, or raw text."""

    async def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((request, json.loads(request.content)))

        async def events():
            for at, event in script:
                clock.now = at
                if isinstance(event, dict):
                    yield f"data: {json.dumps(event)}\n\n".encode()
                elif event == DONE:
                    yield b"data: [DONE]\n\n"
                else:
                    yield event.encode()

        return httpx.Response(status, content=events(), headers={"content-type": "text/plain"})

    return httpx.MockTransport(handle)


def settings(endpoint="completions", **kw) -> ClientSettings:
    return ClientSettings("http://fake", "tiny", endpoint, **kw)


def send(transport, conversation, endpoint="completions", clock=None, answers=(), **kw):
    async def go():
        client = BenchClient(
            settings(endpoint, **kw), transport=transport, clock=clock or FakeClock()
        )
        try:
            return await client.send(conversation, list(answers))
        finally:
            await client.aclose()

    return asyncio.run(go())


ONE = Conversation((Turn((5, 6, 7, 8, 9), 3),))
CHAT = Conversation((Turn("hello there", 3),), system="be brief")


def test_completion_stream_times_each_chunk():
    clock = FakeClock()
    script = [
        (0.25, text_chunk("a")),
        (0.30, text_chunk("b")),
        (0.40, text_chunk("c", finish="length")),
        (0.45, usage(5, 3)),
        (0.50, DONE),
    ]
    record = send(scripted(script, clock), ONE, clock=clock)
    assert record.success and record.error is None
    assert record.ttft_s == pytest.approx(0.25)
    assert record.itl_s == pytest.approx([0.05, 0.10])
    assert record.e2e_s == pytest.approx(0.50)
    assert record.tpot_s == pytest.approx((0.50 - 0.25) / 2)
    assert (record.output_tokens, record.prompt_tokens, record.answer) == (3, 5, "abc")
    assert record.cached_tokens is None  # the usage did not say


def test_cached_prompt_tokens_come_from_the_usage_details():
    clock = FakeClock()
    cached = usage(5, 1)
    cached["usage"]["prompt_tokens_details"] = {"cached_tokens": 4}
    script = [(0.25, text_chunk("a", finish="length")), (0.3, cached), (0.4, DONE)]
    record = send(scripted(script, clock), ONE, clock=clock)
    assert (record.prompt_tokens, record.cached_tokens) == (5, 4)
    summary = summarize([record], 1.0, SLO())
    assert (summary["cached_input_tokens"], summary["computed_input_tokens"]) == (4, 1)
    assert "Input tokens from the prefix cache" in format_summary(summary, "t")


def test_chat_stream_ignores_the_role_chunk_and_counts_chunks_without_usage():
    clock = FakeClock()
    script = [
        (0.10, chat_chunk({"role": "assistant", "content": ""})),
        (0.20, chat_chunk({"content": "Hi"})),
        (0.50, chat_chunk({"content": " you"})),
        (0.60, chat_chunk({}, finish="stop")),
        (0.70, DONE),
    ]
    record = send(scripted(script, clock), CHAT, "chat", clock=clock)
    assert record.success
    assert record.ttft_s == pytest.approx(0.20)
    assert record.itl_s == pytest.approx([0.30])  # the empty finish chunk carries nothing
    assert (record.output_tokens, record.answer) == (2, "Hi you")
    assert record.prompt_tokens is None  # text prompt, no usage


def test_logprobs_count_tokens_and_a_finish_chunk_stands_in_for_the_first_token():
    clock = FakeClock()
    with_logprobs = {"tokens": ["x", "y"], "token_logprobs": [-1.0, -2.0]}
    script = [
        (0.30, {"choices": [{"index": 0, "text": "", "logprobs": with_logprobs}]}),
        (0.40, DONE),
    ]
    assert send(scripted(script, clock), ONE, clock=clock).output_tokens == 2
    clock = FakeClock()
    silent = [(0.70, text_chunk("", finish="length")), (0.80, usage(5, 3)), (0.90, DONE)]
    record = send(scripted(silent, clock), ONE, clock=clock)
    assert record.ttft_s == pytest.approx(0.70) and record.output_tokens == 3


def test_an_error_status_is_a_failure_with_its_message():
    clock = FakeClock()
    body = {"error": {"message": "prompt too long", "type": "invalid_request_error"}}
    transport = scripted([(0.1, json.dumps(body))], clock, status=400)
    record = send(transport, ONE, clock=clock)
    assert not record.success
    assert record.error == "HTTP 400: prompt too long"


def test_an_sse_error_event_is_a_failure_with_its_message():
    clock = FakeClock()
    error = {"error": {"message": "decode worker died", "type": "server_error", "code": "x"}}
    script = [(0.1, text_chunk("a")), (0.2, error), (0.3, DONE)]
    record = send(scripted(script, clock), ONE, clock=clock)
    assert not record.success
    assert record.error == "error event: decode worker died"
    assert record.ttft_s == pytest.approx(0.1)


def test_a_stream_cut_short_or_garbled_is_a_failure():
    clock = FakeClock()
    record = send(scripted([(0.1, text_chunk("a"))], clock), ONE, clock=clock)
    assert record.error == "the stream ended without data: [DONE]"
    record = send(scripted([(0.1, "data: {not json\n\n")], clock), ONE, clock=clock)
    assert record.error.startswith("malformed stream")


def test_a_transport_error_or_a_timeout_is_a_failure():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    record = send(httpx.MockTransport(refuse), ONE)
    assert not record.success and record.error == "ConnectError: connection refused"

    async def stall(request):
        await asyncio.sleep(5)

    record = send(httpx.MockTransport(stall), ONE, clock=None, timeout_s=0.05)
    assert not record.success and "0.05 s timeout" in record.error


def test_request_bodies_for_both_endpoints():
    seen: list = []
    transport = scripted([(0.1, DONE)], FakeClock(), seen)
    send(transport, ONE, logprobs=0, api_key="sk-test")
    send(transport, CHAT, "chat", ignore_eos=False, logprobs=2)
    (first, completion), (_, chat) = seen
    assert first.url == "http://fake/v1/completions"
    assert first.headers["authorization"] == "Bearer sk-test"
    assert completion == {
        "model": "tiny",
        "max_tokens": 3,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "prompt": [5, 6, 7, 8, 9],
        "logprobs": 0,
    }
    assert "ignore_eos" not in chat and (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]


def run(transport, conversations, load: Load | None = None, **kw):
    async def go():
        client = BenchClient(settings("chat", **kw), transport=transport)
        try:
            return await run_load(client, conversations, load or Load())
        finally:
            await client.aclose()

    return asyncio.run(go())


def chat_server(seen: list, fail_turn: int | None = None, delay_s: float = 0.0):
    """Answers "answer N" (N: the messages it got); a 503 at turn `fail_turn`. Tracks how many
    requests are in flight at once in seen[0]."""
    in_flight = [0]

    async def handle(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        seen.append(messages)
        turn = sum(m["role"] == "user" for m in messages) - 1
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(delay_s)
        in_flight[0] -= 1
        if turn == fail_turn:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        events = [chat_chunk({"content": f"answer {len(messages)}"}), usage(9, 1)]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body)

    peak = [0]
    return httpx.MockTransport(handle), peak


def conversation(turns: int, system: str = "sys") -> Conversation:
    return Conversation(tuple(Turn(f"question {t}", 4) for t in range(turns)), system)


def test_multi_turn_sends_each_turn_with_the_answers_received():
    seen: list = []
    transport, _ = chat_server(seen)
    result = run(transport, [conversation(3)])
    assert [r.turn for r in result.records] == [0, 1, 2] and all(r.success for r in result.records)
    assert seen[0] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "question 0"},
    ]
    assert seen[1] == [*seen[0], {"role": "assistant", "content": "answer 2"}, seen[1][-1]]
    assert seen[2][: len(seen[1])] == seen[1]
    assert seen[2][len(seen[1])] == {"role": "assistant", "content": "answer 4"}


def test_a_failed_turn_ends_its_conversation_and_the_run_goes_on():
    seen: list = []
    transport, _ = chat_server(seen, fail_turn=1)
    result = run(transport, [conversation(3), conversation(3)])
    outcomes = [(r.conversation, r.turn, r.success) for r in result.records]
    assert outcomes == [(c, t, t == 0) for c in (0, 1) for t in range(3)]
    assert len(seen) == 4  # turns 0 and 1 of each; turn 2 never sent
    assert result.records[1].error == "HTTP 503: overloaded"
    assert result.records[2].error.startswith("not sent")
    summary = summarize(result.records, result.duration_s, SLO())
    assert (summary["completed"], summary["failed"]) == (2, 4)


def test_max_concurrency_caps_requests_in_flight():
    seen: list = []
    transport, peak = chat_server(seen, delay_s=0.02)
    result = run(transport, [conversation(1) for _ in range(9)], Load(max_concurrency=3))
    assert len(result.records) == 9 and peak[0] == 3
    transport, peak = chat_server(seen, delay_s=0.02)
    run(transport, [conversation(1) for _ in range(9)])
    assert peak[0] == 9  # rate inf, no cap: all at once


def test_poisson_arrivals_start_conversations_no_earlier_than_scheduled():
    from pdserve.bench.runner import arrival_offsets

    seen: list = []
    transport, _ = chat_server(seen)
    result = run(transport, [conversation(1) for _ in range(12)], Load(request_rate=300.0))
    offsets = arrival_offsets(12, 300.0, seed=0)
    for record in result.records:
        assert record.start_s >= offsets[record.conversation] - 1e-3
    assert result.duration_s >= offsets[-1]


def slow_chat_server(delays: dict[str, float], aborted: list[str]):
    """Answers each user message after `delays[message]` seconds (0 when not listed); notes
    in `aborted` the messages whose request the client gave up on while it waited."""

    async def handle(request: httpx.Request) -> httpx.Response:
        question = json.loads(request.content)["messages"][-1]["content"]
        try:
            await asyncio.sleep(delays.get(question, 0.0))
        except asyncio.CancelledError:
            aborted.append(question)
            raise
        events = [chat_chunk({"content": "ok"}), usage(9, 1)]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body)

    return httpx.MockTransport(handle)


def run_until(transport, conversations, deadline_s: float, load: Load | None = None):
    async def go():
        client = BenchClient(settings("chat"), transport=transport)
        try:
            return await run_load(client, conversations, load or Load(), deadline_s=deadline_s)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_deadline_cuts_off_requests_in_flight_and_closes_them():
    aborted: list[str] = []
    slow_second_turn = Conversation((Turn("quick", 2), Turn("slow", 2), Turn("never", 2)))
    transport = slow_chat_server({"slow": 30.0}, aborted)
    result = run_until(transport, [conversation(1), slow_second_turn], deadline_s=0.3)
    assert result.duration_s < 5  # not the 30 s the slow answer would take
    outcomes = [(r.conversation, r.turn, r.success) for r in result.records]
    assert outcomes == [(0, 0, True), (1, 0, True), (1, 1, False), (1, 2, False)]
    cut, later = result.records[2], result.records[3]
    assert cut.error.startswith("cut off at the run's deadline") and cut.max_tokens == 2
    assert later.error.startswith("not sent")
    assert aborted == ["slow"]  # its stream was closed, not left running


def test_a_deadline_counts_conversations_that_never_started_as_not_sent():
    aborted: list[str] = []
    transport = slow_chat_server({"question 0": 30.0}, aborted)
    one_at_a_time = Load(max_concurrency=1)
    result = run_until(transport, [conversation(1), conversation(1)], 0.3, one_at_a_time)
    first, second = result.records
    assert first.error.startswith("cut off") and first.e2e_s == pytest.approx(0.3, abs=0.2)
    assert second.error == "not sent: the run's deadline (0.3 s) came first"
    summary = summarize(result.records, result.duration_s, SLO())
    assert (summary["completed"], summary["failed"]) == (0, 2)


def test_a_run_without_a_deadline_waits_for_every_answer_and_a_bad_deadline_is_refused():
    aborted: list[str] = []
    transport = slow_chat_server({"question 0": 0.3}, aborted)
    result = run_until(transport, [conversation(1)], deadline_s=None)
    assert result.records[0].success and result.duration_s >= 0.3 and not aborted
    with pytest.raises(ValueError, match="deadline"):
        run_until(transport, [conversation(1)], deadline_s=0.0)


def test_chunks_are_timed_as_they_arrive_over_a_real_socket():
    """A raw HTTP/1.1 server writes a chunk every 50 ms: the client must see the gaps (a
    client that buffered the body would see them all at once)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        events = [text_chunk("x") for _ in range(4)]
        for data in [*(f"data: {json.dumps(e)}\n\n" for e in events), "data: [DONE]\n\n"]:
            await asyncio.sleep(0.05)
            writer.write(b"%x\r\n%s\r\n" % (len(data), data.encode()))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        writer.close()

    async def go():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = BenchClient(ClientSettings(f"http://127.0.0.1:{port}", "tiny"))
        try:
            return await client.send(ONE, [])
        finally:
            await client.aclose()
            server.close()

    record = asyncio.run(go())
    assert record.success and record.answer == "xxxx"
    assert record.ttft_s >= 0.045 and len(record.itl_s) == 3
    assert sum(record.itl_s) >= 0.1 and record.e2e_s >= 0.2
