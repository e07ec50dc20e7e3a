"""KV pools one worker maps from another on the same host (the `ipc` backend).

The decode worker exports each of its pools once, at registration (`export_pool`): a GPU
pool as a CUDA IPC handle of its allocation, a CPU pool (CPU workers, and the tests) by moving
it in place into shared memory that has no name (torch's file-descriptor sharing: the segment
is unlinked once created), held by decode's descriptor. The prefill worker maps them
(`open_pool`; a CPU pool through `/proc/<decode pid>/fd/<fd>`) and writes
each room's KV straight into decode's pages (`KVStager.write`): no staging buffer, no receive
to post, one copy over NVLink. The handles are torch's storage-sharing fields carried in a
`PoolHandle` message (msgpack, checked against our own pool's shape before anything is
mapped), never pickled.

Both workers must be on one host, and in one PID namespace: decode frees the pages of a room
that failed only once prefill said no write for it is in flight or will start
(`RoomReleased`), or once the prefill process is gone (`process_gone`).

NOTE: a CPU pool is not shared by name (torch's file-system sharing): a named segment outlives
a decode process that was killed, and torch's shared-memory manager, which unlinks it, waits
for every process that ever mapped it to disconnect, which a prefill process (torch keeps
its connection to each manager for good) never does. A segment without a name is the
kernel's to free: once decode exited and prefill dropped its mapping, nothing is left.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import stat
import threading

import torch

from pdserve.protocol.transfer_messages import PoolHandle

# NOTE: what /proc shows for the descriptor of a pool torch shared without a name.
_CPU_SEGMENT = re.compile(r"/dev/shm/torch_[0-9]+_[0-9]+_[0-9]+ \(deleted\)")
SHARED_MEMORY = "/dev/shm"


class PoolMapError(ValueError):
    """A pool handle that does not fit our pool, or that could not be mapped."""


def host_id() -> str:
    """This host and PID namespace: the kernel's boot id (the host name where there is none)
    and the namespace's inode. Equal on both workers iff they share a host and their process
    ids mean the same processes."""
    boot = socket.gethostname()
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    namespace = ""
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")
    return f"{boot}/{namespace}"


def process_gone(pid: int) -> bool:
    """The process `pid` (of this PID namespace) has exited: its GPU work is over, so no
    write of it can land any more. A zombie counts as gone (its CUDA context was torn down
    when it exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


class ProcessWatch:
    """`process_gone` for one process, cheap enough to ask before every write: a pidfd polled
    without waiting (readable once the process exited, zombie or not, and never another
    process that took its id); `process_gone` where the kernel has no pidfds.

    NOTE: asked from two threads (the engine thread before each write, the IO thread at its
    tick), and a `select.poll` object refuses to be polled by two at once ("concurrent
    poll() invocation"): a lock keeps them, and `close`, apart; a process seen gone stays
    gone."""

    def __init__(self, pid: int):
        self.pid = pid
        self._lock = threading.Lock()
        self._gone = False
        self._poll: select.poll | None = None
        self._fd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._fd = os.pidfd_open(pid)
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)

    def gone(self) -> bool:
        with self._lock:
            if not self._gone:
                if self._poll is None:
                    self._gone = process_gone(self.pid)
                else:
                    self._gone = bool(self._poll.poll(0))
            return self._gone

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd, self._poll = None, None


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16, as the layouts name it."""
    return str(dtype).removeprefix("torch.")


def export_pool(storage: torch.Tensor) -> PoolHandle:
    """A handle another process on this host maps `storage` by (a KV pool's whole
    `[2, layers, pages, ...]` tensor). A CPU pool moves into shared memory without a name, in
    place: its views stay valid."""
    if not storage.is_contiguous() or storage.storage_offset() != 0:
        raise PoolMapError("only a whole, contiguous KV pool can be shared")
    shape, dtype = list(storage.shape), dtype_name(storage.dtype)
    untyped = storage.untyped_storage()
    if storage.device.type == "cuda":
        # NOTE: (device, handle, size, offset, ref counter, its offset, event, event sync)
        _, handle, size, offset, counter, counter_offset, event, sync = untyped._share_cuda_()
        return PoolHandle(
            "cuda",
            shape,
            dtype,
            handle,
            size,
            offset,
            ref_counter=counter,
            ref_counter_offset=counter_offset,
            event=event,
            event_sync=sync,
        )
    if storage.device.type == "cpu":
        fd, size = untyped._share_fd_cpu_()
        return PoolHandle("cpu", shape, dtype, b"", size, fd=fd)
    raise PoolMapError(f"a KV pool on {storage.device.type} cannot be shared")


def open_pool(handle: PoolHandle, ours: torch.Tensor, *, peer: str, pid: int) -> torch.Tensor:
    """Map the pool of a peer (process `pid`) whose layout must match our pool `ours` but
    for its page count: the peer's `[2, layers, pages, ...]` tensor, on our device.
    PoolMapError names what does not fit, checked before anything is mapped."""
    device = ours.device
    if handle.kind != device.type:
        raise PoolMapError(f"{peer}'s KV pool is on {handle.kind}, ours on {device.type}")
    if handle.dtype != dtype_name(ours.dtype):
        raise PoolMapError(f"{peer}'s KV pool holds {handle.dtype}, ours {dtype_name(ours.dtype)}")
    shape = list(handle.shape)
    if len(shape) != ours.dim() or shape[:2] + shape[3:] != list(ours.shape[:2] + ours.shape[3:]):
        raise PoolMapError(
            f"{peer}'s KV pool is {shape}, ours {list(ours.shape)} (only the page count may differ)"
        )
    nbytes = ours.element_size()
    for extent in shape:
        nbytes *= extent
    if shape[2] < 1 or handle.size != nbytes or handle.offset < 0:
        raise PoolMapError(f"{peer}'s KV pool handle says {handle.size} bytes for {shape}")
    try:
        if device.type == "cuda":
            # NOTE: mapped on our device: its kernels write the peer's memory over NVLink.
            untyped = torch.UntypedStorage._new_shared_cuda(
                device.index if device.index is not None else torch.cuda.current_device(),
                handle.handle,
                handle.size,
                handle.offset,
                handle.ref_counter,
                handle.ref_counter_offset,
                handle.event,
                handle.event_sync,
            )
        else:
            untyped = _open_cpu_segment(handle, pid, peer)
    except (RuntimeError, OSError) as e:
        raise PoolMapError(f"could not map {peer}'s KV pool (same host?): {e}") from e
    return torch.empty(0, dtype=ours.dtype, device=device).set_(untyped, 0, shape)


def _open_cpu_segment(handle: PoolHandle, pid: int, peer: str) -> torch.UntypedStorage:
    """Map the shared memory that process `pid` holds by descriptor `handle.fd`: only a
    segment torch shared without a name, of the handle's size (never a file of the peer's),
    looked at before it is opened (no device or pipe is opened) and after (what was opened)."""
    if handle.fd < 0 or pid <= 0:
        raise PoolMapError(f"{peer}'s KV pool handle names descriptor {handle.fd} of {pid}")
    link = f"/proc/{pid}/fd/{handle.fd}"
    _check_segment(os.stat(link), os.readlink(link), handle, peer)
    fd = os.open(link, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        _check_segment(os.fstat(fd), os.readlink(f"/proc/self/fd/{fd}"), handle, peer)
        return torch.UntypedStorage._new_shared_fd_cpu(fd, handle.size)  # NOTE: its own dup
    finally:
        os.close(fd)


def _check_segment(found: os.stat_result, target: str, handle: PoolHandle, peer: str) -> None:
    if not stat.S_ISREG(found.st_mode) or found.st_nlink != 0 or not _CPU_SEGMENT.fullmatch(target):
        raise PoolMapError(f"{peer}'s KV pool descriptor is {target!r}, not a KV pool")
    if found.st_size != handle.size:
        raise PoolMapError(f"{peer}'s KV pool is {found.st_size} bytes, not {handle.size}")


def remove_counter_files(handles: list[PoolHandle], pid: int) -> list[str]:
    """After the exporting process `pid` exited: remove the reference-counter files in
    /dev/shm that torch made when it shared these CUDA pools (`PoolHandle.ref_counter`); the
    names removed.

    NOTE: torch removes such a file when the last process mapping it lets go, the exporter
    counted, so an exporter that was killed leaves it for good (80 KB a decode restart). Only
    a name that process made (torch names them /torch_<pid>_<n>_<n>) and that we own is
    removed; a mapping still open is not affected (torch, releasing one whose file is gone,
    skips the count)."""
    made_by_it = re.compile(rf"/torch_{pid}_[0-9]+_[0-9]+")
    names = {h.ref_counter.decode(errors="replace") for h in handles if h.kind == "cuda"}
    removed = []
    for name in sorted(names):
        if pid <= 0 or not made_by_it.fullmatch(name) or not process_gone(pid):
            continue
        path = SHARED_MEMORY + name
        with contextlib.suppress(FileNotFoundError):  # NOTE: it closed it itself, or a peer
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
    return removed
