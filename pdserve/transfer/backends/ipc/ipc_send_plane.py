"""The prefill side of the `ipc` backend (`ipc_plane` says how it works)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.failures import FailureKind
from pdserve.protocol.transfer_messages import HelloReply, Register
from pdserve.transfer.backends.ipc.ipc_events import IpcEventRing
from pdserve.transfer.backends.ipc.ipc_lane import LaneSender, lane_address_problem
from pdserve.transfer.backends.ipc.ipc_plane import OTHER_HOST, IpcPlane
from pdserve.transfer.backends.ipc.shared_pools import (
    PoolMapError,
    ProcessWatch,
    open_pool,
    remove_counter_files,
)
from pdserve.transfer.config import IPC_TENSOR_PARALLEL
from pdserve.transfer.kv_piece import OutgoingPiece

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint
    from pdserve.transfer.peer import Peer

logger = logging.getLogger(__name__)


class IpcSendPlane(IpcPlane):
    """The prefill side: maps each decode peer's pools; announces pieces it wrote."""

    def __init__(self, endpoint: Endpoint, pools: list[torch.Tensor] | None):
        super().__init__(endpoint, pools)
        device = self.pools[0].device
        self.events = IpcEventRing(device) if device.type == "cuda" else None
        self._handles: dict[bytes, tuple[Peer, list]] = {}  # each decode peer's pool handles

    def hello_reply(self, reply: HelloReply) -> HelloReply:
        events = self.events.handles if self.events is not None else []
        return dataclasses.replace(reply, host_id=self.host, pid=os.getpid(), events=events)

    def register_problem(self, peer: Peer, msg: Register) -> str | None:
        """Map the decode worker's pools (kept on the peer); why not, if they cannot be."""
        if msg.host_id != self.host:
            return OTHER_HOST
        if msg.tp_size != 1 or self.endpoint.tp_size != 1:
            return IPC_TENSOR_PARALLEL
        if msg.lane and (problem := lane_address_problem(msg.lane)) is not None:
            return problem
        if len(msg.pools) != len(self.pools):
            return f"decode shares {len(msg.pools)} KV pools, prefill has {len(self.pools)}"
        try:
            peer.pools = [
                open_pool(handle, ours, peer="decode", pid=msg.pid)
                for handle, ours in zip(msg.pools, self.pools, strict=True)
            ]
        except PoolMapError as e:
            return str(e)
        peer.pid, peer.watch = msg.pid, ProcessWatch(msg.pid)
        self._handles[peer.key] = (peer, list(msg.pools))
        if msg.lane:
            try:
                peer.lane = LaneSender(msg.lane, wait_s=self.endpoint.config.peer_timeout_s)
            except OSError as e:  # NOTE: e.g. decode in another network namespace
                logger.info("decode %s: announcements go over the connection: %s", msg.decode_id, e)
        return None

    def send_piece(self, room, piece: OutgoingPiece, index: int) -> bool:
        """Announce a piece whose pages were written (IO thread)."""
        announcement = piece.announcement(room.room, index, piece.event)
        room.keep(piece.ready)  # NOTE: decode opens the event when the announcement arrives
        if not self.endpoint.send(room.peer, announcement):
            return False
        self.endpoint.metrics.bytes_sent += piece.nbytes
        return True

    def tick(self, now: float) -> None:
        """Drop each decode peer whose process exited (its pools die with our mapping) at
        once, not when its silence runs out (a minute, for an idle peer)."""
        endpoint = self.endpoint
        for peer in list(endpoint.peers.values()):
            if peer.pools is not None and peer.watch.gone():
                reason = "exited (its process is gone)" if endpoint.live_rooms(peer) else None
                endpoint.drop_peer(peer, FailureKind.PEER_LOST, reason)

    def forget(self, peer: Peer) -> None:
        """Unmap a decode peer's pools (a CUDA mapping holds the memory of a decode process
        that exited until it is closed); if its process is gone, remove what it left in
        /dev/shm too. NOTE: a write still in flight keeps the mapping alive until it ends
        (`OutgoingPiece.targets`)."""
        peer.pools = None
        owner, handles = self._handles.pop(peer.key, (None, []))
        if owner is peer and peer.watch is not None and peer.watch.gone():
            removed = remove_counter_files(handles, peer.pid)
            if removed:
                logger.info("decode %s exited: removed %s", peer, ", ".join(removed))
        _close_links(peer)

    def close(self) -> None:
        for peer in self.endpoint.peers.values():
            _close_links(peer)


def _close_links(peer: Peer) -> None:
    """A decode peer's lane and process watch. (The worker's thread may still use them: a
    closed lane answers that the connection was dropped, a closed watch asks /proc.)"""
    if peer.lane is not None:
        peer.lane.close()
    if peer.watch is not None:
        peer.watch.close()
