"""Transfer settings shared by both sides; defaults are seconds, not minutes
(docs/architecture/transfer-states.md)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.flags import option
from pdserve.transfer.backends import BACKENDS, CLI_BACKENDS
from pdserve.transfer.peer_allow import PeerAllowList, default_allow_list, parse_allow_list

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
STREAMED_PIECE_BYTES = 64 << 20
IPC_TENSOR_PARALLEL = (
    "the ipc backend moves KV between workers without tensor parallelism: use "
    "--transfer-backend nccl for TP > 1"
)


@dataclass(frozen=True)
class TransferConfig:
    """progress_timeout_s: a room that makes no progress this long fails.
    peer_timeout_s: a peer silent this long is dead and fails all its rooms.
    chunk_bytes: KV is sent in messages of at most this size (never one per page).
    piece_bytes: a prefill worker sends a room's KV while it computes the prompt, in pieces
        of at least this many bytes (pages completed by a prefill chunk; the last piece takes
        the rest); 0 sends it whole after the prefill. Streaming is the default on every
        backend: it took 15% off an 8k prompt's time to commit over tcp and cost nothing over
        NCCL between two GPUs (benchmarks/RESULTS.md, issue 19).
    auth_token: when set, each side proves it holds it (challenge-response) before any
        registration or transfer request; it is never sent.
    bootstrap_allow: addresses/CIDRs a decode worker may contact (None: loopback and this
        host's attached networks, see peer_allow).
    max_peers: connections to peer workers kept at once (a bound on bookkeeping); on a
        prefill worker at most `max_peers_per_host` of them from one address, and idle ones
        (registered, serving none of this worker's rooms) give way to a new one.
    max_waiting_rooms / max_waiting_rooms_per_peer: rooms a prefill worker holds for decode
        peers' transfer requests whose prefill request has not arrived (in all, and per
        peer); the excess is refused at once.
    max_bootstrap_connections / max_bootstrap_connections_per_host: connections to a
        prefill worker's bootstrap port at once, in all and from one source address (more are
        refused at their handshake; the share of one host is a quarter, as for peers).
    heartbeat_interval_s: None sends one every quarter of `peer_timeout_s`, at most 1 s."""

    backend: str = option(
        "tcp",
        "tcp (ZMQ, anywhere), nccl (GPU to GPU), gloo (CPU stand-in for nccl), ipc (prefill "
        "writes straight into decode's pages: one host, no tensor parallelism)",
        name="--transfer-backend",
        choices=CLI_BACKENDS,
    )
    bootstrap_host: str = option(
        "127.0.0.1",
        "address for transfer endpoints (default: --host); use this node's reachable address "
        "across nodes",
    )
    bootstrap_port: int = option(
        8998, "where decode workers fetch KV from this prefill worker (0: pick a free port)"
    )
    progress_timeout_s: float = option(
        30.0, "seconds a room may make no progress before it fails", name="--transfer-timeout"
    )
    heartbeat_interval_s: float | None = None
    peer_timeout_s: float = option(
        5.0,
        "seconds of silence after which a peer worker counts as dead",
        name="--transfer-peer-timeout",
    )
    tombstone_ttl_s: float = 120.0
    chunk_bytes: int = 64 << 20
    piece_bytes: int = option(
        STREAMED_PIECE_BYTES,
        "send KV while the prompt is computed, in pieces of at least this many bytes (0: "
        "whole, after the prefill)",
        name="--transfer-piece-bytes",
    )
    send_timeout_s: float = 5.0
    auth_token: str = option(
        "",
        "shared secret both workers present",
        name="--transfer-token",
        secret_env="PDSERVE_TRANSFER_TOKEN",
    )
    queue_timeout_s: float = 120.0
    bootstrap_allow: tuple[str, ...] | None = option(
        None,
        "comma-separated addresses/CIDRs of prefill workers this decode worker may contact "
        "(default: loopback and this host's attached networks)",
        separator=",",
    )
    max_peers: int = 256
    max_peers_per_host: int = 64
    max_waiting_rooms: int = 4096
    max_waiting_rooms_per_peer: int = 1024
    max_bootstrap_connections: int = 1024
    max_bootstrap_connections_per_host: int = 256

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s is None:
            object.__setattr__(self, "heartbeat_interval_s", min(1.0, self.peer_timeout_s / 4))
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
            "queue_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_interval_s >= self.peer_timeout_s:
            raise ValueError("heartbeat_interval_s must be shorter than peer_timeout_s")
        if self.chunk_bytes < 1 << 10:
            raise ValueError(f"chunk_bytes must be at least 1 KiB, got {self.chunk_bytes}")
        for name in (
            "max_peers",
            "max_peers_per_host",
            "max_waiting_rooms",
            "max_waiting_rooms_per_peer",
            "max_bootstrap_connections",
            "max_bootstrap_connections_per_host",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.piece_bytes < 0:
            raise ValueError(
                f"--transfer-piece-bytes must be >= 0 (0: send whole), got {self.piece_bytes}"
            )
        if self.bootstrap_allow is not None:
            parse_allow_list(self.bootstrap_allow)

    def allow_list(self) -> PeerAllowList:
        """The prefill addresses a decode worker may contact."""
        if self.bootstrap_allow is None:
            return PeerAllowList(default_allow_list(self.bootstrap_host))
        return PeerAllowList(parse_allow_list(self.bootstrap_allow))
