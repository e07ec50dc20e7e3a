"""What the prefill and decode handoffs share: the engine's KV layout for the handshake,
failure outputs, and failure counting by stage and kind. Bookkeeping here is torch-free."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.page_allocator import pages_needed
from pdserve.protocol.failures import Failure, FailureKind, FailureStage
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import KVLayout, SpecLayout
from pdserve.transfer.handshake import model_fingerprint
from pdserve.transfer.kv_staging import KVStager

# Failure kinds, a closed set so metric labels stay bounded.
FAILURE_KINDS = ("timeout", "peer_lost", "handshake", "aborted", "rejected", "no_pages", "error")


@dataclass(frozen=True)
class EngineTransferLayout:
    """What a worker's engine moves per request: the layout compared at registration, the
    metadata record's sizes, and the KV pools (target, then the draft's if any) whose pages
    travel, all sharing one list of page ids."""

    layout: KVLayout
    metadata: MetadataSpec
    stager: KVStager

    def page_lists(self, pages: list[int]) -> list[list[int]]:
        return [pages] * len(self.stager.pools)

    def transfer_pages(self, engine, pages: list[int], num_prompt_tokens: int) -> list[int]:
        """The pages that hold the KV a handoff moves for this prompt."""
        count = pages_needed(
            engine.kv_tokens_for_transfer(num_prompt_tokens), engine.config.page_size
        )
        if len(pages) < count:
            raise RuntimeError(f"{len(pages)} pages held, the transfer needs {count}")
        return pages[:count]


def engine_transfer_layout(engine) -> EngineTransferLayout:
    """The engine's layout, metadata record and pools, speculative settings included."""
    pool = engine.kv_pool
    spec, metadata, draft_pools = SpecLayout(), MetadataSpec(), []
    if engine.speculator is not None:
        algorithm = engine.speculator.algorithm
        settings = algorithm.settings
        draft_config = algorithm.draft_config()
        metadata = algorithm.metadata_spec(draft_config, str(engine.dtype).removeprefix("torch."))
        draft_pools = algorithm.draft_pools()
        spec = SpecLayout(
            algorithm=algorithm.name,
            topk=settings.eagle_topk,
            num_steps=settings.num_steps,
            num_draft_tokens=settings.num_draft_tokens,
            spec_hidden_size=metadata.hidden_size,
            hidden_dtype=metadata.hidden_dtype,
            has_draft_kv=bool(draft_pools),
            draft_num_layers=sum(p.num_layers for p in draft_pools),
            draft_fingerprint=model_fingerprint(draft_config) if draft_config else "",
        )
    layout = KVLayout(
        model_fingerprint=model_fingerprint(engine.model_config.hf_config),
        num_layers=pool.num_layers,
        num_kv_heads=pool.num_kv_heads,
        head_dim=pool.head_dim,
        page_size=pool.page_size,
        kv_dtype=str(pool.dtype).removeprefix("torch."),
        spec=spec,
    )
    return EngineTransferLayout(layout, metadata, KVStager([pool, *draft_pools]))


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


# NOTE: until the transfer reports typed failures, its text reason's kind (`failure_kind`)
# names the FailureKind; the two kinds that are not FailureKinds map here.
_UNAVAILABLE_KINDS = {"rejected": FailureKind.ABORTED, "error": FailureKind.TRANSFER}


def transfer_failure(reason: str, stage: str) -> Failure:
    """A room that failed on a worker's side or in the transfer (stage: "bootstrap" or
    "transfer"): a kind that a retry on another pair may fix. A peer's rejection is the peer
    ending the room (ABORTED); whether the request itself was at fault is the caller's call."""
    kind = failure_kind(reason)
    return Failure(_UNAVAILABLE_KINDS.get(kind) or FailureKind(kind), FailureStage(stage), reason)


class FailureCounts:
    """Failures by "stage/kind": stage is `bootstrap` (before any KV moved) or `transfer`."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, stage: str, reason: str) -> None:
        self.counts[f"{stage}/{failure_kind(reason)}"] += 1


def room_in_use(request_id: str, prompt_ids: list[int], room: int) -> RequestOutput:
    reason = f"bootstrap_room {room} is already in use"
    failure = Failure(FailureKind.INVALID, FailureStage.BOOTSTRAP, reason)
    return failed_output(request_id, prompt_ids, failure)


def failed_output(request_id: str, prompt_ids: list[int], failure: Failure) -> RequestOutput:
    """The last output of a request that failed in its handoff."""
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        token_ids=[],
        new_token_ids=[],
        finished=True,
        finish_reason="abort",
        failure=failure,
    )
