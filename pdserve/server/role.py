"""Which job a worker does: colocated (prefill and decode in one), prefill, or decode.

The command line builds the role: its kind, the `WorkerFactory` that builds the role's engine
and handoff in the engine process (`pdserve.{colocated,prefill,decode}.worker`, with the
transfer settings bound for a disaggregated role), and the name of its transfer backend for
`/server_info`. The server only hands the factory on, so it never imports a role package.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_connector import WorkerFactory

ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class WorkerRole:
    kind: str
    build_worker: WorkerFactory
    transfer_backend: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.kind!r}")
        if (self.kind == "colocated") != (self.transfer_backend is None):
            raise ValueError("prefill and decode workers need a transfer backend; colocated none")

    @property
    def disaggregated(self) -> bool:
        return self.kind != "colocated"
