"""The `ipc` backend with both sides in one process on CPU pools in shared memory (what a GPU
does over CUDA IPC, `tests/gpu` runs that): pieces written straight into decode's pages, out
of order and interleaved; a failed room's pages held until prefill says its writes are over,
or its process is gone; the handshake's and the transfer request's refusals."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from subprocess import PIPE

import pytest
import torch

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.transfer_messages import KVPiece, PoolHandle
from pdserve.transfer.backends.ipc.shared_pools import (
    SHARED_MEMORY,
    PoolMapError,
    ProcessWatch,
    export_pool,
    open_pool,
    process_gone,
    remove_counter_files,
)
from pdserve.transfer.decode_side import DecodeTransferClient
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.page_copy import copy_pages
from pdserve.transfer.page_ids import pack_page_ids, unpack_page_ids
from pdserve.transfer.prefill_side import PrefillTransferServer
from pdserve.transfer.room_state import TransferState
from tests.e2e.transfer_peers import Case, layout, metadata_spec, pools, record
from tests.unit.transfer.test_transfer_in_process import CONFIG
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


IPC = dataclasses.replace(CONFIG, backend="ipc")
DRAFT = Case(room=0, draft=True)


@dataclasses.dataclass
class IpcPair:
    server: PrefillTransferServer
    client: DecodeTransferClient
    source: KVStager  # prefill's pools (seeded)
    target: KVStager  # decode's pools, in shared memory


def start_ipc_pair(decode_pages: int = 30) -> IpcPair:
    source = KVStager(pools(DRAFT, 20, seed=7))
    server = PrefillTransferServer(
        IPC,
        layout(DRAFT),
        metadata_spec(DRAFT),
        "p",
        pools=[pool.storage for pool in source.pools],
    )
    server.start()
    target = KVStager(pools(DRAFT, decode_pages, seed=None))
    client = DecodeTransferClient(
        IPC,
        layout(DRAFT),
        metadata_spec(DRAFT),
        "d",
        target.page_bytes,
        pools=[pool.storage for pool in target.pools],
    )
    client.start()
    return IpcPair(server, client, source, target)


@contextlib.contextmanager
def running_ipc_pair(decode_pages: int = 30):
    started = start_ipc_pair(decode_pages)
    try:
        yield started
    finally:
        started.client.stop()
        started.server.stop()


@pytest.fixture
def pair():
    with running_ipc_pair() as started:
        yield started


def open_room(pair: IpcPair, case: Case):
    sender = pair.server.sender(case.room)
    pages = list(case.decode_pages)
    receiver = pair.client.receiver(case.room, "127.0.0.1", pair.server.port, pages, pages)
    wait_until(lambda: sender.poll() is TransferState.WAITING_FOR_INPUT, "the request", 20)
    return sender, receiver


def write_piece(pair: IpcPair, sender, case: Case, span: PageSpan, then=None) -> None:
    """What the prefill handoff does for a piece: write it into decode's pages, hand it on
    (`then`: the last piece, and the metadata record that finishes the room)."""
    peer_pools, peer_pages = sender.destination(span)
    pages = list(case.prefill_pages)
    pair.source.write(span.page_lists(pages, pages, 2), peer_pools, peer_pages)
    nbytes = span.nbytes(pair.source.page_bytes)
    sender.send_piece(OutgoingPiece(span, None, None, nbytes=nbytes, targets=peer_pools), then)


def exited_pid() -> int:
    """The id of a process that has exited."""
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(exited.stdout)


def assert_written(pair: IpcPair, case: Case) -> None:
    for pool, source in zip(pair.target.pools, pair.source.pools, strict=True):
        got = pool.storage[:, :, list(case.decode_pages)]
        assert torch.equal(got, source.storage[:, :, list(case.prefill_pages)])


def test_pieces_written_out_of_order_and_interleaved_land_in_decodes_pages(pair):
    a = Case(room=50, draft=True, prefill_pages=(5, 2, 9, 11), decode_pages=(0, 7, 3, 12))
    b = Case(room=51, draft=True, prefill_pages=(1, 4, 6, 8), decode_pages=(13, 1, 9, 2))
    sender_a, receiver_a = open_room(pair, a)
    sender_b, receiver_b = open_room(pair, b)
    write_piece(pair, sender_a, a, PageSpan(2, 2))
    write_piece(pair, sender_b, b, PageSpan(0, 3))
    write_piece(pair, sender_a, a, PageSpan(0, 1, 0, 4))
    write_piece(pair, sender_b, b, PageSpan(3, 1, 0, 4))
    sender_b.finish(record(b))
    write_piece(pair, sender_a, a, PageSpan(1, 1))
    sender_a.finish(record(a))
    for sender, receiver in ((sender_a, receiver_a), (sender_b, receiver_b)):
        wait_until(lambda r=receiver: r.poll() is TransferState.SUCCESS, "the room", 20)
        wait_until(lambda s=sender: s.poll() is TransferState.SUCCESS, "the ack", 20)
        assert receiver.pages_settled
    before = pair.target.pools[0].storage.clone()
    receiver_a.commit(pair.target)  # nothing left to write
    assert torch.equal(pair.target.pools[0].storage, before)
    assert_written(pair, a)
    assert_written(pair, b)
    assert pair.server.metrics.pieces_sent == 5
    assert pair.client.metrics.bytes_received == pair.server.metrics.bytes_sent > 0


def test_an_aborted_rooms_pages_are_held_until_prefills_write_in_flight_completes(pair):
    case = Case(room=60, draft=True)
    sender, receiver = open_room(pair, case)
    # A write given its destination and not handed on yet: it may still be running.
    destination = sender.destination(PageSpan(0, 1))
    assert destination is not None
    receiver.abort(FailureKind.ABORTED, "the client left")
    wait_until(lambda: sender.poll() is TransferState.FAILED, "prefill to learn of it", 10)
    pair.client.release(case.room)
    assert not receiver.pages_settled  # a write of prefill's is in flight
    assert sender.destination(PageSpan(1, 1)) is None  # the ended room takes no new write
    nbytes = PageSpan(0, 1).nbytes(pair.source.page_bytes)
    sender.send_piece(
        OutgoingPiece(PageSpan(0, 1), None, None, nbytes=nbytes, targets=destination[0])
    )
    wait_until(lambda: receiver.pages_settled, "prefill's RoomReleased", 10)
    assert case.room not in pair.client.unsettled


def test_a_prefill_failing_after_some_pieces_releases_the_pages_it_wrote(pair):
    case = Case(room=62, draft=True)
    sender, receiver = open_room(pair, case)
    write_piece(pair, sender, case, PageSpan(0, 2))
    wait_until(lambda: receiver.poll() is TransferState.TRANSFERRING, "the first piece", 20)
    sender.abort(FailureKind.INTERNAL, "the prefill step failed: CUDA error")
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "decode to learn of it", 10)
    assert "prefill: the prefill step failed" in receiver.failure.message
    wait_until(lambda: receiver.pages_settled, "prefill's RoomReleased", 10)
    open_room(pair, Case(room=63, draft=True))  # the pair stays usable


def test_rooms_that_never_reached_prefill_or_whose_prefill_is_gone_are_settled(pair):
    case = Case(room=64, draft=True)
    pages = list(case.decode_pages)
    receiver = pair.client.receiver(case.room, "127.0.0.1", 1, pages, pages)  # nobody there
    receiver.abort(FailureKind.ABORTED, "the client left")
    assert receiver.pages_settled  # no request went out: nothing can write
    _, receiver = open_room(pair, Case(room=65, draft=True))
    pid, writers = exited_pid(), pair.client.plane.writers
    assert process_gone(pid) and not process_gone(writers[receiver.entry])
    with pair.client.lock:
        writers[receiver.entry] = pid  # as if prefill had exited
    receiver.abort(FailureKind.ABORTED, "the client left")
    assert receiver.pages_settled


def test_a_transfer_request_with_page_ids_outside_decodes_pool_is_refused(pair):
    server = pair.server
    bad = unpack_page_ids(pack_page_ids([0, 30]), 2, 30)
    assert bad == "page ids outside [0, 30) of the decode worker's pool"
    assert unpack_page_ids(pack_page_ids([4, 4]), 2, 30) == "a page id given twice"
    assert unpack_page_ids(b"\x00" * 7, 2, 30) == "7 bytes of page ids for 2 pages"
    sender, receiver = open_room(pair, Case(room=66, draft=True))
    peer = sender.peer
    request = pair.client._transfer_request(receiver.entry)
    forged = dataclasses.replace(request, room=67, page_ids=pack_page_ids([0, 7, 99]))
    server.io.call(lambda: server._transfer_request(peer, forged))
    wait_until(lambda: server.sender(67).poll() is TransferState.FAILED, "the refusal", 10)
    assert "page ids outside [0, 30)" in server.sender(67).failure.message


def test_a_decode_worker_on_another_host_or_with_another_pool_shape_is_refused(monkeypatch):
    for change, expected in (
        (lambda plane: setattr(plane, "host", "elsewhere"), "one host, in one PID namespace"),
        (lambda plane: plane.pools.pop(), "decode shares 2 KV pools, prefill has 1"),
    ):
        pair = start_ipc_pair()
        try:
            change(pair.server.plane)
            case = Case(room=70, draft=True)
            pages = list(case.decode_pages)
            receiver = pair.client.receiver(case.room, "127.0.0.1", pair.server.port, pages, pages)
            wait_until(lambda r=receiver: r.poll() is TransferState.FAILED, "the refusal", 10)
            assert expected in receiver.failure.message
        finally:
            pair.client.stop()
            pair.server.stop()


def test_copy_pages_equals_index_copies():
    g = torch.Generator().manual_seed(0)
    for words, dtype in ((40, torch.int64), (3000, torch.int64), (33, torch.uint8)):
        src = torch.randint(0, 100, (4, 6, words), generator=g).to(dtype)
        dst = torch.zeros(4, 9, words, dtype=dtype)
        pages = torch.tensor([[0, 3, 5], [8, 1, 2]])
        copy_pages(src, dst, pages)
        expected = torch.zeros_like(dst)
        expected[:, pages[1]] = src[:, pages[0]]
        assert torch.equal(dst, expected)
    with pytest.raises(ValueError, match="different shapes"):
        copy_pages(src, torch.zeros(4, 9, 34, dtype=torch.uint8), pages)
    with pytest.raises(ValueError, match=r"\[2, n\]"):
        copy_pages(src, dst, pages[0])
    with pytest.raises(ValueError, match="contiguous"):
        copy_pages(src, dst, pages.t().contiguous().t())


def test_a_pool_handle_that_does_not_fit_ours_is_refused_before_anything_is_mapped(tmp_path):
    ours = pools(DRAFT, 4, seed=None)[0].storage
    theirs = pools(DRAFT, 9, seed=None)[0].storage  # NOTE: kept: its memory goes with it
    handle = export_pool(theirs)
    pid = os.getpid()  # NOTE: "decode" is this process: the segment is opened through /proc
    mapped = open_pool(handle, ours, peer="decode", pid=pid)
    assert list(mapped.shape[:2]) == list(ours.shape[:2]) and mapped.shape[2] == 9
    mapped[1, 2, 3] = 5  # one memory: a write through the mapping is decode's
    assert torch.equal(theirs[1, 2, 3], mapped[1, 2, 3]) and theirs[1, 2, 3].any()
    named = tmp_path / "pool"
    named.write_bytes(b"\0" * handle.size)
    pipe_read, pipe_write = os.pipe()
    os.close(pipe_write)
    with open(named, "rb+") as a_file, open(pipe_read, "rb") as a_pipe:
        for change, reason in (
            ({"kind": "cuda"}, "decode's KV pool is on cuda, ours on cpu"),
            ({"dtype": "float32"}, "decode's KV pool holds float32, ours bfloat16"),
            ({"shape": [2, 4, 9, 16, 2, 8]}, "only the page count may differ"),
            ({"size": handle.size * 2}, "handle says"),
            ({"fd": -1}, "names descriptor -1"),
            ({"fd": a_file.fileno()}, f"descriptor is '{named}', not a KV pool"),
            ({"fd": a_pipe.fileno()}, "descriptor is 'pipe:["),  # NOTE: refused unopened
        ):
            with pytest.raises(PoolMapError, match=re.escape(reason)):
                open_pool(dataclasses.replace(handle, **change), ours, peer="decode", pid=pid)
        assert named.read_bytes() == b"\0" * handle.size  # nothing was written to the file


def test_a_piece_announced_with_an_event_decode_cannot_wait_for_fails_the_room(pair):
    case = Case(room=80, draft=True)
    sender, receiver = open_room(pair, case)
    announcement = KVPiece(case.room, 0, 0, 1, 0, 0, PageSpan(0, 1).nbytes(pair.source.page_bytes))
    forged = dataclasses.replace(announcement, event=b"\x01" * 3)
    server, peer = pair.server, sender.peer
    server.io.call(lambda: server.send(peer, forged))
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "the check", 10)
    assert "KV piece 0: a 3-byte event for cpu" in receiver.failure.message
    wait_until(lambda: receiver.pages_settled, "prefill's RoomReleased", 10)


def test_pages_held_across_a_lost_connection_are_released_on_the_next_one(pair):
    server, client = pair.server, pair.client
    case = Case(room=90, draft=True)
    sender, receiver = open_room(pair, case)
    destination = sender.destination(PageSpan(0, 1))  # a write in flight
    peer = receiver.peer
    client.io.call(lambda: client.drop_peer(peer, FailureKind.PEER_LOST, "silent 5.0 s"))
    wait_until(lambda: receiver.poll() is TransferState.FAILED, "the room to fail", 10)
    client.release(case.room)
    assert not receiver.pages_settled and case.room in client.unsettled
    nbytes = PageSpan(0, 1).nbytes(pair.source.page_bytes)
    sender.send_piece(  # the write completes; its announcement goes to the lost connection
        OutgoingPiece(PageSpan(0, 1), None, None, nbytes=nbytes, targets=destination[0])
    )
    # The next room to that prefill worker opens a new connection, which asks again.
    open_room(pair, Case(room=91, draft=True))
    wait_until(lambda: receiver.pages_settled, "prefill's RoomReleased on the new connection", 10)
    assert case.room not in client.unsettled
    assert server.sender(case.room).poll() is TransferState.FAILED


def test_no_write_goes_to_a_decode_process_that_exited(pair):
    case = Case(room=95, draft=True)
    sender, _ = open_room(pair, case)
    pair.server.plane.decode_of(sender.peer).watch = ProcessWatch(exited_pid())  # decode died
    assert sender.destination(PageSpan(0, 1)) is None
    wait_until(lambda: sender.poll() is TransferState.FAILED, "prefill to drop the peer", 10)
    assert "decode peer d exited (its process is gone)" in sender.failure.message


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc"])
def test_a_process_watch_sees_an_exit_before_the_process_is_reaped(monkeypatch, pidfd):
    if not pidfd:
        monkeypatch.delattr("os.pidfd_open")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=PIPE)
    watch = ProcessWatch(child.pid)
    try:
        assert not watch.gone()
        child.stdin.close()  # it exits, and stays a zombie: nobody waits for it yet
        wait_until(watch.gone, "the exit to be seen", 10)
        assert process_gone(child.pid)  # a zombie (reaped below)
    finally:
        watch.close()
        child.wait(10)
    assert watch.gone()  # closed: asks /proc, where the reaped process is gone too


def test_a_process_watch_is_asked_from_two_threads_at_once():
    """The engine thread asks before each write while the IO thread asks at its tick: a
    `select.poll` polled by both at once raised 'concurrent poll() invocation' (a CI run's
    prefill engine died of it)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=PIPE)
    watch = ProcessWatch(child.pid)
    errors: list[BaseException] = []
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def ask() -> None:
        try:
            for _ in range(20_000):
                assert not watch.gone()
        except BaseException as e:  # NOTE: reported by the main thread
            errors.append(e)

    try:
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(before)
        watch.close()
        child.stdin.close()
        child.wait(10)
    assert errors == []


