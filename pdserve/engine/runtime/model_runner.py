"""Runs the target model: one forward pass over a `ForwardBatch`, then logits for the rows that
need them (a token to sample, or a draft to verify).

Input preparation (flattening token ids, positions, cache slots) lives here so the model sees
only `(input_ids, positions)` plus the attention context. On rank 0 of a tensor-parallel
worker, every pass, logits computation and KV move is announced to the other ranks first
(`RankGroup`), which run the same calls (`rank_worker.py`).
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from pdserve.engine.core.request import Request
from pdserve.engine.runtime.attention import AttentionContext
from pdserve.engine.runtime.decode_graphs import DecodeGraphRunner
from pdserve.engine.runtime.forward_batch import Capture, ForwardBatch, ForwardOutput, device_ints
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.engine.runtime.models import CausalLM
from pdserve.engine.runtime.models.decoder import MicroBatch
from pdserve.engine.runtime.overlap import resolve_placeholders
from pdserve.engine.runtime.sampler import Sampler, SampleResult


class FollowerRanks(Protocol):
    """The other ranks of a tensor-parallel worker, as rank 0's runner drives them
    (`pdserve.engine.ranks.rank_group.RankGroup`): each call is announced to them before rank 0
    runs it, so every rank runs the same collectives."""

    def forward(
        self,
        batch: ForwardBatch,
        capture: Capture,
        graphs: str | None,
        device_tokens: torch.Tensor | None,
    ) -> None: ...

    def logits(self, rows: list[int] | None) -> None: ...

    def move_kv(self, src: list[int], dst: list[int]) -> None: ...

    def abandon(self, reason: str) -> Exception:
        """The group is unusable (a rank died or a collective failed): the error to raise."""


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        sampler: Sampler | None,
        device: torch.device,
        decode_graphs: DecodeGraphRunner | None = None,
        verify_graphs: DecodeGraphRunner | None = None,
        ranks: FollowerRanks | None = None,
        two_batch_min_tokens: int = 0,
    ):
        """`decode_graphs` replays plain decode batches; `verify_graphs` (speculative
        decoding) batches of up to its `tokens_per_seq` tokens per sequence. `ranks`: the
        other ranks of a tensor-parallel worker (on rank 0). `sampler`: None on the other
        ranks (they never sample). `two_batch_min_tokens`: under tensor parallelism, eager
        plain passes of at least this many tokens run as two halves whose all-reduces
        overlap each other's compute (0: never)."""
        self.model = model
        self.kv_pool = kv_pool
        self.sampler = sampler
        self.device = device
        self.graphs = {"decode": decode_graphs, "verify": verify_graphs}
        self.ranks = ranks
        self.two_batch_min_tokens = two_batch_min_tokens if getattr(model, "tp", None) else 0

    @property
    def decode_graphs(self) -> DecodeGraphRunner | None:
        return self.graphs["decode"]

    @property
    def verify_graphs(self) -> DecodeGraphRunner | None:
        return self.graphs["verify"]

    def _graphs_for(self, batch: ForwardBatch, capture: Capture) -> str:
        """The graph runner that replays this batch ("" for none: it runs eagerly)."""
        for name, graphs in self.graphs.items():
            if graphs is not None and graphs.capture_kind == capture and graphs.can_run(batch):
                return name
        return ""

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        capture: Capture = Capture.NONE,
        device_tokens: torch.Tensor | None = None,
        *,
        graphs: str | None = None,
    ) -> ForwardOutput:
        """The one forward pass, for plain steps, prefill chunks and speculative verification:
        every sequence's new tokens at once, KV written into their pages, and the features
        `capture` asks for. Decode and verification batches replay a CUDA graph, whose
        runner keeps the engine's capture. `device_tokens`: what placeholder ids stand
        for (tokens an overlapped step sampled, or proposals drafted on the device).
        `graphs`: on a rank other than 0, the graph runner rank 0 replays (checked)."""
        chosen = self._graphs_for(batch, capture)
        if graphs is not None and graphs != chosen:
            # NOTE: every rank must replay the same graph (or none): collectives pair up.
            raise RuntimeError(f"rank 0 replays graphs {graphs!r}; this rank chose {chosen!r}")
        if self.ranks is None:
            return self._forward(batch, capture, device_tokens, chosen)
        try:
            self.ranks.forward(batch, capture, chosen, device_tokens)
            return self._forward(batch, capture, device_tokens, chosen)
        except Exception as e:
            raise self.ranks.abandon(f"rank 0's forward pass failed: {e}") from e

    def _forward(
        self,
        batch: ForwardBatch,
        capture: Capture,
        device_tokens: torch.Tensor | None,
        chosen: str,
    ) -> ForwardOutput:
        if chosen:
            runner = self.graphs[chosen]
            hidden, features = runner.run(batch, device_tokens)
            # NOTE: the graph's output buffers are overwritten by the next replay; a draft
            # may keep the features past this step.
            if capture.kind == "final":
                features = hidden
            features = None if features is None else features.clone()
            return ForwardOutput(batch, runner.query_starts(len(batch)), hidden, features)
        if self._runs_as_two(batch):
            return self._forward_two_batches(batch, capture, device_tokens)
        ctx = self._context(batch)
        ids = self._device_ids(batch, device_tokens)
        if capture.kind == "layers":
            hidden, features = self.model.forward_capture(
                ids, ctx.positions, self.kv_pool, ctx, capture.layer_ids
            )
        else:
            hidden = self.model(ids, ctx.positions, self.kv_pool, ctx)
            features = hidden if capture.kind == "final" else None
        return ForwardOutput(batch, ctx.query_starts, hidden, features)

    def _context(self, batch: ForwardBatch) -> AttentionContext:
        return AttentionContext.build(
            page_size=self.kv_pool.page_size,
            pages=batch.pages,
            num_computed=batch.num_computed,
            query_lens=batch.query_lens,
            device=self.device,
            positions=batch.explicit_positions(),
            masks=batch.masks or None,
        )

    def _device_ids(self, batch: ForwardBatch, device_tokens: torch.Tensor | None) -> torch.Tensor:
        ids = device_ints(batch.flat_token_ids(), self.device)
        if device_tokens is not None:
            ids = resolve_placeholders(ids, device_tokens)
        return ids

    def _runs_as_two(self, batch: ForwardBatch) -> bool:
        """Whether this eager pass runs as two halves (`two_batch_min_tokens`). Every rank
        decides the same from the same pass: their collectives pair up."""
        return (
            0 < self.two_batch_min_tokens <= batch.num_tokens
            and not batch.masks
            and not batch.has_explicit_positions
        )

    def _forward_two_batches(
        self, batch: ForwardBatch, capture: Capture, device_tokens: torch.Tensor | None
    ) -> ForwardOutput:
        """The pass as its first and second half of tokens, layer by layer side by side, so
        that each half's all-reduces run while the other half computes."""
        parts = batch.split_tokens(batch.num_tokens // 2)
        ids, halves = [], []
        for part in parts:
            ctx = self._context(part)
            ids.append(self._device_ids(part, device_tokens))
            halves.append(MicroBatch(ctx))
        hidden, features = self.model.forward_two_batches(
            ids, halves, self.kv_pool, capture.layer_ids
        )
        if capture.kind == "final":
            features = hidden
        starts = list(itertools.accumulate(batch.query_lens[:-1], initial=0))
        return ForwardOutput(batch, starts, hidden, features)

    @torch.inference_mode()
    def sample(
        self, output: ForwardOutput, seqs: list[int], requests: list[Request]
    ) -> SampleResult:
        """A token for each of `seqs` (indices into the pass's batch; `requests` are theirs),
        sampled from its last row."""
        return self.sampler(self._logits_of_last_rows(output, seqs), requests)

    def _logits_of_last_rows(self, output: ForwardOutput, seqs: list[int]) -> torch.Tensor:
        if len(seqs) == output.hidden.shape[0]:
            return self.compute_logits(output, None)  # every row samples (a decode step)
        return self.compute_logits(output, [output.last_row(i) for i in seqs])

    def compute_logits(self, output: ForwardOutput, rows: list[int] | None) -> torch.Tensor:
        """Logits of the pass's `rows` (None: every row, in order: no gather)."""
        if self.ranks is None:
            return self._compute_logits(output, rows)
        try:
            self.ranks.logits(rows)
            return self._compute_logits(output, rows)
        except Exception as e:
            raise self.ranks.abandon(f"rank 0's logits failed: {e}") from e

    def _compute_logits(self, output: ForwardOutput, rows: list[int] | None) -> torch.Tensor:
        hidden = output.hidden
        if rows is not None:
            hidden = hidden.index_select(0, device_ints(rows, self.device))
        return self.model.compute_logits(hidden)

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy KV from flat slots `src` to `dst` on every rank (accepted tree drafts)."""
        if self.ranks is not None:
            try:
                self.ranks.move_kv(src, dst)
            except Exception as e:
                raise self.ranks.abandon(f"a KV move failed: {e}") from e
        self.kv_pool.copy_slots(device_ints(src, self.device), device_ints(dst, self.device))

    @torch.inference_mode()
    def sample_on_device(
        self, output: ForwardOutput, seqs: list[int], requests: list[Request]
    ) -> torch.Tensor:
        """`sample`'s tokens, left on the device (no logprobs: what overlapped steps take)."""
        return self.sampler.sample(self._logits_of_last_rows(output, seqs), requests)

    @torch.inference_mode()
    def logits(self, output: ForwardOutput, seqs: list[int]) -> torch.Tensor:
        """Every row's logits of each of `seqs` in turn (a verification reads them all)."""
        rows = [row for i in seqs for row in range(output.rows(i).start, output.rows(i).stop)]
        every_row = rows == list(range(output.hidden.shape[0]))
        return self.compute_logits(output, None if every_row else rows)
