"""The engine's KV layout as both handoffs move it: the layout compared at registration, the
metadata record's sizes, and the pools whose pages travel."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.disagg.per_rank_kv import PerRankKV
from pdserve.disagg.tensor_parallel_stager import TensorParallelStager
from pdserve.engine.core.page_allocator import pages_needed
from pdserve.protocol.metadata_spec import MetadataSpec
from pdserve.protocol.transfer_messages import KVLayout, SpecLayout
from pdserve.transfer.handshake import model_fingerprint
from pdserve.transfer.kv_staging import KVStager


@dataclass(frozen=True)
class EngineTransferLayout:
    """What a worker's engine moves per request: the layout compared at registration, the
    metadata record's sizes, and the KV pools (target, then the draft's if any) whose pages
    travel, all sharing one list of page ids."""

    layout: KVLayout
    metadata: MetadataSpec
    # Per-rank-pair links (nccl, gloo): a PerRankKV. tcp: a KVStager, or a
    # TensorParallelStager for a tensor-parallel worker (its KV goes through rank 0).
    stager: KVStager | PerRankKV

    def transfer_pages(self, engine, pages: list[int], num_prompt_tokens: int) -> list[int]:
        """The pages that hold the KV a handoff moves for this prompt."""
        count = pages_needed(
            engine.kv_tokens_for_transfer(num_prompt_tokens), engine.config.page_size
        )
        if len(pages) < count:
            raise RuntimeError(f"{len(pages)} pages held, the transfer needs {count}")
        return pages[:count]


def engine_transfer_layout(engine, per_rank_links: bool) -> EngineTransferLayout:
    """The engine's layout, metadata record and pools, speculative settings included;
    `per_rank_links`: each rank moves its own KV heads (the torch.distributed backends)."""
    pool = engine.kv_pool
    spec, metadata, draft_pools = SpecLayout(), MetadataSpec(), []
    if engine.speculator is not None:
        draft = engine.speculator.handoff(str(engine.dtype).removeprefix("torch."))
        metadata, draft_pools = draft.metadata, draft.draft_pools
        spec = SpecLayout(
            algorithm=draft.algorithm,
            topk=draft.topk,
            num_steps=draft.num_steps,
            num_draft_tokens=draft.num_draft_tokens,
            spec_hidden_size=metadata.hidden_size,
            hidden_dtype=metadata.hidden_dtype,
            has_draft_kv=bool(draft_pools),
            draft_num_layers=sum(p.num_layers for p in draft_pools),
            draft_fingerprint=model_fingerprint(draft.draft_config) if draft.draft_config else "",
        )
    if per_rank_links:
        stager = PerRankKV(pool, draft_pools, engine.ranks, engine.model_config.num_kv_heads)
    elif engine.ranks is not None:
        # NOTE: the wire carries every KV head, as a TP 1 worker's pages hold them, so that
        # workers at any TP sizes pair (`TensorParallelStager`).
        stager = TensorParallelStager(engine.ranks, pool, draft_pools)
    else:
        stager = KVStager([pool, *draft_pools])
    layout = KVLayout(
        model_fingerprint=model_fingerprint(engine.model_config.hf_config),
        num_layers=pool.num_layers,
        num_kv_heads=engine.model_config.num_kv_heads,
        head_dim=pool.head_dim,
        page_size=pool.page_size,
        kv_dtype=str(pool.dtype).removeprefix("torch."),
        spec=spec,
    )
    return EngineTransferLayout(layout, metadata, stager)
