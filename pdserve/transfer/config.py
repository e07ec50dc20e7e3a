"""Transfer settings shared by both sides; defaults are seconds, not minutes (DESIGN.md §3)."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("tcp", "nccl", "gloo")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class TransferConfig:
    """progress_timeout_s: a room that makes no progress this long fails.
    peer_timeout_s: a peer silent this long is dead and fails all its rooms.
    chunk_bytes: KV is sent in messages of at most this size (never one per page).
    auth_token: when set, registration and transfer requests must carry it."""

    backend: str = "tcp"
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    progress_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    peer_timeout_s: float = 5.0
    tombstone_ttl_s: float = 120.0
    chunk_bytes: int = 64 << 20
    send_timeout_s: float = 5.0
    auth_token: str = ""

    def __post_init__(self) -> None:
        if self.bootstrap_host in WILDCARD_HOSTS:
            raise ValueError(
                f"the bootstrap host {self.bootstrap_host!r} is told to peer workers, so it "
                "must be this node's reachable address, not a wildcard: give --bootstrap-host "
                "(it defaults to --host)"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"transfer backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in (
            "progress_timeout_s",
            "heartbeat_interval_s",
            "peer_timeout_s",
            "tombstone_ttl_s",
            "send_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_interval_s >= self.peer_timeout_s:
            raise ValueError("heartbeat_interval_s must be shorter than peer_timeout_s")
        if self.chunk_bytes < 1 << 10:
            raise ValueError(f"chunk_bytes must be at least 1 KiB, got {self.chunk_bytes}")
