"""`Channel` over real sockets (inproc and loopback tcp): what goes out arrives typed, with its
sender and payload; what should not be accepted raises ProtocolError; the options hold."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from pdserve.protocol.channel import Channel, Received
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.engine_messages import AbortRequest, Shutdown

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


ARRIVES_MS = 5000  # a message on loopback arrives well within this
DROPPED_MS = 500  # how long an oversize message is given to (wrongly) arrive


@pytest.fixture(scope="module")
def context():
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def make(context):
    """Channels that are closed when the test ends."""
    made = []

    def channel(socket_type, accepts=(), ctx=None, **options) -> Channel:
        made.append(Channel(ctx or context, socket_type, accepts, **options))
        return made[-1]

    yield channel
    for channel in made:
        channel.close()


@pytest.fixture
def pipe(make, request):
    """A connected PUSH -> PULL pair (inproc) whose PULL accepts AbortRequest."""
    address = f"inproc://{request.node.name}"
    pull = make(zmq.PULL, (AbortRequest,))
    pull.bind(address)
    push = make(zmq.PUSH)
    push.connect(address)
    return push, pull


@pytest.fixture
def router_dealer(make):
    """A ROUTER (tcp, random port) and a DEALER named b"decode-1" connected to it; each
    accepts one payload frame."""
    router = make(zmq.ROUTER, (AbortRequest, Shutdown), max_payload_frames=1)
    port = router.bind_random_port("tcp://127.0.0.1")
    dealer = make(zmq.DEALER, (AbortRequest,), max_payload_frames=1)
    dealer.socket.setsockopt(zmq.IDENTITY, b"decode-1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


def receive(channel: Channel, **kwargs) -> Received:
    assert channel.socket.poll(ARRIVES_MS), "nothing arrived"
    return channel.receive(**kwargs)


def test_push_pull_round_trip(pipe):
    push, pull = pipe
    push.send(AbortRequest("r1"))
    assert receive(pull) == Received(AbortRequest("r1"), None, ())


def test_router_dealer_identity_and_payload(router_dealer):
    router, dealer = router_dealer
    dealer.send(Shutdown("bye"), b"kv bytes")
    got = receive(router)
    assert got == Received(Shutdown("bye"), b"decode-1", (b"kv bytes",))
    router.send(AbortRequest("r2"), b"chunk", to=got.sender)
    reply = receive(dealer, copy=False)
    assert (reply.msg, reply.sender) == (AbortRequest("r2"), None)
    assert [frame.bytes for frame in reply.payload] == [b"chunk"]


def test_router_must_name_the_peer_and_others_must_not(make):
    with pytest.raises(ValueError, match="ROUTER"):
        make(zmq.ROUTER).frames(Shutdown())
    with pytest.raises(ValueError, match="ROUTER"):
        make(zmq.DEALER).frames(Shutdown(), to=b"someone")


def test_router_send_to_unknown_peer_raises(make):
    router = make(zmq.ROUTER)
    router.bind_random_port("tcp://127.0.0.1")
    with pytest.raises(zmq.ZMQError) as raised:
        router.send(Shutdown(), to=b"nobody", flags=zmq.NOBLOCK)
    assert raised.value.errno == zmq.EHOSTUNREACH


def test_unexpected_type_raises_and_the_channel_goes_on(pipe):
    push, pull = pipe
    push.send(Shutdown("not for you"))
    push.send(AbortRequest("r3"))
    with pytest.raises(ProtocolError, match="unexpected message type 'shutdown'"):
        receive(pull)
    assert receive(pull).msg == AbortRequest("r3")


def test_malformed_body_raises(pipe):
    push, pull = pipe
    push.socket.send(b"\xc1 not msgpack")
    with pytest.raises(ProtocolError, match="undecodable"):
        receive(pull)


def test_payload_frames_beyond_the_limit_raise(pipe, router_dealer):
    push, pull = pipe
    push.send(AbortRequest("r4"), b"unasked payload")
    with pytest.raises(ProtocolError, match="2 frames"):
        receive(pull)
    router, dealer = router_dealer
    dealer.send(Shutdown(), b"one", b"two")
    with pytest.raises(ProtocolError, match="3 frames"):
        receive(router)


def test_frames_are_what_arrives(pipe, router_dealer):
    push, pull = pipe
    push.send(AbortRequest("r6"), b"payload")
    assert pull.socket.poll(ARRIVES_MS)
    assert pull.socket.recv_multipart() == push.frames(AbortRequest("r6"), b"payload")
    # A ROUTER's frames, sent as they are (as a send queue does), reach the peer minus the
    # identity frame; the peer's channel reads them as the message and its payload.
    router, dealer = router_dealer
    dealer.send(Shutdown())
    identity = receive(router).sender
    frames = router.frames(AbortRequest("r7"), b"kv", to=identity)
    router.socket.send_multipart(frames, zmq.NOBLOCK)
    assert dealer.socket.poll(ARRIVES_MS)
    assert dealer.socket.recv_multipart() == frames[1:]
    router.socket.send_multipart(frames, zmq.NOBLOCK)
    assert receive(dealer) == Received(AbortRequest("r7"), None, (b"kv",))


def test_oversize_message_is_dropped(make):
    pull = make(zmq.PULL, (AbortRequest,), max_message_bytes=1024)
    port = pull.bind_random_port("tcp://127.0.0.1")
    push = make(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    push.send(AbortRequest("small"))
    assert receive(pull).msg == AbortRequest("small")
    push.send(AbortRequest("x" * 2048))
    assert pull.socket.poll(DROPPED_MS) == 0, "a frame over MAXMSGSIZE arrived"


def test_receive_without_waiting_raises_again(pipe):
    _, pull = pipe
    with pytest.raises(zmq.Again):
        pull.receive(zmq.NOBLOCK)


@pytest.mark.timeout(30)  # without a send timeout the send blocks forever
def test_send_timeout(make):
    push = make(zmq.PUSH, send_timeout_ms=50)
    push.bind_random_port("tcp://127.0.0.1")  # no peer: nowhere to queue the message
    with pytest.raises(zmq.Again):
        push.send(Shutdown())


def test_options_are_set(make):
    channel = make(zmq.DEALER, max_message_bytes=4096)
    channel.connect("tcp://[::1]:1")
    assert channel.socket.getsockopt(zmq.LINGER) == 0
    assert channel.socket.getsockopt(zmq.MAXMSGSIZE) == 4096
    assert channel.socket.getsockopt(zmq.IPV6) == 1
    assert make(zmq.DEALER).socket.getsockopt(zmq.IPV6) == 0


def test_receive_async(make):
    """The front end's case: sent from a plain context, received on a zmq.asyncio one."""
    async_context = zmq.asyncio.Context()
    pull = Channel(async_context, zmq.PULL, (AbortRequest,))
    try:
        port = pull.bind_random_port("tcp://127.0.0.1")
        push = make(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(AbortRequest("r8"))
        received = asyncio.run(asyncio.wait_for(pull.receive_async(), ARRIVES_MS / 1000))
        assert received == Received(AbortRequest("r8"), None, ())
    finally:
        pull.close()
        async_context.term()
