"""Which job a worker does: colocated (prefill and decode in one), prefill, or decode.

A disaggregated worker role *has* a transfer config; the engine process builds the role's
handoff (`pdserve.prefill` / `pdserve.decode`) from it. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.transfer.config import TransferConfig

ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class WorkerRole:
    kind: str = "colocated"
    transfer: TransferConfig | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.kind!r}")
        if (self.kind == "colocated") != (self.transfer is None):
            raise ValueError("prefill and decode workers need a transfer config; colocated none")

    @property
    def disaggregated(self) -> bool:
        return self.kind != "colocated"
