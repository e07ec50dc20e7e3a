"""The `ipc` backend: prefill writes KV straight into decode's pages, both workers on one
host (`ipc_plane` says how), neither tensor-parallel."""

from __future__ import annotations

import dataclasses

import torch

from pdserve.transfer.backends.base import Backend
from pdserve.transfer.backends.ipc.ipc_receive_plane import IpcReceivePlane
from pdserve.transfer.backends.ipc.ipc_send_plane import IpcSendPlane
from pdserve.transfer.config import IPC_TENSOR_PARALLEL
from pdserve.transfer.page_ids import pack_page_ids
from pdserve.transfer.wire_limits import MAX_DECODE_MESSAGE_BYTES, PAGE_ID_BYTES


class IpcBackend(Backend):
    writes_decode_pages = True
    needs_pools = True
    # NOTE: a write's completion is on the handoff's critical path: polled closely.
    stage_poll_s = 20e-6

    def send_plane(self, server, device, fanout, pools) -> IpcSendPlane:
        return IpcSendPlane(server, pools)

    def receive_plane(self, client, device, fanout, pools, metadata_bytes) -> IpcReceivePlane:
        return IpcReceivePlane(client, pools, metadata_bytes)

    def receive_device(self, compute_device: torch.device) -> torch.device:
        return compute_device  # NOTE: decode waits for prefill's writes on the pool's device

    def piece_device_type(self) -> str:
        return "cuda"

    def stages_gpu_pieces(self, send_device: torch.device) -> bool:
        return True

    def max_decode_message_bytes(self, max_room_pages: int) -> int:
        """A transfer request also lists the room's page ids (target and draft, at most
        `max_room_pages` each)."""
        return MAX_DECODE_MESSAGE_BYTES + 2 * PAGE_ID_BYTES * max_room_pages

    def check_tensor_parallel(self, tp_size: int, where: str) -> None:
        if tp_size > 1:
            raise ValueError(f"{where}: {IPC_TENSOR_PARALLEL}")

    def transfer_request(self, request, receiver):
        """Prefill writes these pages itself: it is told their ids."""
        return dataclasses.replace(
            request,
            page_ids=pack_page_ids(receiver.page_ids),
            draft_page_ids=pack_page_ids(receiver.draft_page_ids),
        )
