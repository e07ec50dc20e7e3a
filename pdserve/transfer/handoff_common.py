"""What the prefill and decode handoffs share: the engine's KV layout for the handshake,
failure outputs, and failure counting by stage and kind. Bookkeeping here is torch-free."""

from __future__ import annotations

from collections import Counter

from pdserve.engine.outputs import RequestOutput
from pdserve.protocol.transfer_messages import KVLayout, SpecLayout
from pdserve.transfer.handshake import model_fingerprint

# Failure kinds, a closed set so metric labels stay bounded.
FAILURE_KINDS = ("timeout", "peer_lost", "handshake", "aborted", "rejected", "no_pages", "error")


def engine_kv_layout(engine) -> KVLayout:
    """The layout both sides compare at registration (target model, no speculation yet)."""
    pool = engine.kv_pool
    return KVLayout(
        model_fingerprint=model_fingerprint(engine.model_config.hf_config),
        num_layers=pool.num_layers,
        num_kv_heads=pool.num_kv_heads,
        head_dim=pool.head_dim,
        page_size=pool.page_size,
        kv_dtype=str(pool.dtype).removeprefix("torch."),
        spec=SpecLayout(),
    )


def failure_kind(reason: str) -> str:
    """Map a failure reason to one of FAILURE_KINDS (for metrics)."""
    text = reason.lower()
    for needle, kind in (
        ("kv pages", "no_pages"),
        ("timed out", "timeout"),
        ("silent", "peer_lost"),
        ("link", "peer_lost"),
        ("handshake", "handshake"),
        ("mismatch", "handshake"),
        ("authentication", "handshake"),
        ("rejected", "rejected"),
        ("abort", "aborted"),
        ("disconnect", "aborted"),
    ):
        if needle in text:
            return kind
    return "error"


class FailureCounts:
    """Failures by "stage/kind": stage is `bootstrap` (before any KV moved) or `transfer`."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, stage: str, reason: str) -> None:
        self.counts[f"{stage}/{failure_kind(reason)}"] += 1


def room_in_use(request_id: str, prompt_ids: list[int], room: int) -> RequestOutput:
    reason = f"bootstrap_room {room} is already in use"
    return failed_output(request_id, prompt_ids, reason, "invalid")


def failed_output(
    request_id: str, prompt_ids: list[int], reason: str, kind: str = "unavailable"
) -> RequestOutput:
    """kind: "invalid" when the request itself is at fault, "unavailable" when a worker or
    the transfer failed (a retry on another pair may succeed)."""
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        token_ids=[],
        text="",
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="abort",
        error=reason,
        error_kind=kind,
    )
