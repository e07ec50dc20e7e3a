"""Runs the target model: one forward pass over a `ForwardBatch`, then logits for the rows that
need them (a token to sample, or a draft to verify).

Input preparation (flattening token ids, positions, cache slots) lives here so the model sees
only `(input_ids, positions)` plus the attention context.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention import AttentionContext
from pdserve.engine.forward_batch import Capture, ForwardBatch, ForwardOutput
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.models import CausalLM
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, SampleResult


class ModelRunner:
    def __init__(self, model: CausalLM, kv_pool: KVPool, sampler: Sampler, device: torch.device):
        self.model = model
        self.kv_pool = kv_pool
        self.sampler = sampler
        self.device = device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, capture: Capture = Capture.NONE) -> ForwardOutput:
        """The one forward pass, for plain steps, prefill chunks and speculative verification:
        every sequence's new tokens at once, KV written into their pages, and the features
        `capture` asks for.

        NOTE: the place a CUDA graph replays plain decode batches (`batch.is_decode`)."""
        ctx = AttentionContext.build(
            page_size=self.kv_pool.page_size,
            pages=batch.pages,
            num_computed=batch.num_computed,
            query_lens=batch.query_lens,
            device=self.device,
            positions=batch.explicit_positions(),
            masks=batch.masks or None,
        )
        ids = torch.tensor(batch.flat_token_ids(), dtype=torch.int64)
        ids = ids.to(self.device, non_blocking=True)
        if capture.kind == "layers":
            hidden, features = self.model.forward_capture(
                ids, ctx.positions, self.kv_pool, ctx, capture.layer_ids
            )
        else:
            hidden = self.model(ids, ctx.positions, self.kv_pool, ctx)
            features = hidden if capture.kind == "final" else None
        return ForwardOutput(batch, ctx.query_starts, hidden, features)

    @torch.inference_mode()
    def sample(
        self, output: ForwardOutput, seqs: list[int], requests: list[Request]
    ) -> SampleResult:
        """A token for each of `seqs` (indices into the pass's batch; `requests` are theirs),
        sampled from its last row."""
        rows = [output.last_row(i) for i in seqs]
        return self.sampler(self.model.compute_logits(output.hidden[rows]), requests)

    @torch.inference_mode()
    def logits(self, output: ForwardOutput, seqs: list[int]) -> list[torch.Tensor]:
        """Every row's logits for each of `seqs` (a verification reads them all)."""
        rows = [row for i in seqs for row in range(output.rows(i).start, output.rows(i).stop)]
        logits = self.model.compute_logits(output.hidden[rows])
        return list(logits.split([len(output.batch.token_ids[i]) for i in seqs]))
