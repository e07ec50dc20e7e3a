"""Runs one scheduled batch through the model and samples the requests that reached their end.

Input preparation (flattening token slices, positions, cache slots) lives here so the model
sees only `(input_ids, positions)` plus the attention context.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention import AttentionContext
from pdserve.engine.decode_graphs import DecodeGraphRunner
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.models import CausalLM
from pdserve.engine.sampler import Sampler, SampleResult
from pdserve.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        sampler: Sampler,
        device: torch.device,
        decode_graphs: DecodeGraphRunner | None = None,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.sampler = sampler
        self.device = device
        self.decode_graphs = decode_graphs

    def run(self, batch: ScheduledBatch) -> tuple[list[int], SampleResult]:
        """Compute the batch's new tokens; return the indices (into the batch) of requests that
        sampled a token and what they sampled."""
        sampling, result, _ = self.run_with_features(batch, None)
        return sampling, result

    @torch.inference_mode()
    def run_with_features(
        self, batch: ScheduledBatch, capture: str | tuple[int, ...] | None
    ) -> tuple[list[int], SampleResult, torch.Tensor | None]:
        """`run`, also returning the target features a draft model reads, one row per new
        token: the final hidden states (capture "final"), the outputs of the given layers
        side by side (a tuple of layer ids), or None."""
        requests = batch.requests
        sampling = [i for i in range(len(batch)) if batch.samples(i)]
        graphs = self.decode_graphs
        if capture is None and graphs is not None and graphs.can_run(batch.num_new_tokens):
            hidden = graphs.run(requests)
            rows = hidden if len(sampling) == len(batch) else hidden[sampling]
            logits = self.model.compute_logits(rows)
            return sampling, self.sampler(logits, [requests[i] for i in sampling]), None
        input_ids = [
            token
            for request, count in zip(requests, batch.num_new_tokens, strict=True)
            for token in request.token_ids[
                request.num_computed_tokens : request.num_computed_tokens + count
            ]
        ]
        ctx = AttentionContext.build(
            page_size=self.kv_pool.page_size,
            pages=[r.pages for r in requests],
            num_computed=[r.num_computed_tokens for r in requests],
            query_lens=batch.num_new_tokens,
            device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        features = None
        if isinstance(capture, tuple):
            hidden, features = self.model.forward_capture(
                ids, ctx.positions, self.kv_pool, ctx, capture
            )
        else:
            hidden = self.model(ids, ctx.positions, self.kv_pool, ctx)
            features = hidden if capture == "final" else None
        last_rows = [ctx.query_starts[i] + ctx.query_lens[i] - 1 for i in sampling]
        logits = self.model.compute_logits(hidden[last_rows])
        return sampling, self.sampler(logits, [requests[i] for i in sampling]), features
