"""Point-to-point tensor link between one prefill and one decode process (docs/architecture/data-plane.md).

Each (prefill, decode) pair gets its own 2-rank torch.distributed process group, built from a
store rather than through `init_process_group`, so one process can hold many pair groups at
once (see dist_store: the decode process serves one store, each pair works under its own
prefix). Prefill is rank 0, decode rank 1. `nccl` moves GPU tensors; `gloo` runs the same code
path on CPU (CI).

Every blocking call has a deadline. A transfer that misses its deadline, or fails, leaves the
link FAILED and aborted (gloo also closes the pair itself on a timeout), so a late write can
never land in a buffer the caller has since reused. A posted send or receive is a
`PendingTransfer`, waited for with a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pdserve.transfer.backends.dist.dist_store import (
    DECODE_RANK,
    PREFILL_RANK,
    LinkError,
    LinkTimeout,
    as_timedelta,
    check_timeout,
    new_gloo_group,
    new_nccl_group,
    rendezvous,
)

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
_TAG = 0
_PROBE_BYTE = 0x5A

if TYPE_CHECKING:
    from pdserve.transfer.backends.dist.dist_store import Group as _Group


class PairLink:
    """One side of a 2-rank process group between a prefill (rank 0) and a decode (rank 1).

    Sends and receives are matched in the order each side posts them. The caller agrees that
    order over its control channel: decode posts `irecv` first, then tells prefill to send.
    Every posted transfer must be waited for (or the link closed).
    """

    def __init__(
        self,
        group: _Group,
        *,
        backend: str,
        pair_name: str,
        rank: int,
        device: torch.device,
    ):
        self.backend = backend
        self.pair_name = pair_name
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self._group: _Group | None = group
        self._failure: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        *,
        backend: str,
        store: dist.Store,
        pair_name: str,
        rank: int,
        timeout_s: float,
        device: torch.device | None = None,
        local_host: str | None = None,
    ) -> PairLink:
        """Join the pair group `pair_name`; both ranks must call this within `timeout_s`.

        `pair_name` must be fresh for every connect (e.g. prefill id, decode id and a nonce).
        `device` is the CUDA device for nccl (required) and CPU for gloo (the default).
        `local_host` is the address gloo listens on for its peer (default: gloo's choice,
        from GLOO_SOCKET_IFNAME or the host name); nccl reads NCCL_SOCKET_IFNAME instead.
        """
        if backend not in BACKENDS:
            raise ValueError(f"unknown link backend {backend!r}; expected one of {BACKENDS}")
        if rank not in (PREFILL_RANK, DECODE_RANK):
            raise ValueError(f"rank must be {PREFILL_RANK} (prefill) or {DECODE_RANK} (decode)")
        check_timeout(timeout_s)
        device = _link_device(backend, device)
        deadline = time.monotonic() + timeout_s
        pair_store = dist.PrefixStore(pair_name, store)
        rendezvous(pair_store, pair_name, rank, timeout_s)
        try:
            if backend == "gloo":
                group = new_gloo_group(pair_store, rank, _remaining(deadline), local_host)
            else:
                group = new_nccl_group(pair_store, rank)
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                raise LinkTimeout(
                    f"pair {pair_name!r}: creating the {backend} group as rank {rank} "
                    f"did not finish within {timeout_s:g} s: {exc}"
                ) from exc
            raise LinkError(
                f"pair {pair_name!r}: creating the {backend} group failed: {exc}"
            ) from exc
        link = cls(group, backend=backend, pair_name=pair_name, rank=rank, device=device)
        try:
            link.exchange_probe(_remaining(deadline))
        except BaseException:
            link.close()
            raise
        return link

    @property
    def aborted(self) -> bool:
        """The group was aborted (failed or closed): nothing in flight will complete."""
        return self._group is None or self._failure is not None

    @property
    def failed(self) -> str | None:
        """Why the link failed, or None while it is usable."""
        return self._failure

    def send(self, tensor: torch.Tensor, *, timeout_s: float) -> None:
        """Send `tensor` to the peer; returns once the tensor may be reused."""
        check_timeout(timeout_s)
        self.isend(tensor).wait(timeout_s)

    def recv(self, tensor: torch.Tensor, *, timeout_s: float) -> None:
        """Receive from the peer into `tensor` (same byte count as the peer's send)."""
        check_timeout(timeout_s)
        self.irecv(tensor).wait(timeout_s)

    def isend(self, tensor: torch.Tensor) -> PendingTransfer:
        return self._post("send", tensor)

    def irecv(self, tensor: torch.Tensor) -> PendingTransfer:
        """Post a receive now and wait later; `tensor` must not be touched until then."""
        return self._post("recv", tensor)

    def close(self) -> None:
        """Abort the group: never blocks, and the peer's pending transfers fail fast.
        Idempotent; never raises."""
        with self._lock:
            group, self._group = self._group, None
            aborted_already = self._failure is not None
        if group is not None and not aborted_already:
            _abort(group, self.pair_name, "close")

    def __enter__(self) -> PairLink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _post(self, operation: str, tensor: torch.Tensor) -> PendingTransfer:
        self._check_tensor(operation, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        group = self._usable_group(operation)
        try:
            if operation == "send":
                work = group.send([tensor], self.peer, _TAG)
            else:
                work = group.recv([tensor], self.peer, _TAG)
        except RuntimeError as exc:
            reason = f"posting {operation} of {nbytes} bytes failed: {exc}"
            self.fail(reason)
            raise LinkError(f"pair {self.pair_name!r}: {reason}") from exc
        return PendingTransfer(self, work, operation, nbytes)

    def _check_tensor(self, operation: str, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous():
            raise ValueError(
                f"pair {self.pair_name!r}: {operation} needs a contiguous tensor "
                f"(shape {tuple(tensor.shape)}, stride {tensor.stride()})"
            )
        if tensor.device != self.device:
            raise ValueError(
                f"pair {self.pair_name!r}: {operation} of a tensor on {tensor.device}, "
                f"but this {self.backend} link moves tensors on {self.device}"
            )

    def _usable_group(self, operation: str) -> _Group:
        with self._lock:
            group, failure = self._group, self._failure
        if failure is not None:
            raise LinkError(f"pair {self.pair_name!r}: {operation} on a failed link ({failure})")
        if group is None:
            raise LinkError(f"pair {self.pair_name!r}: {operation} on a closed link")
        return group

    def fail(self, reason: str) -> None:
        """Mark the link failed and abort it, so no late transfer writes into caller memory."""
        with self._lock:
            if self._failure is None:
                self._failure = reason
            group = self._group
        if group is not None:
            _abort(group, self.pair_name, reason)

    def exchange_probe(self, timeout_s: float) -> None:
        """One byte from prefill to decode while both sides are known to be connecting: it
        proves the path, and makes nccl build its communicator now, not inside the first
        real transfer (where decode's posted receive would block until prefill sent)."""
        probe = torch.full((1,), _PROBE_BYTE, dtype=torch.uint8, device=self.device)
        try:
            if self.rank == PREFILL_RANK:
                self.send(probe, timeout_s=timeout_s)
                return
            probe.zero_()
            self.recv(probe, timeout_s=timeout_s)
        except LinkTimeout as exc:
            raise LinkTimeout(
                f"pair {self.pair_name!r}: the first exchange with the peer did not complete "
                f"within the connect deadline ({exc})"
            ) from exc
        if probe.item() != _PROBE_BYTE:
            raise LinkError(f"pair {self.pair_name!r}: the probe byte arrived corrupted")


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.1)


def _abort(group: _Group, pair_name: str, why: str) -> None:
    try:
        group.abort()
    except RuntimeError as exc:
        logger.warning("pair %r: aborting the group (%s): %s", pair_name, why, exc)


def _link_device(backend: str, device: torch.device | None) -> torch.device:
    if backend == "gloo":
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type != "cpu":
            raise ValueError(f"the gloo link moves CPU tensors only, not {device}")
        return device
    if device is None or torch.device(device).type != "cuda":
        raise ValueError(f"the nccl link needs a CUDA device (e.g. cuda:0), got {device}")
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ---- a posted transfer ------------------------------------------------------------

_POLL_MAX_SLEEP_S = 1e-4  # a waiter polls only while a transfer is in flight


class PendingTransfer:
    """A posted send or receive; `wait` completes it or fails the link."""

    def __init__(self, link: PairLink, work: dist.Work, operation: str, nbytes: int):
        self._link = link
        self._work = work
        self.operation = operation
        self.nbytes = nbytes

    def wait(self, timeout_s: float) -> None:
        """Block until done: LinkTimeout after `timeout_s`, LinkError if the transfer failed.

        For nccl, on return the caller's current CUDA stream is ordered after the transfer.
        """
        check_timeout(timeout_s)
        started = time.monotonic()
        try:
            if self._link.backend == "nccl":
                completed = _poll(self._work, started + timeout_s, self._link)
                if completed:
                    self._work.wait()  # complete already: only orders the current stream
            else:
                # gloo's send/recv works complete only inside wait(); on a timeout gloo
                # closes the pair, so nothing can arrive later.
                completed = self._work.wait(as_timedelta(timeout_s)) is not False
        except LinkError:
            raise
        except RuntimeError as exc:
            elapsed = time.monotonic() - started
            if "timed out" in str(exc).lower() or elapsed >= timeout_s:
                raise self._timed_out(timeout_s) from exc
            reason = f"{self.operation} of {self.nbytes} bytes failed: {exc}"
            self._link.fail(reason)
            raise LinkError(f"pair {self._link.pair_name!r}: {reason}") from exc
        if not completed:
            raise self._timed_out(timeout_s)

    def _timed_out(self, timeout_s: float) -> LinkTimeout:
        reason = f"{self.operation} of {self.nbytes} bytes did not complete within {timeout_s:g} s"
        self._link.fail(reason)
        return LinkTimeout(f"pair {self._link.pair_name!r}: {reason}; link aborted")


def _poll(work: dist.Work, deadline: float, link: PairLink) -> bool:
    """Wait for `work` without Work.wait(timeout): a timed-out nccl wait is treated as fatal
    by torch's error handling, while aborting the group ourselves is its recovery path. A
    link aborted meanwhile (by another thread) ends the wait at once."""
    sleep_s = 1e-5
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        if link.aborted:
            raise LinkError(f"pair {link.pair_name!r}: the link was aborted ({link.failed})")
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, _POLL_MAX_SLEEP_S)
    return True
