"""KV written by the prefill worker straight into the decode worker's pages
(`--transfer-backend ipc`: both workers on one host, neither tensor-parallel).

Decode exports its pools once, in `Register` (`shared_pools`); prefill maps them. For each
piece, prefill copies the pages on its compute stream, right behind the chunk that wrote
them, into the page ids decode's transfer request listed (`KVStager.write`: one kernel per
pool over NVLink, no staging buffer, no receive to post) and announces the piece at once
(`KVPiece`, no bytes follow) with a CUDA IPC event recorded after the copy: from the worker's
thread, over the announcement lane decode offered (`ipc_lane`), else over the connection.
Decode checks the piece against its reservation as on every backend and takes the event
(opened at the handshake, `ipc_events`); the piece has landed. The metadata record and
`RoomDone` follow the same way (with the last piece, in one packet); decode's commit has
nothing left to write but to make its stream wait for the events, so no thread of either side
waits for the bytes.

Another process writes decode's pages, so a room that fails cannot always give its pages
back at once: a write may be in flight. Prefill counts each room's writes (a waiter thread
watches each write's event, `staged_sends`): once the room ended here and none is in
flight, none will start, and it says so (`RoomReleased`). Decode
keeps a failed room's pages until then, or until the prefill process is gone
(`IpcReceivePlane.pages_settled`). The handshake checks that both workers share a host and a PID
namespace, and that neither is tensor-parallel.

The interface is `data_plane`'s; the prefill side's plane is `ipc_send_plane`, the
decode side's `ipc_receive_plane`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.transfer.backends.ipc.shared_pools import host_id
from pdserve.transfer.data_plane import DataPlane

if TYPE_CHECKING:
    from pdserve.transfer.endpoint import Endpoint

OTHER_HOST = (
    "the ipc backend writes KV into the decode worker's memory, so both workers must run on "
    "one host, in one PID namespace: use --transfer-backend nccl or tcp between hosts"
)


class IpcPlane(DataPlane):
    def __init__(self, endpoint: Endpoint, pools: list[torch.Tensor] | None):
        """pools: this worker's KV pools (their whole storage tensors, target then draft)."""
        if not pools:
            raise ValueError("the ipc backend needs this worker's KV pools")
        self.endpoint = endpoint
        self.pools = pools
        self.host = host_id()
