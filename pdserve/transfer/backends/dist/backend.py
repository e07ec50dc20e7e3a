"""The `nccl` and `gloo` backends: KV over torch.distributed point-to-point links
(`dist_plane`, `dist_receive_plane`), each tensor-parallel rank moving its own KV heads;
nccl from and into GPU memory, gloo (its CPU stand-in) from and into host memory."""

from __future__ import annotations

import torch

from pdserve.transfer.backends.base import CPU, Backend
from pdserve.transfer.backends.dist.dist_plane import DistSendPlane
from pdserve.transfer.backends.dist.dist_receive_plane import DistReceivePlane


class DistBackend(Backend):
    per_rank = True

    @property
    def on_gpu(self) -> bool:
        return self.name == "nccl"

    def send_plane(self, server, device, fanout, pools) -> DistSendPlane:
        return DistSendPlane(server, device, fanout)

    def receive_plane(self, client, device, fanout, pools, metadata_bytes) -> DistReceivePlane:
        return DistReceivePlane(client, device, fanout)

    def send_device(self, compute_device: torch.device) -> torch.device:
        return compute_device if self.on_gpu else CPU

    def receive_device(self, compute_device: torch.device) -> torch.device:
        return compute_device if self.on_gpu else CPU

    def piece_device_type(self) -> str:
        return "cuda" if self.on_gpu else "cpu"
