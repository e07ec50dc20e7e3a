"""The torch.distributed links of one side (one `PairLink` per peer): transfers are posted on
the caller's thread (the side's IO thread, in the order the control channel announced them)
and completed, in order, by a waiter thread per link; results go back through callbacks.

Posting never blocks: a send or receive is queued on the GPU (nccl) or handed to gloo's own
threads, so several pieces and rooms are in flight on a pair at once, and no round trip is
needed before a send (the receiver posts its receive when the announcement arrives; NCCL holds
the send until then). On a GPU, transfers run on the side's own stream: a send waits there
for the event recorded after its buffer was gathered, never for the compute queued after it.

Creating a link (reaching a store at an address a peer gave us, the pair's rendezvous) runs
on a thread of its own, so a slow or unreachable peer never holds up the other peers;
transfers posted for a link still being created are posted, in order, once it exists.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable

import torch

from pdserve.transfer.backends.dist.dist_link import LinkError, LinkTimeout, PairLink, PendingTransfer
from pdserve.transfer.backends.dist.dist_store import DecodeStoreServer, client_store

logger = logging.getLogger(__name__)

Done = Callable[[str | None], None]  # called with None on success, else a failure reason


class _LinkWaiter:
    """Completes one link's posted transfers in posting order (which is the order they
    complete in on a pair), each within its deadline. The first failure fails the link and
    every transfer behind it."""

    def __init__(self, link: PairLink, timeout_s: float):
        self.link = link
        self.timeout_s = timeout_s
        self.failure: str | None = None
        self._queue: collections.deque[tuple[PendingTransfer, Done, float]] = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"transfer-wait-{link.pair_name[-8:]}", daemon=True
        )
        self._thread.start()

    def add(self, pending: PendingTransfer, done: Done) -> None:
        with self._ready:
            self._queue.append((pending, done, time.monotonic() + self.timeout_s))
            self._ready.notify()

    def close(self, reason: str) -> None:
        """Abort the link; transfers still waiting fail with `reason`."""
        self.link.close()
        with self._ready:
            self._closed = True
            self.failure = self.failure or reason
            self._ready.notify()

    def _run(self) -> None:
        if self.link.device.type == "cuda":
            # NOTE: a new thread's current device is cuda:0, not this worker's GPU.
            torch.cuda.set_device(self.link.device)
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                pending, done, deadline = self._queue[0]
            error = self.failure
            if error is None:
                try:
                    pending.wait(max(deadline - time.monotonic(), 1e-3))
                except (LinkError, LinkTimeout, RuntimeError) as e:
                    error = f"{self.link.backend} link failed: {e}"
                    self.failure = self.failure or error
                    self.link.close()
            with self._ready:
                self._queue.popleft()
            _call(done, error)


def _call(done: Done, error: str | None) -> None:
    try:
        done(error)
    except Exception:
        logger.exception("transfer completion callback failed")


class DistLinks:
    """One side's links, one per peer."""

    def __init__(
        self, backend: str, side: str, timeout_s: float, device: torch.device, local_host: str
    ):
        """local_host: this worker's address, where gloo listens for its peer."""
        self.backend = backend
        self.local_host = local_host
        self.rank = 0 if side == "prefill" else 1
        self.timeout_s = timeout_s
        self.device = device
        # NOTE: transfers never wait for compute on the default stream, only for their events.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.store_server: DecodeStoreServer | None = None
        self._lock = threading.Lock()  # guards everything below
        self._waiters: dict[object, _LinkWaiter] = {}
        self._broken: dict[object, str] = {}
        # Peers whose link is being created: that attempt's token, and the posts waiting for
        # it in order. NOTE: a peer dropped and connected again has a new attempt; the old
        # one's link, if it still comes, is closed.
        self._connecting: dict[object, tuple[object, list[Callable[[], None]]]] = {}
        self._closed = False

    def serve_store(self, host: str) -> str:
        """Decode only: host the store its pairs rendezvous on; returns host:port."""
        if self.store_server is None:
            self.store_server = DecodeStoreServer(host, 0, self.timeout_s)
        return f"{self.store_server.host}:{self.store_server.port}"

    def connect(self, peer_key, store_address: str, pair_name: str, done: Done) -> None:
        """Create the pair's link on a thread of its own; `done` says how it went."""
        attempt = object()
        with self._lock:
            self._connecting[peer_key] = (attempt, [])

        def build() -> None:
            link, error = None, None
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                if self.store_server is not None:
                    store = self.store_server.store
                else:
                    host, port = store_address.rsplit(":", 1)
                    store = client_store(host, int(port), self.timeout_s)
                link = PairLink.connect(
                    backend=self.backend,
                    store=store,
                    pair_name=pair_name,
                    rank=self.rank,
                    timeout_s=self.timeout_s,
                    device=self.device,
                )
            except (LinkError, LinkTimeout, RuntimeError, ValueError) as e:
                error = f"{self.backend} link to peer failed: {e}"
            self._install(peer_key, attempt, link, error)
            _call(done, error)

        threading.Thread(target=build, name="transfer-link-connect", daemon=True).start()

    def _install(self, peer_key, attempt, link: PairLink | None, error: str | None) -> None:
        """Under the lock, so that no post slips between the attempt and the link."""
        unused = old = None
        with self._lock:
            current, waiting = self._connecting.get(peer_key, (None, []))
            if current is not attempt or self._closed:  # dropped meanwhile, or shutting down
                unused = link
            else:
                del self._connecting[peer_key]
                old = self._waiters.pop(peer_key, None)
                if link is not None:
                    self._waiters[peer_key] = _LinkWaiter(link, self.timeout_s)
                    self._broken.pop(peer_key, None)
                else:
                    self._broken[peer_key] = error
                for post in waiting:
                    post()
        if unused is not None:
            unused.close()
        if old is not None:
            old.close("replaced by a new link")

    def forget(self, peer_key) -> None:
        """Close the peer's link: its transfers still in flight fail. Returns at once (the
        abort runs on a thread of its own, off the caller's IO thread)."""
        with self._lock:
            waiter = self._waiters.pop(peer_key, None)
            self._broken.pop(peer_key, None)
            self._connecting.pop(peer_key, None)
        if waiter is not None:
            threading.Thread(
                target=waiter.close, args=("the peer was dropped",), daemon=True
            ).start()

    def send(
        self, peer_key, buffer: torch.Tensor, ready: torch.cuda.Event | None, done: Done
    ) -> None:
        """Post a send of `buffer` (after `ready`, on a GPU); `done` when it completed."""
        self._post(peer_key, "send", buffer, ready, done)

    def receive(self, peer_key, buffer: torch.Tensor, done: Done) -> None:
        """Post a receive into `buffer`; `done` when it landed (or failed: then nothing
        writes `buffer` any more)."""
        self._post(peer_key, "recv", buffer, None, done)

    def _post(self, peer_key, operation: str, buffer, ready, done: Done) -> None:
        with self._lock:
            if peer_key in self._connecting:
                self._connecting[peer_key][1].append(
                    lambda: self._post_now(peer_key, operation, buffer, ready, done)
                )
                return
            self._post_now(peer_key, operation, buffer, ready, done)

    def _post_now(self, peer_key, operation: str, buffer, ready, done: Done) -> None:
        """Under the lock."""
        waiter = self._waiters.get(peer_key)
        if waiter is None:
            error = self._broken.get(peer_key, f"no {self.backend} link to this peer")
            threading.Thread(target=_call, args=(done, error), daemon=True).start()
            return
        try:
            with self._on_stream(ready):
                if operation == "send":
                    pending = waiter.link.isend(buffer)
                else:
                    pending = waiter.link.irecv(buffer)
        except (LinkError, RuntimeError, ValueError) as e:
            pending = _Failed(f"posting the {operation} failed: {e}")
        waiter.add(pending, done)

    def _on_stream(self, ready: torch.cuda.Event | None):
        if self.stream is None:
            return contextlib.nullcontext()
        if ready is not None:
            self.stream.wait_event(ready)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiters = list(self._waiters.values())
            self._waiters.clear()
        for waiter in waiters:
            waiter.close("the transfer endpoint is shutting down")
        if self.store_server is not None:
            self.store_server.close()


class _Failed:
    """A transfer that could not even be posted: its wait fails the link."""

    def __init__(self, reason: str):
        self.reason = reason

    def wait(self, timeout_s: float) -> None:
        raise LinkError(self.reason)
