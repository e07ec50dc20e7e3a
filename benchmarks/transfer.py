"""KV transfer bandwidth: paged KV through pdserve's transfer layer beside the raw backend
moving one contiguous buffer of the same size between the same two processes.

Effective GiB/s counts the whole handoff, as the decode worker sees it: from the start of the
gather of the request's pages into a staging buffer (prefill) to the end of the scatter into
other page ids (decode commit), with the protocol's control messages in between. Both ends are
read from the host's monotonic clock, which the two processes share. Raw GiB/s is one
contiguous buffer sent with the backend's own primitive between two processes (ZMQ, zero-copy,
for tcp; torch.distributed send/recv on a pair group for gloo and nccl). With `ipc` there is
no gather and no scatter: the handoff runs from the start of prefill's write into decode's
pages to decode's commit, and raw is nccl's (gloo's on CPU) between the same two devices;
its steps include `copy_done`: when the GPU finished the copy, by CUDA events from one
recorded at the start (the GPU is idle then).

    python benchmarks/transfer.py --backend tcp --sizes-mib 16 128 512
    python benchmarks/transfer.py --backend gloo
    python benchmarks/transfer.py --backend nccl   # prefill on cuda:0, decode on cuda:1
    python benchmarks/transfer.py --backend nccl --protocol-only
    python benchmarks/transfer.py --backend ipc    # prefill on cuda:0 writes into cuda:1

`--protocol-only` measures what a handoff costs beyond its bytes: rooms of one 512-byte page
(one layer, one KV head of 8), 40 of them one after another, each protocol step's median time
since the gather started (the first 5 rooms are a warm-up).

For nccl, raw is one `PairLink.send` of a contiguous GPU tensor, timed on the sender once the
receiver's matching receive is posted (the same order pdserve's protocol guarantees).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import multiprocessing
import queue
import select
import statistics
import time

import torch

from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import KVLayout, SpecLayout
from pdserve.transfer.buffer_pool import BufferPool
from pdserve.transfer.config import TransferConfig
from pdserve.transfer.kv_piece import OutgoingPiece, PageSpan
from pdserve.transfer.kv_staging import KVStager
from pdserve.transfer.metadata import MetadataRecord
from pdserve.transfer.room_state import TransferState

MIB = 1 << 20
REPEATS = 3
ENDED = (TransferState.SUCCESS, TransferState.FAILED)


@dataclasses.dataclass(frozen=True)
class KVShape:
    page_size: int
    layers: int
    kv_heads: int
    head_dim: int
    name: str

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.page_size * self.kv_heads * self.head_dim * 2  # K, V; bf16

    @property
    def layout(self) -> KVLayout:
        shape = (self.layers, self.kv_heads, self.head_dim, self.page_size)
        return KVLayout("bench", *shape, "bfloat16", SpecLayout())


LLAMA_8B = KVShape(16, 32, 8, 128, "Llama-3.1-8B (32 layers, 8 KV heads, 128)")  # 2 MiB pages
TINY = KVShape(16, 1, 1, 8, "one layer, one KV head of 8 (512-byte pages)")
PROTOCOL_ROOMS, PROTOCOL_WARMUP = 40, 5


def on_gpus(backend: str) -> bool:
    """The run moves KV from cuda:0 to cuda:1; SystemExit if there are not two GPUs."""
    if backend != "nccl" and not (backend == "ipc" and torch.cuda.is_available()):
        return False
    count = torch.cuda.device_count()
    if count < 2:
        hint = "; CUDA_VISIBLE_DEVICES= runs ipc on the CPU" if backend == "ipc" else ""
        raise SystemExit(
            f"--backend {backend} moves KV from cuda:0 to cuda:1: this machine has {count} "
            f"GPUs{hint}"
        )
    return True


def device_for(backend: str, rank: int) -> torch.device:
    """Prefill (rank 0) on cuda:0 and decode (rank 1) on cuda:1 for nccl, and for ipc where
    there are GPUs; CPU otherwise."""
    if not on_gpus(backend):
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_pool(shape: KVShape, num_pages: int, device: torch.device) -> KVPool:
    pool = KVPool(
        num_layers=shape.layers,
        num_pages=num_pages,
        page_size=shape.page_size,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=torch.bfloat16,
        device=device,
    )
    pool.storage.view(torch.int16).random_(-1000, 1000)
    return pool


def wait(predicate, doorbell, deadline_s=600.0):
    """Until `predicate()`, woken by the endpoint's doorbell as a worker's engine loop is."""
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step timed out")
        select.select([doorbell], [], [], 0.01)
        doorbell.answer()


def prefill_main(sizes, shape: KVShape, repeats: int, config, port_queue, timings):
    """sizes: pages per room."""
    from pdserve.transfer.prefill_side import PrefillTransferServer

    device = device_for(config.backend, 0)
    pool = make_pool(shape, 2 * max(sizes) + 1, device)
    ipc = config.backend == "ipc"
    server = PrefillTransferServer(
        config,
        shape.layout,
        MetadataSpec(),
        "bench-prefill",
        device=device,
        source_device=device,
        pools=[pool.storage] if ipc else None,
    )
    port_queue.put(server.start())
    stager = KVStager([pool])
    staging = BufferPool(device)
    copy = timing_events(device) if ipc else None
    room = 0
    for size in sizes:
        pages = list(range(1, 2 * size, 2))  # every other page
        for _ in range(repeats):
            room += 1
            sender = server.sender(room)
            wait(lambda s=sender: s.poll() is TransferState.WAITING_FOR_INPUT, server.doorbell)
            if copy is not None:
                copy[0].record()  # NOTE: the GPU is idle: the copy's clock starts here
            start = time.monotonic()
            host_steps = {}
            if ipc:  # written straight into decode's pages, as the prefill handoff does
                kv = None
                host_steps = write_into_decode(server, stager, sender, pages, copy)
            else:
                # NOTE: staging comes from a pool, as a prefill worker's would: fresh memory
                # costs page faults on every request. Success means decode acked: it is free.
                kv = stager.gather([pages], out=staging.take(stager.nbytes([pages])))
                synchronize(device)
                sender.send(kv, MetadataRecord(first_token=1))
            wait(lambda s=sender: s.poll() in ENDED, server.doorbell)
            if copy is not None:  # when the GPU finished the copy, as a step
                copy[1].synchronize()  # NOTE: the room may end first: decode's GPU waits
                host_steps["copy_done"] = start + copy[0].elapsed_time(copy[1]) / 1e3
            timings.put(("start", size, room, start, sender.poll().name))
            stamps = {"gather_start": start, **host_steps, **sender.stamps}
            timings.put(("stamps", size, room, stamps, ""))
            if kv is not None:
                staging.give(kv)
            server.release(room)
    server.stop()


def timing_events(device) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
    """CUDA events that time the copy on a GPU, recorded once: torch makes an event at its
    first record (~60 µs on a GPU host), which must not fall inside a timed handoff."""
    if device.type != "cuda":
        return None
    events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for event in events:
        event.record()
    torch.cuda.synchronize(device)
    return events


def write_into_decode(server, stager: KVStager, sender, pages, copy) -> dict[str, float]:
    """The `ipc` backend's piece: the room's pages written into decode's, then announced with
    the event the write completes at and the room's metadata, as prefill's last piece is;
    when each host step ended. `copy`: `timing_events`, the second recorded after the copy."""
    span = PageSpan(0, len(pages))
    peer_pools, peer_pages = sender.destination(span)
    steps = {"destination": time.monotonic()}
    stager.write([pages], peer_pools, peer_pages)
    steps["write_queued"] = time.monotonic()
    if copy is not None:
        copy[1].record()
    ready, event = server.plane.write_event()
    nbytes = span.nbytes(stager.page_bytes)
    piece = OutgoingPiece(span, None, ready, nbytes=nbytes, targets=peer_pools, event=event)
    sender.send_piece(piece, then=MetadataRecord(first_token=1))
    return steps


def decode_main(sizes, shape: KVShape, repeats: int, config, port, timings):
    from pdserve.transfer.decode_side import DecodeTransferClient

    device = device_for(config.backend, 1)
    pool = make_pool(shape, 2 * max(sizes) + 1, device)
    stager = KVStager([pool])
    client = DecodeTransferClient(
        config,
        shape.layout,
        MetadataSpec(),
        "bench-decode",
        stager.page_bytes,
        device=device,
        pools=[pool.storage] if config.backend == "ipc" else None,
    )
    client.start()
    room = 0
    for size in sizes:
        pages = list(range(0, 2 * size, 2))
        for _ in range(repeats):
            room += 1
            receiver = client.receiver(room, "127.0.0.1", port, pages)
            wait(lambda r=receiver: r.poll() in ENDED, client.doorbell)
            if receiver.poll() is not TransferState.SUCCESS:  # nothing to commit: say why
                failure = f"FAILED: {receiver.failure.message}"
                timings.put(("end", size, room, time.monotonic(), failure))
                timings.put(("stamps", size, room, {}, ""))
                client.release(room)
                continue
            commit_start = time.monotonic()
            receiver.commit(stager)
            synchronize(device)
            end = time.monotonic()
            timings.put(("end", size, room, end, receiver.poll().name))
            stamps = {**receiver.stamps, "commit_start": commit_start, "commit_end": end}
            timings.put(("stamps", size, room, stamps, ""))
            client.release(room)
    client.stop()


def raw_zmq(sizes, results):
    """One contiguous buffer, PUSH -> PULL, zero-copy, between two processes."""
    spawn = multiprocessing.get_context("spawn")
    ports, done = spawn.Queue(), spawn.Queue()
    receiver = spawn.Process(target=_raw_receiver, args=(sizes, ports, done))
    receiver.start()
    port = ports.get(timeout=60)
    import zmq

    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    for size in sizes:
        buffer = torch.empty(size * MIB, dtype=torch.uint8).random_(0, 255)
        for _ in range(REPEATS):
            start = time.perf_counter()
            push.send(memoryview(buffer.numpy()), copy=False)
            done.get(timeout=600)
            results.append(("raw", size, time.perf_counter() - start))
    receiver.join(timeout=60)
    push.close(0)
    context.term()


def _raw_receiver(sizes, ports, done):
    import zmq

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    ports.put(pull.bind_to_random_port("tcp://127.0.0.1"))
    for size in sizes:
        target = torch.empty(size * MIB, dtype=torch.uint8)
        for _ in range(REPEATS):
            frame = pull.recv(copy=False)
            target.copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8))
            done.put(True)
    pull.close(0)
    context.term()


def raw_link(sizes, backend, results):
    """One contiguous tensor over a PairLink (the backend's own send/recv)."""
    from pdserve.transfer.backends.dist.dist_link import PairLink
    from pdserve.transfer.backends.dist.dist_store import client_store

    spawn = multiprocessing.get_context("spawn")
    ports, done = spawn.Queue(), spawn.Queue()
    receiver = spawn.Process(target=_link_receiver, args=(sizes, backend, ports, done))
    receiver.start()
    host, port = ports.get(timeout=60)
    device = device_for(backend, 0)
    store = client_store(host, port, 60)
    link = PairLink.connect(
        backend=backend,
        store=store,
        pair_name="raw",
        rank=0,
        timeout_s=60,
        device=device,
        local_host="127.0.0.1",
    )
    for size in sizes:
        buffer = torch.empty(size * MIB, dtype=torch.uint8, device=device).random_(0, 255)
        for repeat in range(REPEATS + 1):
            done.get(timeout=600)  # the receive is posted
            start = time.perf_counter()
            link.send(buffer, timeout_s=600)
            if backend != "nccl":
                done.get(timeout=600)  # gloo: the receiver has it
            if repeat:  # the first is a warm-up
                results.append(("raw", size, time.perf_counter() - start))
    receiver.join(timeout=60)
    link.close()


def _link_receiver(sizes, backend, ports, done):
    from pdserve.transfer.backends.dist.dist_link import PairLink
    from pdserve.transfer.backends.dist.dist_store import DecodeStoreServer

    device = device_for(backend, 1)
    server = DecodeStoreServer("127.0.0.1", 0, 60)
    ports.put((server.host, server.port))
    link = PairLink.connect(
        backend=backend,
        store=server.store,
        pair_name="raw",
        rank=1,
        timeout_s=60,
        device=device,
        local_host="127.0.0.1",
    )
    for size in sizes:
        target = torch.empty(size * MIB, dtype=torch.uint8, device=device)
        for _ in range(REPEATS + 1):
            pending = link.irecv(target)
            done.put(True)
            pending.wait(600)
            if backend != "nccl":
                done.put(True)
    link.close()
    server.close()


def paged(sizes, backend, shape: KVShape = LLAMA_8B, repeats: int = REPEATS) -> list:
    """sizes: pages per room; `repeats` rooms of each."""
    spawn = multiprocessing.get_context("spawn")
    config = TransferConfig(
        backend=backend,
        bootstrap_port=0,
        progress_timeout_s=600,
        peer_timeout_s=600,
        heartbeat_interval_s=1.0,
    )
    ports, timings = spawn.Queue(), spawn.Queue()
    prefill = spawn.Process(
        target=prefill_main, args=(sizes, shape, repeats, config, ports, timings), name="prefill"
    )
    prefill.start()
    decode = spawn.Process(
        target=decode_main,
        args=(sizes, shape, repeats, config, ports.get(timeout=120), timings),
        name="decode",
    )
    decode.start()
    rows = [_next_row(timings, (prefill, decode)) for _ in range(4 * len(sizes) * repeats)]
    prefill.join(timeout=60)
    decode.join(timeout=60)
    return rows


def _next_row(timings, workers, deadline_s: float = 1200.0):
    """The next timing row; a worker that died ends the run at once, not at the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return timings.get(timeout=1.0)
        except queue.Empty:
            dead = [w.name for w in workers if w.exitcode not in (None, 0)]
            if dead:
                for worker in workers:
                    worker.terminate()  # NOTE: else exit waits for the survivor's deadlines
                raise SystemExit(f"{', '.join(dead)} died (see its traceback above)") from None
            if time.monotonic() > deadline:
                raise SystemExit(f"no timing row in {deadline_s:g} s") from None


def _steps(rows, room: int) -> dict[str, float]:
    """The median room's protocol steps, in order, as ms since the gather started."""
    stamps = {}
    for kind, _, r, value, _ in rows:
        if kind == "stamps" and r == room:
            stamps.update(value)
    origin = stamps["gather_start"]
    ordered = sorted(stamps.items(), key=lambda item: item[1])
    return {name: round((t - origin) * 1000, 3) for name, t in ordered}


def summarize(paged_rows, raw_rows, sizes, pages) -> list[dict]:
    """sizes: MiB, each `pages` pages."""
    table = []
    check_succeeded(paged_rows)
    starts = {room: t for kind, _, room, t, _ in paged_rows if kind == "start"}
    ends = {room: t for kind, _, room, t, _ in paged_rows if kind == "end"}
    for size, num_pages in zip(sizes, pages, strict=True):
        rooms = [room for kind, s, room, _, _ in paged_rows if kind == "end" and s == num_pages]
        handoffs = sorted(ends[room] - starts[room] for room in rooms)
        raws = sorted(t for kind, s, t in raw_rows if s == size)
        paged = handoffs[len(handoffs) // 2]
        median_room = next(r for r in rooms if ends[r] - starts[r] == paged)
        raw = raws[len(raws) // 2]
        gib = size / 1024
        table.append(
            {
                "size_mib": size,
                "paged_gib_s": round(gib / paged, 2),
                "raw_gib_s": round(gib / raw, 2),
                "paged_over_raw": round(raw / paged, 3),
                "handoff_ms": round(paged * 1000, 2),
                "raw_ms": round(raw * 1000, 2),
                "handoff_steps_ms": _steps(paged_rows, median_room),
            }
        )
    return table


def check_succeeded(paged_rows) -> None:
    failed = {(room, state) for kind, _, room, _, state in paged_rows if kind != "stamps"}
    failed = sorted(item for item in failed if item[1] != "SUCCESS")
    assert not failed, f"transfers failed (room, state): {failed}"


def protocol_steps(paged_rows) -> dict[str, float]:
    """Each protocol step's median over the rooms after the warm-up, as ms since the gather
    started (each side's steps, and the commit's end)."""
    stamps = collections.defaultdict(dict)
    for kind, _, room, value, _ in paged_rows:
        if kind == "stamps":
            stamps[room].update(value)
        elif kind == "end":
            stamps[room]["handoff_end"] = value
    since_start = collections.defaultdict(list)
    for room, steps in stamps.items():
        if room > PROTOCOL_WARMUP:
            for name, t in steps.items():
                since_start[name].append((t - steps["gather_start"]) * 1e3)
    medians = {name: statistics.median(times) for name, times in since_start.items()}
    return {name: round(t, 3) for name, t in sorted(medians.items(), key=lambda item: item[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="tcp", choices=["tcp", "gloo", "nccl", "ipc"])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument(
        "--protocol-only",
        action="store_true",
        help="one-page rooms of 512 bytes: the handoff's cost beyond its bytes, step by step",
    )
    parser.add_argument("--repeats", type=int, default=REPEATS, help="handoffs of each size")
    parser.add_argument("--output")
    args = parser.parse_args()
    on_gpus(args.backend)  # NOTE: before any worker starts
    page_mib = LLAMA_8B.page_bytes / MIB
    if not args.protocol_only and any(size % page_mib for size in args.sizes_mib):
        # NOTE: a room is whole pages: a smaller size is a room of no page, which fails
        # ("KV piece 0 covers no page"), and a larger one would be timed short of its size.
        parser.error(f"--sizes-mib must be multiples of the {page_mib:g} MiB page")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    report = {"backend": args.backend}
    if args.protocol_only:
        rows = paged([1], args.backend, TINY, PROTOCOL_ROOMS)
        check_succeeded(rows)
        report |= {
            "kv_shape": TINY.name,
            "rooms": PROTOCOL_ROOMS,
            "warmup_rooms": PROTOCOL_WARMUP,
            "median_steps_ms": protocol_steps(rows),
        }
    else:
        raw_rows: list = []
        if args.backend == "tcp":
            raw_zmq(args.sizes_mib, raw_rows)
        else:  # ipc beside what nccl (gloo on CPU) moves between the same two devices
            raw = args.backend
            if raw == "ipc":
                raw = "nccl" if torch.cuda.is_available() else "gloo"
            report["raw_backend"] = raw
            raw_link(args.sizes_mib, raw, raw_rows)
        pages = [size * MIB // LLAMA_8B.page_bytes for size in args.sizes_mib]
        rows = paged(pages, args.backend, repeats=args.repeats)
        table = summarize(rows, raw_rows, args.sizes_mib, pages)
        report |= {
            "kv_shape": LLAMA_8B.name,
            "page_size": LLAMA_8B.page_size,
            "median_of": args.repeats,
            "results": table,
        }
    if device_for(args.backend, 0).type == "cuda":
        report["devices"] = [torch.cuda.get_device_name(i) for i in range(2)]
    print(json.dumps(report, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
