"""The prefill and decode handoffs in one process, each driven by the worker's real engine loop
(`EngineLoop.tick`), over the tcp transfer layer on loopback: the decode side admits by free
pages, every queue frees its pages when aborted, and refused requests fail the other side's
room."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from pdserve import LLM, SamplingParams
from pdserve.decode.connector import DecodeConnector
from pdserve.engine.core.request import RequestStatus
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine_process.loop import EngineLoop
from pdserve.prefill.connector import PrefillConnector
from pdserve.protocol.engine_messages import (
    AbortRequest,
    Bootstrap,
    FailRoom,
    GenerateRequest,
    TokenOutput,
)
from pdserve.protocol.failures import FailureKind
from pdserve.transfer.backends.memory.piece_registry import REGISTRY
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.peer_allow import PeerAllowList, parse_allow_list
from tests.conftest import random_prompts
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
CONFIG = TransferConfig(
    bootstrap_port=0, progress_timeout_s=3, peer_timeout_s=2, heartbeat_interval_s=0.2
)
PAGE = 4


@pytest.fixture
def pair(tiny_model_dirs):
    """A prefill and a decode handoff; decode has room for 12 pages only."""
    model = tiny_model_dirs("qwen3")
    prefill_engine = LLM(model, device="cpu", page_size=PAGE).engine
    page_bytes = prefill_engine.kv_pool.nbytes // prefill_engine.kv_pool.num_pages
    decode_engine = LLM(
        model, device="cpu", page_size=PAGE, kv_cache_memory=12 * page_bytes, max_model_len=48
    ).engine
    prefill = PrefillConnector(prefill_engine, CONFIG)
    decode = DecodeConnector(decode_engine, CONFIG)
    yield prefill, decode, model
    prefill.stop()
    decode.stop()


def add(connector: KVConnector, request_id, prompt, params, bootstrap):
    """Hand a request to the worker's engine, as its loop does; the failure output if it is
    refused at once (reported by the engine's next `poll_transfers`), else None."""
    engine = connector.engine
    if engine.add_request(request_id, prompt, params, bootstrap) is not None:
        return None
    return next(o for o in engine.poll_transfers() if o.request_id == request_id)


def phase(connector: KVConnector, status: RequestStatus) -> list[str]:
    """The ids of the connector's requests in `status`."""
    return [r.request_id for r in connector.in_phase(status)]


def boot(prefill: PrefillConnector, room: int) -> Bootstrap:
    return Bootstrap("127.0.0.1", prefill.bootstrap_port, room)


def generate(
    request_id: str, prompt: list[int], params: SamplingParams, bootstrap: Bootstrap | None
) -> GenerateRequest:
    """The message a worker's front end sends for a request."""
    return GenerateRequest(request_id, prompt, dataclasses.asdict(params), bootstrap)


def drive(
    *handoffs: KVConnector, until, deadline_s=20.0, messages=None
) -> dict[str, list[TokenOutput]]:
    """Turn each worker's engine loop (`EngineLoop.tick`: messages, poll, step, hand over)
    until `until(outputs)`; the outputs it would send, by request id. `messages` (handoff ->
    list) reach a loop in its first turn. The loop keeps no request state (the engine and the
    handoff do), so each drive may start fresh loops."""
    loops = [EngineLoop(handoff.engine) for handoff in handoffs]
    inboxes = [list((messages or {}).get(handoff, [])) for handoff in handoffs]
    outputs: dict[str, list[TokenOutput]] = {}

    def once() -> bool:
        for loop, inbox in zip(loops, inboxes, strict=True):
            sent = loop.tick(inbox)
            inbox.clear()
            for output in sent.outputs if sent is not None else []:
                outputs.setdefault(output.request_id, []).append(output)
        return until(outputs)

    wait_until(once, "the handoff", deadline_s, poll_s=0.001)
    return outputs


def one_request(prefill, decode, name: str, prompt, params, room: int) -> dict:
    """The messages of one request to both workers (`p<name>` and `d<name>`), as `drive`
    takes them."""
    return {
        prefill: [generate(f"p{name}", prompt, params, boot(prefill, room))],
        decode: [generate(f"d{name}", prompt, params, boot(prefill, room))],
    }


def finished(outputs, request_id) -> bool:
    return any(o.finished for o in outputs.get(request_id, []))


def tokens(outputs, request_id) -> list[int]:
    return [t for o in outputs[request_id] for t in o.new_token_ids]


def test_requests_flow_through_and_equal_colocated(pair):
    prefill, decode, model = pair
    prompts = random_prompts((3, 9, 14), 250, seed=5)
    expected = [o.token_ids for o in LLM(model, device="cpu").generate(prompts, GREEDY)]
    # The requests arrive as the front end sends them: as the loop's messages.
    messages = {
        prefill: [generate(f"p{i}", p, GREEDY, boot(prefill, i)) for i, p in enumerate(prompts)],
        decode: [generate(f"d{i}", p, GREEDY, boot(prefill, i)) for i, p in enumerate(prompts)],
    }
    names = [f"d{i}" for i in range(3)] + [f"p{i}" for i in range(3)]
    outputs = drive(
        prefill, decode, until=lambda o: all(finished(o, n) for n in names), messages=messages
    )
    for i in range(3):
        assert tokens(outputs, f"d{i}") == expected[i]
        assert tokens(outputs, f"p{i}") == expected[i][:1]  # prefill's leg: the first token
    assert prefill.engine.kv_pages_in_use == 0 and decode.engine.kv_pages_in_use == 0


def test_decode_admits_by_free_pages_in_order(pair):
    prefill, decode, _ = pair
    long = dataclasses.replace(GREEDY, max_new_tokens=1)
    # 11 pages, then 5 pages: the second waits until the first's pages are free.
    first, second = random_prompts((44, 20), 250, seed=6)
    add(decode, "a", first, long, boot(prefill, 1))
    add(decode, "b", second, long, boot(prefill, 2))
    decode.engine.poll_transfers()
    assert phase(decode, RequestStatus.WAITING_FOR_PAGES) == ["b"]
    assert phase(decode, RequestStatus.RECEIVING_KV) == ["a"]
    add(prefill, "pa", first, long, boot(prefill, 1))
    add(prefill, "pb", second, long, boot(prefill, 2))
    outputs = drive(prefill, decode, until=lambda o: finished(o, "a") and finished(o, "b"))
    assert outputs["a"][-1].error is None and outputs["b"][-1].error is None
    assert decode.engine.kv_pages_in_use == 0


def test_decode_waiting_for_pages_times_out_with_a_reason(pair):
    prefill, decode, _ = pair
    held = decode.engine.reserve_pages(12 * PAGE)
    add(decode, "starved", [5, 6, 7], GREEDY, boot(prefill, 3))
    outputs = drive(prefill, decode, until=lambda o: finished(o, "starved"))
    assert "no KV pages free" in outputs["starved"][-1].error
    assert outputs["starved"][-1].failure.label == "bootstrap/no_pages"
    assert decode.failures["bootstrap/no_pages"] == 1
    decode.engine.free_pages(held)


def test_aborts_free_pages_in_every_queue(pair):
    prefill, decode, _ = pair
    prompt = random_prompts((30,), 250, seed=7)[0]
    # Decode transferring (prefill never gets this room): abort frees the reservation.
    add(decode, "d", prompt, GREEDY, boot(prefill, 4))
    decode.engine.poll_transfers()
    assert decode.engine.kv_pages_in_use > 0
    assert decode.engine.abort_request("d") and decode.engine.kv_pages_in_use == 0
    # Prefill bootstrapping: nothing computed, nothing held.
    add(prefill, "p", prompt, GREEDY, boot(prefill, 5))
    assert prefill.engine.abort_request("p") and not phase(prefill, RequestStatus.WAITING_FOR_PEER)
    # Prefill sending: the room waits for decode's ack, pages held; abort frees them.
    add(decode, "d2", prompt, GREEDY, boot(prefill, 6))
    add(prefill, "p2", prompt, GREEDY, boot(prefill, 6))
    sending = RequestStatus.SENDING_KV
    drive(prefill, decode, until=lambda _: bool(phase(prefill, sending)), deadline_s=10)
    assert prefill.engine.kv_pages_in_use > 0
    assert prefill.engine.abort_request("p2") and prefill.engine.kv_pages_in_use == 0


def test_refused_prompt_fails_the_decode_room_at_once(pair):
    prefill, decode, _ = pair
    too_long = [7] * prefill.engine.max_model_len
    add(decode, "d", [5, 6], GREEDY, boot(prefill, 8))
    refused = add(prefill, "p", too_long, GREEDY, boot(prefill, 8))
    assert refused.failure.kind is FailureKind.INVALID and "maximum context length" in refused.error
    outputs = drive(prefill, decode, until=lambda o: finished(o, "d"), deadline_s=2)
    assert "prefill rejected" in outputs["d"][-1].error
    assert outputs["d"][-1].failure.kind is FailureKind.INVALID
    assert decode.engine.kv_pages_in_use == 0


def test_fail_room_from_the_front_end_reaches_decode(pair):
    prefill, decode, _ = pair
    add(decode, "d", [5, 6], GREEDY, boot(prefill, 9))
    prefill.fail_room(FailRoom(9, "invalid request body"))
    outputs = drive(prefill, decode, until=lambda o: finished(o, "d"), deadline_s=2)
    assert "invalid request body" in outputs["d"][-1].error


def test_a_room_in_use_is_refused(pair):
    prefill, decode, _ = pair
    assert add(decode, "a", [5], GREEDY, boot(prefill, 10)) is None
    assert add(prefill, "pa", [5], GREEDY, boot(prefill, 10)) is None
    for refused in (
        add(decode, "b", [5], GREEDY, boot(prefill, 10)),
        add(prefill, "pb", [5], GREEDY, boot(prefill, 10)),
    ):
        assert "already in use" in refused.error
        assert refused.failure.label == "bootstrap/invalid"


def test_decode_refusal_fails_the_prefill_room(pair):
    prefill, decode, _ = pair
    add(prefill, "p", [5, 6], GREEDY, boot(prefill, 11))
    decode.fail_room(FailRoom(11, "too many tokens", "127.0.0.1", prefill.bootstrap_port))
    outputs = drive(prefill, decode, until=lambda o: finished(o, "p"), deadline_s=2)
    assert "decode rejected the request: too many tokens" in outputs["p"][-1].error
    assert prefill.engine.kv_pages_in_use == 0


def test_a_bootstrap_host_outside_the_allow_list_is_refused_as_invalid(pair):
    prefill, decode, _ = pair
    decode.client.allow_list = PeerAllowList(parse_allow_list(["10.0.0.0/8"]))
    refused = add(decode, "d", [5, 6], GREEDY, boot(prefill, 12))
    assert refused.failure.kind is FailureKind.INVALID
    assert "bootstrap_host '127.0.0.1'" in refused.error
    # The front end then reports the refusal; still nothing is contacted.
    decode.fail_room(FailRoom(12, refused.error, "127.0.0.1", prefill.bootstrap_port))
    decode.engine.poll_transfers()
    assert decode.engine.kv_pages_in_use == 0 and not decode.client.peers


def test_a_refused_room_counts_as_one_failure_on_each_side(pair):
    prefill, decode, _ = pair
    too_long = [7] * prefill.engine.max_model_len
    add(decode, "d", [5, 6], GREEDY, boot(prefill, 13))
    refused = add(prefill, "p", too_long, GREEDY, boot(prefill, 13))
    outputs = drive(prefill, decode, until=lambda o: finished(o, "d"), deadline_s=2)
    # Each front end turns its failure output into an error, which reports the room again.
    prefill.fail_room(FailRoom(13, refused.error))
    host, port = "127.0.0.1", prefill.bootstrap_port
    decode.fail_room(FailRoom(13, outputs["d"][-1].error, host, port))
    assert sum(prefill.failures.values()) == 1
    assert sum(decode.failures.values()) == 1


def test_a_disaggregated_worker_refuses_a_request_without_bootstrap_fields(pair):
    prefill, decode, _ = pair
    for handoff in (prefill, decode):
        (output,) = (
            EngineLoop(handoff.engine).tick([generate("plain", [5, 6], GREEDY, None)]).outputs
        )
        assert output.finished and output.failure.kind is FailureKind.INVALID
        assert output.error.startswith("this is a disaggregated worker: requests need")
    assert not prefill.requests and not decode.requests


def test_an_abort_message_ends_the_request_in_the_handoff(pair):
    prefill, decode, _ = pair
    loop = EngineLoop(decode.engine)
    # Pages reserved and waiting for KV that never comes (prefill never gets this room).
    assert loop.tick([generate("d", [5] * 30, GREEDY, boot(prefill, 14))]) is None
    assert phase(decode, RequestStatus.RECEIVING_KV) == ["d"]
    assert decode.engine.kv_pages_in_use > 0
    loop.tick([AbortRequest("d")])
    assert not decode.requests and decode.engine.kv_pages_in_use == 0


def test_an_abort_message_ends_a_request_that_joined_the_decode_batch(pair):
    prefill, decode, _ = pair
    long = dataclasses.replace(GREEDY, max_new_tokens=30)
    messages = one_request(prefill, decode, "", [5, 6, 7], long, 15)
    drive(prefill, decode, until=lambda o: "d" in o, messages=messages)
    assert decode.engine.has_unfinished() and not decode.requests  # decoding now
    EngineLoop(decode.engine).tick([AbortRequest("d")])
    assert not decode.engine.has_unfinished() and decode.engine.kv_pages_in_use == 0


@pytest.fixture(params=["tcp", "ipc", "memory"])
def streaming_pair(request, tiny_model_dirs):
    """Prefill computes prompts 8 tokens (2 pages) a step and sends every completed page at
    once: a room's KV leaves in several pieces while its prompt is still being computed. Over
    tcp, with prefill writing straight into decode's pages (ipc), and handed over inside the
    process (memory: which leaves nothing in its registry once every room ended)."""
    model = tiny_model_dirs("qwen3")
    config = dataclasses.replace(CONFIG, piece_bytes=1, backend=request.param)
    prefill_engine = LLM(model, device="cpu", page_size=PAGE, chunked_prefill_size=8).engine
    decode_engine = LLM(model, device="cpu", page_size=PAGE).engine
    prefill = PrefillConnector(prefill_engine, config)
    decode = DecodeConnector(decode_engine, config)
    yield prefill, decode, model
    try:
        if request.param == "memory":
            wait_until(lambda: len(REGISTRY) == 0, "the memory registry to empty", 5)
    finally:
        prefill.stop()
        decode.stop()


def test_kv_streamed_while_prefill_runs_equals_colocated(streaming_pair):
    prefill, decode, model = streaming_pair
    prompts = random_prompts((41, 23, 6), 250, seed=8)
    expected = [o.token_ids for o in LLM(model, device="cpu").generate(prompts, GREEDY)]
    messages = {
        prefill: [
            generate(f"p{i}", p, GREEDY, boot(prefill, 20 + i)) for i, p in enumerate(prompts)
        ],
        decode: [
            generate(f"d{i}", p, GREEDY, boot(prefill, 20 + i)) for i, p in enumerate(prompts)
        ],
    }
    names = [f"d{i}" for i in range(3)]
    outputs = drive(
        prefill, decode, until=lambda o: all(finished(o, n) for n in names), messages=messages
    )
    for i in range(3):
        assert tokens(outputs, f"d{i}") == expected[i]
    # 41 tokens: 10 pages completed chunk by chunk (4 pieces of 2), then the rest (11th page).
    assert prefill.metrics.pieces_sent >= 3 + 4 + 2
    drive(
        prefill, until=lambda _: not phase(prefill, RequestStatus.SENDING_KV), deadline_s=10
    )  # decode's ack lands
    assert prefill.engine.kv_pages_in_use == 0 and decode.engine.kv_pages_in_use == 0


def test_a_prefill_aborted_after_some_pieces_fails_decode_and_frees_both_sides(streaming_pair):
    prefill, decode, _ = streaming_pair
    prompt = random_prompts((64,), 250, seed=9)[0]
    messages = one_request(prefill, decode, "", prompt, GREEDY, 30)
    drive(prefill, decode, until=lambda _: prefill.metrics.pieces_sent >= 2, messages=messages)
    assert (
        prefill.engine.requests["p"].status is RequestStatus.RUNNING
    )  # mid-prompt: 16 pages, 4 at most computed
    assert prefill.engine.abort_request("p")
    outputs = drive(prefill, decode, until=lambda o: finished(o, "d"), deadline_s=10)
    assert "prefill request was aborted" in outputs["d"][-1].error
    # NOTE: over ipc decode's pages stay pinned until prefill says its writes are over
    # (`RoomReleased`), which may come a turn after the room's failure.
    drive(prefill, decode, until=lambda _: decode.engine.kv_pages_in_use == 0, deadline_s=5)
    assert prefill.engine.kv_pages_in_use == 0 and decode.engine.kv_pages_in_use == 0


def test_a_conversation_decoded_here_receives_only_its_new_pages(streaming_pair):
    """Turn n + 1's prompt is turn n's prompt, its answer and new tokens: decode's prefix
    cache holds the start, so prefill sends only the pages after it (streamed in pieces),
    and the answers equal a colocated engine without caching."""
    prefill, decode, model = streaming_pair
    plain = LLM(model, device="cpu", disable_prefix_caching=True)
    page_bytes = decode.stager.page_bytes[0]
    prompt = random_prompts((22,), 250, seed=9)[0]
    known = 0  # tokens of this conversation whose KV decode computed or received
    for turn in range(3):
        received, skipped = decode.metrics.bytes_received, decode.metrics.bytes_skipped
        messages = one_request(prefill, decode, str(turn), prompt, GREEDY, 40 + turn)
        outputs = drive(
            prefill, decode, until=lambda o, t=turn: finished(o, f"d{t}"), messages=messages
        )
        answer = tokens(outputs, f"d{turn}")
        assert answer == plain.generate([prompt], GREEDY)[0].token_ids
        # The full pages of what decode knew are cached (not the page holding the prompt's
        # last token, which always travels); the rest of the prompt's pages are received.
        cached = min(known, len(prompt) - 1) // PAGE
        pages = -(-len(prompt) // PAGE)
        assert decode.metrics.bytes_skipped - skipped == cached * page_bytes
        assert decode.metrics.bytes_received - received == (pages - cached) * page_bytes
        known = len(prompt) + len(answer) - 1  # the last answer token was never computed
        prompt = prompt + answer + random_prompts((9,), 250, seed=10 + turn)[0]
    drive(
        prefill, until=lambda _: not phase(prefill, RequestStatus.SENDING_KV), deadline_s=10
    )  # decode's ack lands
    for handoff in (prefill, decode):
        assert handoff.engine.kv_pages_in_use == 0
        cache = handoff.engine.prefix_cache
        assert cache.num_unreferenced == cache.num_pages  # no reference left behind


def test_a_room_that_ends_before_its_kv_drops_its_cached_pages(streaming_pair):
    prefill, decode, _ = streaming_pair
    prompt = random_prompts((22,), 250, seed=11)[0]
    messages = one_request(prefill, decode, "", prompt, GREEDY, 50)
    answer = tokens(
        drive(prefill, decode, until=lambda o: finished(o, "d"), messages=messages), "d"
    )
    cache = decode.engine.prefix_cache
    assert cache.num_pages >= 6
    # Turn 2 reaches decode only: it holds the cached pages and waits for KV that never comes.
    loop = EngineLoop(decode.engine)
    assert loop.tick([generate("d2", prompt + answer + [7, 8], GREEDY, boot(prefill, 51))]) is None
    room = decode.engine.requests["d2"].transfer.receiver
    assert room.num_cached_pages == (len(prompt) + len(answer) - 1) // PAGE
    assert cache.num_unreferenced == cache.num_pages - room.num_cached_pages
    ipc = decode.config.backend == "ipc"
    gate = threading.Event()
    if ipc:  # the request reached prefill, which may write the pages from now on
        plane = decode.client.plane
        wait_until(lambda: plane.writes_pending(room.entry), "the transfer request to go out", 10)
        # NOTE: prefill's IO thread waits, so that its answer cannot come before we look.
        prefill.server.io.call(lambda: gate.wait(10))
    loop.tick([AbortRequest("d2")])
    assert not decode.requests
    if ipc:
        # Prefill might still write the pages: they wait for its word (RoomReleased).
        assert decode.stats().num_held_back == 1 and decode.engine.kv_pages_in_use > 0
        gate.set()
        drive(prefill, decode, until=lambda _: decode.engine.kv_pages_in_use == 0)
        assert decode.stats().num_held_back == 0
    assert decode.engine.kv_pages_in_use == 0
    assert cache.num_unreferenced == cache.num_pages


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_abort_that_comes_before_its_request_counts_once_as_an_abort(pair, role):
    """A router gave up on a room before the worker saw its request: the request, when it
    comes, fails with that abort (no pages reserved), and the room counts as one abort."""
    prefill, decode, _ = pair
    handoff = prefill if role == "prefill" else decode
    host, port = ("", 0) if role == "prefill" else ("127.0.0.1", prefill.bootstrap_port)
    handoff.fail_room(FailRoom(14, "the router gave up", host, port, FailureKind.ABORTED))
    late = generate("late", [5, 6], GREEDY, boot(prefill, 14))
    outputs = drive(handoff, messages={handoff: [late]}, until=lambda o: finished(o, "late"))
    assert outputs["late"][-1].failure.kind is FailureKind.ABORTED
    assert dict(handoff.failures) == {"bootstrap/aborted": 1}
    assert handoff.engine.kv_pages_in_use == 0


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_abort_for_a_room_that_never_comes_counts_no_failure(pair, role):
    """Aborts for rooms this worker never sees (a router's for a leg that went elsewhere, or
    a flood of made-up ones) are remembered, but count as no failure of this worker's; a
    front end's refusal of a request it received counts at once."""
    prefill, decode, _ = pair
    handoff = prefill if role == "prefill" else decode
    host, port = ("", 0) if role == "prefill" else ("127.0.0.1", prefill.bootstrap_port)
    for room in range(100, 110):
        handoff.fail_room(FailRoom(room, "the router gave up", host, port, FailureKind.ABORTED))
    assert dict(handoff.failures) == {}
    handoff.fail_room(FailRoom(110, "prompt too long", host, port, FailureKind.INVALID))
    assert dict(handoff.failures) == {"bootstrap/invalid": 1}


def test_a_request_refused_for_its_own_fault_is_logged_at_info_not_warning(pair, caplog):
    """A client's too-long prompt is the client's error: neither worker warns about it."""
    prefill, decode, _ = pair
    too_long = [7] * prefill.engine.max_model_len
    with caplog.at_level(logging.INFO):
        add(decode, "d", [5, 6], GREEDY, boot(prefill, 14))
        add(prefill, "p", too_long, GREEDY, boot(prefill, 14))
        drive(prefill, decode, until=lambda o: finished(o, "d"), deadline_s=2)
        add(prefill, "p2", [5, 6], GREEDY, boot(prefill, 15))
        decode.fail_room(FailRoom(15, "too many tokens", "127.0.0.1", prefill.bootstrap_port))
        drive(prefill, decode, until=lambda o: finished(o, "p2"), deadline_s=2)
    failed = {r.getMessage().split()[1]: r.levelno for r in caplog.records if "failed:" in r.msg}
    assert failed == {"d": logging.INFO, "p2": logging.INFO}, caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
