"""Torch-free guards of the transfer layer: the allow list, the handshake proofs, the
rate-limited log, and held deadlines."""

from __future__ import annotations

import logging

import pytest

from pdserve.protocol.log_limit import RateLimitedLog
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.peer_allow import (
    PeerAllowList,
    PeerNotAllowed,
    default_allow_list,
    parse_allow_list,
    zmq_endpoint,
)
from pdserve.transfer.peer_auth import (
    NONCE_BYTES,
    NonceError,
    check_nonce,
    decode_proof,
    new_nonce,
    prefill_proof,
    proof_ok,
)
from pdserve.transfer.room_state import RoomState, TransferState


def test_allow_list_takes_addresses_and_cidrs_and_names_a_bad_entry():
    allow = PeerAllowList(parse_allow_list(["10.0.0.0/8", " 192.168.1.7 ", "fd00::/8", ""]))
    assert allow.resolve("10.1.2.3") == "10.1.2.3"
    assert allow.resolve("[fd00::1]") == "fd00::1"
    with pytest.raises(PeerNotAllowed, match=r"192\.168\.1\.8"):
        allow.resolve("192.168.1.8")
    with pytest.raises(ValueError, match=r"'10\.0\.0\.0/33'"):
        parse_allow_list(["10.0.0.0/33"])
    with pytest.raises(ValueError, match="not-an-address"):
        TransferConfig(bootstrap_allow=("not-an-address",))


def test_host_names_are_resolved_once_and_checked_after_resolution():
    allow = PeerAllowList(parse_allow_list(["127.0.0.1/32"]))
    assert allow.resolve("localhost") == "127.0.0.1"  # NOTE: /etc/hosts, no DNS traffic
    for garbage in ("a b", "x" * 300, "host:1", "../etc", ""):
        with pytest.raises(PeerNotAllowed, match="not an IP address or a host name"):
            allow.resolve(garbage)


def test_default_allows_loopback_and_our_own_network_only():
    allow = PeerAllowList(default_allow_list("10.20.30.40"))
    assert allow.resolve("127.0.0.5") == "127.0.0.5"
    assert allow.resolve("10.20.30.99") == "10.20.30.99"
    with pytest.raises(PeerNotAllowed):
        allow.resolve("203.0.113.9")  # documentation range: never attached here
    assert zmq_endpoint("::1", 5) == "tcp://[::1]:5"


def test_proofs_bind_the_role_both_nonces_and_the_token():
    nonce_d, nonce_p = new_nonce(), new_nonce()
    assert len(nonce_d) == NONCE_BYTES and nonce_d != nonce_p
    proof = prefill_proof("t", nonce_d, nonce_p)
    assert proof_ok(proof, prefill_proof("t", nonce_d, nonce_p))
    assert not proof_ok(proof, prefill_proof("other", nonce_d, nonce_p))
    assert not proof_ok(proof, prefill_proof("t", new_nonce(), nonce_p))
    assert not proof_ok(proof, decode_proof("t", nonce_d, nonce_p))  # roles never swap
    with pytest.raises(NonceError):
        check_nonce(b"short")


def test_rate_limited_log_bursts_then_throttles_and_reports_what_it_dropped(caplog):
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("guards"), per_second=1, burst=2, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="guards"):
        written = [log.warning("bad %d", i) for i in range(10)]
        now[0] = 1.0
        assert log.warning("bad again")
    assert written == [True, True] + [False] * 8
    assert caplog.records[-1].getMessage() == "bad again (8 similar lines suppressed)"


def test_a_held_room_waits_its_queue_limit_then_progress_counts_from_restart():
    now = [0.0]
    state = RoomState(1, progress_timeout_s=1, clock=lambda: now[0])
    state.advance(TransferState.WAITING_FOR_INPUT)
    state.hold(60)
    now[0] = 30
    assert not state.check_deadline()
    state.restart_clock()
    now[0] = 31.5
    assert state.check_deadline() and "limit 1 s" in state.failure.message


def test_kv_streams_in_64_mib_pieces_by_default_on_every_backend():
    for backend in ("tcp", "nccl", "gloo"):
        assert TransferConfig(backend=backend).piece_bytes == 64 << 20
    with pytest.raises(ValueError, match="--transfer-piece-bytes must be >= 0"):
        TransferConfig(piece_bytes=-1)
