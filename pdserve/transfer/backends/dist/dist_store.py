"""How a pair's process group comes to be (see dist_link): the decode process's store server,
prefill's connection to it, the rendezvous on a pair's store and the 2-rank group created
there; and the errors links raise."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

PREFILL_RANK = 0
DECODE_RANK = 1
WORLD_SIZE = 2
# NOTE: nccl's watchdog takes the whole process down when an operation outlives the group's
# own timeout, so that timeout is only a backstop far beyond any per-operation deadline. The
# deadlines given to send/recv/wait, which abort just this link, are what callers rely on.
NCCL_WATCHDOG_TIMEOUT_S = 3600.0

if TYPE_CHECKING:
    from typing import TypeAlias

    # The backend objects themselves, not wrapped in a ProcessGroup: send/recv/abort.
    Group: TypeAlias = dist.ProcessGroupGloo | dist.ProcessGroupNCCL


class LinkError(RuntimeError):
    """The link failed (peer gone, communicator error, used after close)."""


class LinkTimeout(TimeoutError):
    """An operation on the link (or creating it) missed its deadline."""


def as_timedelta(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def check_timeout(timeout_s: float) -> None:
    if not timeout_s > 0:
        raise ValueError(f"timeout must be positive, got {timeout_s!r} s")


class DecodeStoreServer:
    """The decode process's one TCPStore server, shared by all its pair groups.

    The listening socket is bound here, to `host` only (TCPStore alone would listen on every
    interface), and handed to the store. The server stops once `close()` was called and the
    last link using `store` is gone.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0):
        check_timeout(timeout_s)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=128)
        self.host: str = host
        self.port: int = listener.getsockname()[1]
        # The store's event loop takes ownership of the descriptor it is given (and closes it).
        listen_fd = os.dup(listener.fileno())
        listener.close()
        try:
            self._store: dist.TCPStore | None = dist.TCPStore(
                host,
                self.port,
                None,
                True,
                as_timedelta(timeout_s),
                wait_for_workers=False,
                multi_tenant=True,
                master_listen_fd=listen_fd,
            )
        except Exception:
            os.close(listen_fd)
            raise

    @property
    def store(self) -> dist.Store:
        """The store that decode-side links (rank 1) connect with."""
        if self._store is None:
            raise LinkError(f"store server {self.host}:{self.port} is closed")
        return self._store

    def close(self) -> None:
        self._store = None

    def __enter__(self) -> DecodeStoreServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def client_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A prefill process's connection to a decode process's `DecodeStoreServer`."""
    check_timeout(timeout_s)
    try:
        return dist.TCPStore(host, port, None, False, as_timedelta(timeout_s))
    except RuntimeError as exc:
        raise LinkTimeout(
            f"could not reach the decode store at {host}:{port} within {timeout_s:g} s: {exc}"
        ) from exc


def rendezvous(pair_store: dist.Store, pair_name: str, rank: int, timeout_s: float) -> None:
    """Wait (bounded) until both ranks joined, so group creation never waits on a missing peer."""
    pair_store.set(f"pdserve/joined/{rank}", b"1")
    try:
        pair_store.wait([f"pdserve/joined/{1 - rank}"], as_timedelta(timeout_s))
    except RuntimeError as exc:
        role = "decode" if rank == PREFILL_RANK else "prefill"
        raise LinkTimeout(
            f"pair {pair_name!r}: the {role} peer (rank {1 - rank}) did not join "
            f"within {timeout_s:g} s"
        ) from exc


def new_gloo_group(
    pair_store: dist.Store, rank: int, timeout_s: float, local_host: str | None
) -> Group:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = as_timedelta(timeout_s)
    if local_host is None:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    else:
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return dist.ProcessGroupGloo(pair_store, rank, WORLD_SIZE, options)


def new_nccl_group(pair_store: dist.Store, rank: int) -> Group:
    """The communicator itself is created lazily by the first send/recv (the probe)."""
    if not dist.is_nccl_available():
        raise LinkError("this torch build has no NCCL; use the gloo or tcp backend")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = as_timedelta(NCCL_WATCHDOG_TIMEOUT_S)
    return dist.ProcessGroupNCCL(pair_store, rank, WORLD_SIZE, options)
