"""The bounds on connections to a prefill worker's bootstrap port (in all and per source
address), and how a decode worker refused by them fails: at once, by name, and not for good.
Both sides in one process on loopback; other hosts are other 127/8 source addresses."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from pdserve.protocol.failures import FailureKind
from pdserve.transfer.bootstrap_connections import normal_address
from pdserve.transfer.room_state import TransferState
from tests.unit.transfer.test_transfer_hardening import finished
from tests.unit.transfer.test_transfer_in_process import CONFIG, Case, start_pair
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


@pytest.fixture
def zmq_context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


class Client:
    """A raw ZMTP connection to the bootstrap port from `source`, watched by a monitor."""

    def __init__(self, context: zmq.Context, port: int, source: str = "127.0.0.1"):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.monitor = self.socket.get_monitor_socket()
        self.socket.connect(f"tcp://{source}:0;127.0.0.1:{port}")

    def handshake_outcome(self, timeout_s: float = 10) -> int:
        """How the handshake ended, as the monitor reports it."""
        ends = (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        deadline = time.monotonic() + timeout_s
        while self.monitor.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            if event in ends:
                return event
        raise TimeoutError(f"no handshake outcome in {timeout_s} s")

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)


def connect_one_by_one(context, port: int, count: int, source: str = "127.0.0.1"):
    """`count` clients, each counted by the server before the next one comes; and their
    handshakes' outcomes."""
    clients, outcomes = [], []
    for _ in range(count):
        clients.append(Client(context, port, source))
        outcomes.append(clients[-1].handshake_outcome())
    return clients, outcomes


def test_connections_to_the_bootstrap_port_beyond_the_limit_are_refused(zmq_context):
    config = dataclasses.replace(CONFIG, max_bootstrap_connections=4)
    pair = start_pair(config)
    server = pair.server
    try:
        clients, outcomes = connect_one_by_one(zmq_context, server.port, 10)
        assert outcomes.count(zmq.EVENT_HANDSHAKE_SUCCEEDED) == config.max_bootstrap_connections
        assert outcomes.count(zmq.EVENT_HANDSHAKE_FAILED_AUTH) == 10 - 4
        for client in clients:
            client.close()
        wait_until(lambda: server.connections.open == 0, "the clients to be gone", 10)
        pair.transfer(Case(room=51))  # a decode worker gets in once they left
    finally:
        pair.client.stop()
        server.stop()


def test_one_host_cannot_take_every_connection_to_the_bootstrap_port(zmq_context):
    """One host opens as many idle connections as the port takes in all: only its share is
    accepted, and decode workers on other hosts still connect and register."""
    config = dataclasses.replace(
        CONFIG, max_bootstrap_connections=4, max_bootstrap_connections_per_host=2
    )
    pair = start_pair(config)
    server = pair.server
    try:
        clients, outcomes = connect_one_by_one(zmq_context, server.port, 4, "127.0.0.2")
        assert (
            outcomes == [zmq.EVENT_HANDSHAKE_SUCCEEDED] * 2 + [zmq.EVENT_HANDSHAKE_FAILED_AUTH] * 2
        )
        opened = server.connections.open_from
        wait_until(lambda: opened.get("127.0.0.2") == 2, "the refused ones to be gone", 10)
        other = Client(zmq_context, server.port, "127.0.0.3")
        assert other.handshake_outcome() == zmq.EVENT_HANDSHAKE_SUCCEEDED
        pair.transfer(Case(room=52))  # the decode worker, from 127.0.0.1, registers
        for client in [*clients, other]:
            client.close()
        wait_until(lambda: server.connections.open <= 1, "the clients to be gone", 10)
        assert dict(server.connections.open_from) == {"127.0.0.1": 1}  # decode's own
    finally:
        pair.client.stop()
        server.stop()


@pytest.mark.parametrize(
    ("spelled", "normal"),
    [("127.0.0.2", "127.0.0.2"), ("::ffff:127.0.0.2", "127.0.0.2"), ("fe80::1%eth0", "fe80::1")],
)
def test_a_source_address_counts_the_same_however_it_is_spelled(spelled, normal):
    assert normal_address(spelled) == normal


def test_a_decode_worker_refused_at_the_handshake_fails_at_once_by_name(zmq_context):
    """The prefill's port is full: decode's room fails with the reason long before its
    deadline or the peer timeout, and once there is room again the next request connects
    afresh."""
    config = dataclasses.replace(
        CONFIG, max_bootstrap_connections=1, peer_timeout_s=30, progress_timeout_s=30
    )
    pair = start_pair(config)
    server = pair.server
    try:
        holder = Client(zmq_context, server.port)
        assert holder.handshake_outcome() == zmq.EVENT_HANDSHAKE_SUCCEEDED
        receiver = pair.client.receiver(53, "127.0.0.1", server.port, [1, 2])
        wait_until(lambda: finished(receiver), "decode's room to fail", 5)
        failure = receiver.failure
        assert failure.kind is FailureKind.HANDSHAKE, failure
        assert f"prefill peer tcp://127.0.0.1:{server.port} refused the connection" in (
            failure.message
        )
        assert "too many connections to its bootstrap port" in failure.message
        assert receiver.poll() is TransferState.FAILED
        holder.close()
        wait_until(lambda: server.connections.open == 0, "the holder to be gone", 10)
        pair.transfer(Case(room=54))
    finally:
        pair.client.stop()
        server.stop()


def test_a_connection_that_never_handshakes_is_closed():
    pair = start_pair(CONFIG)
    try:
        raw = socket.create_connection(("127.0.0.1", pair.server.port), timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and raw.recv(64):
            pass  # the server's greeting; then it closes the connection
        assert time.monotonic() < deadline, "still open after 10 s"
        raw.close()
    finally:
        pair.client.stop()
        pair.server.stop()
