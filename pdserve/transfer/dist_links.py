"""The torch.distributed links of one side (one `PairLink` per peer) and the data thread
that runs their blocking operations (see `dist_plane` for the protocol over them).

All link operations of a side run on one data thread, in order; results go back to the side's
IO thread through callbacks. Creating a link (reaching a store at an address a peer gave us,
the pair's rendezvous) runs on a thread of its own, so a slow or unreachable peer never holds
up the other peers' transfers; operations for a link still being created wait for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from pdserve.transfer.dist_link import LinkError, LinkTimeout, PairLink
from pdserve.transfer.dist_store import DecodeStoreServer, client_store

logger = logging.getLogger(__name__)

Done = Callable[[str | None], None]  # called with None on success, else a failure reason


class DataThread:
    """Runs blocking link operations one after another, off the IO thread."""

    def __init__(self, name: str):
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._tasks.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception:
                logger.exception("transfer data thread task failed")


class DistLinks:
    """One side's links (one per peer) and its data thread."""

    def __init__(
        self, backend: str, side: str, timeout_s: float, device: torch.device, local_host: str
    ):
        """local_host: this worker's address, where gloo listens for its peer."""
        self.backend = backend
        self.local_host = local_host
        self.rank = 0 if side == "prefill" else 1
        self.timeout_s = timeout_s
        self.device = device
        self.links: dict[object, PairLink] = {}
        self.broken: dict[object, str] = {}
        self.data = DataThread(f"{side}-transfer-data")
        if device.type == "cuda" and device.index is not None:
            # NOTE: a new thread's current device is cuda:0; NCCL work for a worker on cuda:1
            # must not create a context (and streams) on another worker's GPU.
            self.data.submit(lambda: torch.cuda.set_device(device))
        self.store_server: DecodeStoreServer | None = None
        # Data thread only: operations waiting for links being created, by peer.
        self._connecting: dict[object, list[Callable[[], None]]] = {}

    def serve_store(self, host: str) -> str:
        """Decode only: host the store its pairs rendezvous on; returns host:port."""
        if self.store_server is None:
            self.store_server = DecodeStoreServer(host, 0, self.timeout_s)
        return f"{self.store_server.host}:{self.store_server.port}"

    def connect(self, peer_key, store_address: str, pair_name: str, done: Done) -> None:
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
            self.data.submit(lambda: self._install(peer_key, link, error, done))

        def start() -> None:
            self._connecting.setdefault(peer_key, [])
            threading.Thread(target=build, name="transfer-link-connect", daemon=True).start()

        self.data.submit(start)

    def _install(self, peer_key, link: PairLink | None, error: str | None, done: Done) -> None:
        waiting = self._connecting.pop(peer_key, [])
        old = self.links.pop(peer_key, None)
        if old is not None:
            old.close()
        if link is not None:
            self.links[peer_key] = link
            self.broken.pop(peer_key, None)
        else:
            self.broken[peer_key] = error
        done(error)
        for operation in waiting:
            operation()

    def forget(self, peer_key) -> None:
        """Close the peer's link (after the operations already submitted for it)."""

        def close() -> None:
            link = self.links.pop(peer_key, None)
            self.broken.pop(peer_key, None)
            if link is not None:
                link.close()

        self.data.submit(close)

    def send(self, peer_key, buffer: torch.Tensor, done: Done) -> None:
        self.data.submit(
            lambda: self._run(
                peer_key, lambda link: link.send(buffer, timeout_s=self.timeout_s), done
            )
        )

    def receive(
        self, peer_key, buffer: torch.Tensor, posted: Callable[[], None], done: Done
    ) -> None:
        def operation(link: PairLink) -> None:
            pending = link.irecv(buffer)
            posted()
            pending.wait(self.timeout_s)

        self.data.submit(lambda: self._run(peer_key, operation, done))

    def _run(self, peer_key, operation: Callable[[PairLink], None], done: Done) -> None:
        if peer_key in self._connecting:
            self._connecting[peer_key].append(lambda: self._run(peer_key, operation, done))
            return
        link = self.links.get(peer_key)
        if link is None:
            done(self.broken.get(peer_key, f"no {self.backend} link to this peer"))
            return
        try:
            operation(link)
        except (LinkError, LinkTimeout, RuntimeError) as e:
            self.broken[peer_key] = f"{self.backend} link failed: {e}"
            self.links.pop(peer_key, None)
            link.close()
            done(self.broken[peer_key])
            return
        done(None)

    def close(self) -> None:
        self.data.stop()
        for link in self.links.values():
            link.close()
        self.links.clear()
        if self.store_server is not None:
            self.store_server.close()
