"""KV + metadata transfer over the tcp (ZMQ) backend between real processes on loopback."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import msgpack
import pytest
import zmq

from pdserve.transfer.config import TransferConfig
from tests.e2e.transfer_peers import Case, run_decode, run_prefill

CONFIG = TransferConfig(
    bootstrap_port=0,
    progress_timeout_s=10,
    peer_timeout_s=1.5,
    heartbeat_interval_s=0.25,
    chunk_bytes=4096,
)
SPAWN = multiprocessing.get_context("spawn")
TIMEOUT_S = 60


def start_pair(
    cases, *, prefill_config=CONFIG, decode_config=CONFIG, prefill_behaviour="send", **decode_kwargs
):
    ports, results_p, results_d = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    prefill = SPAWN.Process(
        target=run_prefill, args=(cases, prefill_config, ports, results_p, prefill_behaviour)
    )
    prefill.start()
    port = ports.get(timeout=TIMEOUT_S)
    decode = SPAWN.Process(
        target=run_decode, args=(cases, decode_config, port, results_d), kwargs=decode_kwargs
    )
    decode.start()
    return prefill, decode, results_p, results_d, port


def collect(results, count):
    out = [results.get(timeout=TIMEOUT_S) for _ in range(count)]
    errors = [r for r in out if r[0] == "error"]
    assert not errors, errors[0][1]
    return out


def finish(*processes):
    for process in processes:
        process.join(timeout=TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)


@pytest.mark.parametrize("draft", [False, True], ids=["target_only", "with_draft_layers"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_pages_and_metadata_arrive_bit_exact(page_size, draft):
    # Two rooms per pair. Page size 1 carries a hidden-state row (EAGLE-like), 16 none.
    hidden = page_size == 1
    cases = [
        Case(room=room, page_size=page_size, draft=draft, hidden=hidden, prefill_pages=pages)
        for room, pages in ((100 + page_size, (5, 2, 9)), (200 + page_size, (19, 0, 4)))
    ]
    prefill, decode, results_p, results_d, _ = start_pair(cases)
    decoded = collect(results_d, len(cases))
    sent = collect(results_p, len(cases) + 1)
    finish(prefill, decode)
    for room, state, detail, _ in decoded:
        assert state == "SUCCESS", detail
        assert detail == (True, True), f"room {room}: pages exact, metadata exact = {detail}"
    assert [s[1] for s in sent[:-1]] == ["SUCCESS"] * len(cases)


MISMATCHES = [
    ({"page_size": 32}, "page_size: prefill 16 != decode 32"),
    ({"kv_dtype": "float16"}, "kv_dtype: prefill 'bfloat16' != decode 'float16'"),
    ({"num_layers": 4}, "num_layers: prefill 3 != decode 4"),
    ({"spec_spec_hidden_size": 16}, "spec.spec_hidden_size: prefill 8 != decode 16"),
    ({"spec_topk": 4}, "spec.topk: prefill 2 != decode 4"),
    ({"spec_algorithm": "EAGLE3"}, "spec.algorithm: prefill 'EAGLE' != decode 'EAGLE3'"),
]


@pytest.mark.parametrize(
    ("changes", "message"), MISMATCHES, ids=[m[1].split(":")[0] for m in MISMATCHES]
)
def test_handshake_mismatch_fails_both_sides_naming_the_field(changes, message):
    cases = [Case(room=300)]
    prefill, decode, results_p, results_d, _ = start_pair(cases, layout_changes=changes)
    ((_, d_state, d_reason, elapsed),) = collect(results_d, 1)
    (_, p_state, p_reason), _malformed = collect(results_p, 2)
    finish(prefill, decode)
    assert d_state == "FAILED" and message in d_reason
    assert p_state == "FAILED" and message in p_reason
    assert elapsed < 5.0, "a mismatch must fail fast, not at a deadline"


def test_wrong_token_is_refused_on_both_sides():
    """Decode sees at once that prefill cannot prove the token and sends it nothing more;
    prefill never accepts the room (a peer that did not authenticate cannot even fail a
    room), so its room ends at its own deadline."""
    cases = [Case(room=400)]
    prefill, decode, results_p, results_d, _ = start_pair(
        cases,
        prefill_config=TransferConfig(
            **{**vars_of(CONFIG), "auth_token": "s3cret", "progress_timeout_s": 6}
        ),
        decode_config=TransferConfig(**{**vars_of(CONFIG), "auth_token": "guess"}),
    )
    ((_, d_state, d_reason, _),) = collect(results_d, 1)
    (_, p_state, p_reason), _ = collect(results_p, 2)
    finish(prefill, decode)
    assert d_state == "FAILED" and "authentication failed" in d_reason
    assert p_state == "FAILED" and "timed out" in p_reason and "BOOTSTRAPPING" in p_reason


def vars_of(config: TransferConfig) -> dict:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def test_decode_abort_stops_the_sender():
    cases = [Case(room=500)]
    prefill, decode, results_p, results_d, _ = start_pair(
        cases, prefill_behaviour="hold", abort_after_request=True
    )
    collect(results_d, 1)
    (_, p_state, p_reason), _ = collect(results_p, 2)
    finish(prefill, decode)
    assert p_state == "FAILED" and "client went away" in p_reason


def test_prefill_killed_mid_transfer_fails_the_room_within_the_peer_deadline():
    cases = [Case(room=600)]
    prefill, decode, _, results_d, _ = start_pair(
        cases, prefill_behaviour="partial", report_first_piece=True
    )
    ((_, state, _, _),) = collect(results_d, 1)
    assert state == "TRANSFERRING"  # decode holds the first piece: the prefill dies mid-room
    killed_at = time.monotonic()
    os.kill(prefill.pid, signal.SIGKILL)
    ((_, state, reason, _),) = collect(results_d, 1)
    noticed_after = time.monotonic() - killed_at
    finish(prefill, decode)
    assert state == "FAILED" and "silent" in reason
    assert noticed_after < CONFIG.peer_timeout_s + 3.0


def test_malformed_and_oversize_frames_are_rejected_and_serving_continues():
    cases = [Case(room=700)]
    ports, results_p, results_d = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    prefill = SPAWN.Process(target=run_prefill, args=(cases, CONFIG, ports, results_p))
    prefill.start()
    port = ports.get(timeout=TIMEOUT_S)
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(f"tcp://127.0.0.1:{port}")
    rogue.send(b"\xc1\xc1 not msgpack")
    rogue.send(
        msgpack.packb(
            {
                "t": "transfer_request",
                "v": 1,
                "b": {"room": 1, "page_ids": "x", "draft_page_ids": []},
            }
        )
    )
    rogue.send(b"\x00" * (65 << 20))  # past zmq.MAXMSGSIZE: the connection is dropped
    decode = SPAWN.Process(target=run_decode, args=(cases, CONFIG, port, results_d))
    decode.start()
    ((_, state, detail, _),) = collect(results_d, 1)
    sent = collect(results_p, 2)
    finish(prefill, decode)
    rogue.close()
    context.term()
    assert state == "SUCCESS" and detail == (True, True)
    assert sent[-1][0] == "malformed" and sent[-1][1] == 2


GLOO = TransferConfig(**{**vars_of(CONFIG), "backend": "gloo"})


@pytest.mark.parametrize(("page_size", "draft"), [(1, False), (16, True)])
def test_gloo_backend_moves_pages_and_metadata_bit_exact(page_size, draft):
    cases = [
        Case(
            room=room, page_size=page_size, draft=draft, hidden=page_size == 1, prefill_pages=pages
        )
        for room, pages in ((800 + page_size, (5, 2, 9)), (900 + page_size, (19, 0, 4)))
    ]
    prefill, decode, results_p, results_d, _ = start_pair(
        cases, prefill_config=GLOO, decode_config=GLOO
    )
    decoded = collect(results_d, len(cases))
    sent = collect(results_p, len(cases) + 1)
    finish(prefill, decode)
    assert [d[1:3] for d in decoded] == [("SUCCESS", (True, True))] * len(cases), decoded
    assert [s[1] for s in sent[:-1]] == ["SUCCESS"] * len(cases)


def test_backend_mismatch_is_named():
    cases = [Case(room=1000)]
    prefill, decode, results_p, results_d, _ = start_pair(
        cases, prefill_config=CONFIG, decode_config=GLOO
    )
    ((_, d_state, d_reason, _),) = collect(results_d, 1)
    collect(results_p, 2)
    finish(prefill, decode)
    assert d_state == "FAILED" and "transfer backend: prefill 'tcp' != decode 'gloo'" in d_reason
