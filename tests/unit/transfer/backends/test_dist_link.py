"""PairLink over gloo between real processes on loopback: the nccl code path, run on CPU."""

from __future__ import annotations

import multiprocessing
import socket
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.transfer.backends.dist.dist_link import (
    DECODE_RANK,
    PREFILL_RANK,
    LinkError,
    LinkTimeout,
    PairLink,
)
from pdserve.transfer.backends.dist.dist_store import DecodeStoreServer, client_store

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


SPAWN = multiprocessing.get_context("spawn")
HOST = "127.0.0.1"
WAIT_S = 30.0  # any join, queue read or event wait in this file; far above what a pass takes
SEND_S = 20.0

# (dtype, element count): 1 element up to 64 MiB, odd sizes in between.
PAYLOADS = [
    (torch.float32, 1),
    (torch.bfloat16, 3),
    (torch.int64, 1000),
    (torch.uint8, 12_345),
    (torch.bfloat16, (1 << 20) + 7),
    (torch.float32, 16 << 20),
]
SMALL_PAYLOADS = PAYLOADS[:5]


def make_payload(index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The same tensor on both sides: seeded by its index in the payload list."""
    generator = torch.Generator().manual_seed(1000 + index)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=dtype, generator=generator)
    return torch.randint(-(2**62), 2**62, (numel,), dtype=dtype, generator=generator)


def bit_exact(received: torch.Tensor, index: int, dtype: torch.dtype, numel: int) -> bool:
    expected = make_payload(index, dtype, numel)
    return torch.equal(received.view(torch.uint8), expected.view(torch.uint8))


def pair_name(prefill_id: str, decode_id: str = "d0") -> str:
    return f"pair/{prefill_id}/{decode_id}/{uuid.uuid4().hex}"


# --- child processes (spawned: they re-import this module) -------------------------------


def report(results, body) -> None:
    """Run body(); put ("ok", value) or ("error", traceback) on the results queue."""
    try:
        results.put(("ok", body()))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def run_decode(ports, results, pair_names, payloads, scenario, posted) -> None:
    """Serve the store, join every pair, then receive as `scenario` says."""
    server = DecodeStoreServer(HOST)
    ports.put(server.port)

    def body():
        links = [
            PairLink.connect(
                backend="gloo",
                store=server.store,
                pair_name=name,
                rank=DECODE_RANK,
                timeout_s=WAIT_S,
                local_host=HOST,
            )
            for name in pair_names
        ]
        try:
            if scenario == "recv":
                return [receive_in_order(link, payloads) for link in links]
            if scenario == "irecv":
                return receive_posted_first(links, payloads, posted)
            return receive_nothing(links[0])
        finally:
            for link in links:
                link.close()

    report(results, body)
    server.close()


def receive_in_order(link: PairLink, payloads) -> list[bool]:
    exact = []
    for index, (dtype, numel) in enumerate(payloads):
        buffer = torch.empty(numel, dtype=dtype)
        link.recv(buffer, timeout_s=SEND_S)
        exact.append(bit_exact(buffer, index, dtype, numel))
    return exact


def receive_posted_first(links: list[PairLink], payloads, posted) -> list[list[bool]]:
    """Post every receive on every link, tell the senders, then wait for all of them."""
    buffers = [[torch.empty(n, dtype=dtype) for dtype, n in payloads] for _ in links]
    pending = [
        [link.irecv(buffer) for buffer in link_buffers]
        for link, link_buffers in zip(links, buffers, strict=True)
    ]
    posted.set()
    for link_pending in pending:
        for transfer in link_pending:
            transfer.wait(SEND_S)
    return [
        [
            bit_exact(b, i, dtype, n)
            for i, (b, (dtype, n)) in enumerate(zip(bs, payloads, strict=True))
        ]
        for bs in buffers
    ]


def receive_nothing(link: PairLink) -> tuple:
    """recv from a peer that never sends: the LinkTimeout, its time, then the next call."""
    started = time.monotonic()
    try:
        link.recv(torch.empty(3, dtype=torch.float32), timeout_s=1.5)
        return ("no error", "", 0.0, "")
    except LinkTimeout as exc:
        first = (type(exc).__name__, str(exc), time.monotonic() - started)
    try:
        link.recv(torch.empty(3), timeout_s=1.5)
        return (*first, "no error")
    except LinkError as exc:
        return (*first, type(exc).__name__)


def run_prefill(port, results, name, payloads, posted, release) -> None:
    """Join the pair and send the payloads (after `posted`, if given); or, with `release`,
    stay joined without sending until released."""

    def body():
        store = client_store(HOST, port, WAIT_S)
        with PairLink.connect(
            backend="gloo",
            store=store,
            pair_name=name,
            rank=PREFILL_RANK,
            timeout_s=WAIT_S,
            local_host=HOST,
        ) as link:
            if release is not None:
                return release.wait(WAIT_S)
            if posted is not None and not posted.wait(WAIT_S):
                raise TimeoutError("decode never posted its receives")
            for index, (dtype, numel) in enumerate(payloads):
                link.send(make_payload(index, dtype, numel), timeout_s=SEND_S)
            return len(payloads)

    report(results, body)


# --- the parent's side ------------------------------------------------------------------


def take(queue):
    status, value = queue.get(timeout=WAIT_S)
    assert status == "ok", value
    return value


def finish(*processes) -> list[int | None]:
    for process in processes:
        process.join(timeout=WAIT_S)
        if process.is_alive():
            process.kill()
            process.join(timeout=WAIT_S)
    return [process.exitcode for process in processes]


def start_decode(pair_names, payloads, scenario, posted=None):
    ports, results = SPAWN.Queue(), SPAWN.Queue()
    decode = SPAWN.Process(
        target=run_decode, args=(ports, results, pair_names, payloads, scenario, posted)
    )
    decode.start()
    return decode, ports.get(timeout=WAIT_S), results


def start_prefill(port, name, payloads, posted=None, release=None):
    results = SPAWN.Queue()
    prefill = SPAWN.Process(
        target=run_prefill, args=(port, results, name, payloads, posted, release)
    )
    prefill.start()
    return prefill, results


def test_tensors_arrive_bit_exact_from_1_element_to_64_mib():
    name = pair_name("p0")
    decode, port, decoded = start_decode([name], PAYLOADS, "recv")
    prefill, sent = start_prefill(port, name, PAYLOADS)
    try:
        assert take(sent) == len(PAYLOADS)
        assert take(decoded) == [[True] * len(PAYLOADS)]
    finally:
        assert finish(prefill, decode) == [0, 0]


def test_receive_posted_before_the_send():
    name, posted = pair_name("p0"), SPAWN.Event()
    decode, port, decoded = start_decode([name], SMALL_PAYLOADS, "irecv", posted)
    prefill, sent = start_prefill(port, name, SMALL_PAYLOADS, posted=posted)
    try:
        assert take(sent) == len(SMALL_PAYLOADS)
        assert take(decoded) == [[True] * len(SMALL_PAYLOADS)]
    finally:
        assert finish(prefill, decode) == [0, 0]


def test_one_decode_holds_two_pair_groups_at_once():
    names, posted = [pair_name("p0"), pair_name("p1")], SPAWN.Event()
    decode, port, decoded = start_decode(names, SMALL_PAYLOADS, "irecv", posted)
    prefills = [start_prefill(port, name, SMALL_PAYLOADS, posted=posted) for name in names]
    try:
        assert [take(sent) for _, sent in prefills] == [len(SMALL_PAYLOADS)] * 2
        assert take(decoded) == [[True] * len(SMALL_PAYLOADS)] * 2
    finally:
        assert finish(*(p for p, _ in prefills), decode) == [0, 0, 0]


def test_recv_without_a_sender_times_out_and_fails_the_link():
    name, release = pair_name("p0"), SPAWN.Event()
    decode, port, decoded = start_decode([name], [], "timeout")
    prefill, sent = start_prefill(port, name, [], release=release)
    try:
        kind, message, elapsed, next_call = take(decoded)
    finally:
        release.set()
        exitcodes = finish(prefill, decode)
    assert kind == "LinkTimeout", message
    assert 1.4 <= elapsed < 10.0
    for part in (name, "recv", "12 bytes", "1.5 s"):
        assert part in message
    assert next_call == "LinkError"
    assert take(sent) is True
    assert exitcodes == [0, 0]


# --- in-process: deadlines on joining, argument checks -----------------------------------


@pytest.fixture
def server():
    store_server = DecodeStoreServer(HOST)
    yield store_server
    store_server.close()


@pytest.mark.parametrize("rank", [PREFILL_RANK, DECODE_RANK])
def test_connect_raises_when_the_peer_never_joins(server, rank):
    store = server.store if rank == DECODE_RANK else client_store(HOST, server.port, 5)
    started = time.monotonic()
    with pytest.raises(LinkTimeout, match="did not join within 1 s"):
        PairLink.connect(
            backend="gloo",
            store=store,
            pair_name=pair_name("p0"),
            rank=rank,
            timeout_s=1.0,
            local_host=HOST,
        )
    assert time.monotonic() - started < 5.0


def test_client_store_raises_when_nothing_listens():
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(LinkTimeout, match=f"{HOST}:{port}"):
        client_store(HOST, port, 1.0)
    # NOTE: torch's client retries once after a randomized back-off, so allow a few seconds.
    assert time.monotonic() - started < 8.0


def test_server_binds_the_given_port(server):
    assert server.host == HOST and server.port > 0
    with pytest.raises(OSError):
        DecodeStoreServer(HOST, server.port)


@pytest.fixture
def local_pair(server):
    """A prefill and a decode link in this process (threads only for the joint connect)."""
    name = pair_name("p0")
    client = client_store(HOST, server.port, 5)
    with ThreadPoolExecutor(2) as pool:
        joins = [
            pool.submit(
                PairLink.connect,
                backend="gloo",
                store=store,
                pair_name=name,
                rank=rank,
                timeout_s=5,
                local_host=HOST,
            )
            for rank, store in ((PREFILL_RANK, client), (DECODE_RANK, server.store))
        ]
        prefill, decode = (join.result(timeout=WAIT_S) for join in joins)
    yield prefill, decode
    prefill.close()
    decode.close()


def test_non_contiguous_tensor_raises_and_leaves_the_link_usable(local_pair):
    prefill, decode = local_pair
    strided = torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match="contiguous"):
        prefill.send(strided, timeout_s=1)
    with pytest.raises(ValueError, match="contiguous"):
        decode.recv(strided, timeout_s=1)
    with pytest.raises(ValueError, match="contiguous"):
        decode.irecv(strided[::2])
    received = torch.zeros(4)
    pending = decode.irecv(received)
    prefill.send(torch.arange(4.0), timeout_s=5)
    pending.wait(5)
    assert received.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert prefill.failed is None and decode.failed is None


def test_gloo_link_refuses_tensors_off_the_cpu(local_pair):
    _, decode = local_pair
    with pytest.raises(ValueError, match="meta"):
        decode.irecv(torch.empty(4, device="meta"))


def test_closed_link_raises_link_error(local_pair):
    prefill, _ = local_pair
    prefill.close()
    prefill.close()
    with pytest.raises(LinkError, match="closed"):
        prefill.send(torch.zeros(1), timeout_s=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"backend": "mpi"}, "unknown link backend"),
        ({"rank": 2}, "rank must be"),
        ({"timeout_s": 0}, "timeout must be positive"),
        ({"device": torch.device("cuda", 0)}, "CPU tensors only"),
        ({"backend": "nccl"}, "needs a CUDA device"),
    ],
)
def test_connect_rejects_bad_arguments(server, overrides, message):
    arguments = {
        "backend": "gloo",
        "store": server.store,
        "pair_name": pair_name("p0"),
        "rank": DECODE_RANK,
        "timeout_s": 1.0,
        **overrides,
    }
    with pytest.raises(ValueError, match=message):
        PairLink.connect(**arguments)


# --- the nccl wait path, on a stand-in group (no GPU here) ------------------------------


class FakeWork:
    """Completes after `polls` checks (never, if None); counts wait() calls."""

    def __init__(self, polls: int | None):
        self.polls, self.waits = polls, 0

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        return True


class FakeNcclGroup:
    def __init__(self, work: FakeWork):
        self.work, self.aborted = work, 0

    def send(self, tensors, peer, tag) -> FakeWork:
        return self.work

    recv = send

    def abort(self) -> None:
        self.aborted += 1


def fake_nccl_link(work: FakeWork) -> tuple[PairLink, FakeNcclGroup]:
    group = FakeNcclGroup(work)
    link = PairLink(
        group, backend="nccl", pair_name="pair/fake", rank=DECODE_RANK, device=torch.device("cpu")
    )
    return link, group


def test_nccl_wait_polls_until_complete_then_orders_the_stream():
    link, group = fake_nccl_link(FakeWork(polls=5))
    link.recv(torch.empty(2), timeout_s=5)
    assert group.work.waits == 1
    assert group.aborted == 0 and link.failed is None


def test_nccl_timeout_aborts_the_group_before_raising():
    link, group = fake_nccl_link(FakeWork(polls=None))
    started = time.monotonic()
    with pytest.raises(LinkTimeout, match=r"recv of 8 bytes did not complete within 0\.2 s"):
        link.recv(torch.empty(2), timeout_s=0.2)
    assert time.monotonic() - started < 2.0
    assert group.aborted == 1 and group.work.waits == 0
    with pytest.raises(LinkError, match="failed link"):
        link.irecv(torch.empty(2))
    link.close()
    assert group.aborted == 1  # a failed link was aborted already; close does not need to
