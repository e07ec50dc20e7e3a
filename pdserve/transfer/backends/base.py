"""What a transfer backend is: the data planes it builds for each side (`data_plane`'s
interface: they own the bytes of a room's KV, from gathering on the sending side to the
commit on the receiving side) and the facts the handoffs and endpoints ask it instead of
comparing backend names. Each fact's default is the plain one (pieces in host memory, sent
over the control connection); a backend overrides what differs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from pdserve.transfer.wire_limits import MAX_DECODE_MESSAGE_BYTES

if TYPE_CHECKING:
    from pdserve.protocol.transfer_messages import TransferRequest
    from pdserve.transfer.backends.dist.rank_fanout import RankFanout
    from pdserve.transfer.data_plane import DataPlane

CPU = torch.device("cpu")


class Backend(ABC):
    # Each tensor-parallel rank moves its own KV heads over torch.distributed (a per-rank
    # stager, `rank_fanout`), instead of rank 0 moving every head.
    per_rank = False
    # The sender writes straight into decode's pages (the receiver commits nothing).
    writes_decode_pages = False
    # Both workers must share the KV pools' storage (`disagg.handoff_base.ipc_pools`).
    needs_pools = False
    # Seconds between polls of a staged GPU piece's copy (on the handoff's critical path
    # where the piece is the write itself).
    stage_poll_s = 1e-3

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ---- the planes ------------------------------------------------------------------

    @abstractmethod
    def send_plane(
        self, server, device: torch.device, fanout: RankFanout | None, pools
    ) -> DataPlane:
        """The prefill side's plane: sends a room's pieces from `device`."""

    @abstractmethod
    def receive_plane(
        self, client, device: torch.device, fanout: RankFanout | None, pools, metadata_bytes: int
    ) -> DataPlane:
        """The decode side's plane: receives a room's pieces into `device`."""

    # ---- facts -----------------------------------------------------------------------

    def send_device(self, compute_device: torch.device) -> torch.device:
        """Where a prefill worker's pieces are sent from (its KV is computed on
        `compute_device`)."""
        return CPU

    def receive_device(self, compute_device: torch.device) -> torch.device:
        """Where a decode worker receives pieces (its pools live on `compute_device`)."""
        return CPU

    def piece_device_type(self) -> str:
        """The device type a piece's buffers must be on when handed to `send_piece`."""
        return "cpu"

    def stages_gpu_pieces(self, send_device: torch.device) -> bool:
        """Pieces computed on a GPU are copied (without blocking) before they are sent, and
        sent once the copy completed."""
        return send_device.type == "cpu"

    def max_decode_message_bytes(self, max_room_pages: int) -> int:
        """The largest message a prefill worker accepts from a decode worker."""
        return MAX_DECODE_MESSAGE_BYTES

    def check_tensor_parallel(self, tp_size: int, where: str) -> None:
        """ValueError (its message led by `where`, the flag or worker) if a worker of this
        tensor-parallel size cannot use the backend."""
        return None

    def register_problem(self, theirs: str) -> str | None:
        """Prefill, at a decode worker's registration: why its backend `theirs` cannot be
        ours, if it cannot."""
        if theirs != self.name:
            return f"transfer backend: prefill {self.name!r} != decode {theirs!r}"
        return None

    def transfer_request(self, request: TransferRequest, receiver) -> TransferRequest:
        """Decode: what the backend adds to a room's transfer request."""
        return request