def test_an_exited_decodes_cuda_counter_files_are_removed_and_nothing_else():
    """What torch leaves in /dev/shm for a killed exporter of CUDA pools; the files are made
    here by hand (the GPU run is tests/gpu/test_ipc_release_gpu.py)."""
    gone, alive = exited_pid(), os.getpid()
    names = [f"/torch_{gone}_7_0", f"/torch_{gone}_7_1", f"/torch_{alive}_7_0"]
    paths = [Path(SHARED_MEMORY + name) for name in names]
    for path in paths:
        path.write_bytes(b"\0" * 64)
    try:
        handle = PoolHandle("cuda", [2, 1, 1, 1, 1, 1], "float32", b"h", 4, ref_counter=b"")
        dead = [dataclasses.replace(handle, ref_counter=name.encode()) for name in names[:2]]
        others = [  # another process's name, one not torch's, and a CPU pool's
            dataclasses.replace(handle, ref_counter=names[2].encode()),
            dataclasses.replace(handle, ref_counter=f"/torch_{gone}_7_0/../x".encode()),
            dataclasses.replace(handle, kind="cpu", ref_counter=names[0].encode()),
        ]
        assert remove_counter_files(others, gone) == []
        assert remove_counter_files(dead[:1], alive) == []  # its exporter still runs
        assert all(path.exists() for path in paths)
        assert remove_counter_files([*dead, dead[0], *others], gone) == names[:2]
        assert [path.exists() for path in paths] == [False, False, True]
        assert remove_counter_files(dead, gone) == []  # already gone: nothing to do
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
