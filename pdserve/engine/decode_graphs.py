"""Decode steps replayed from CUDA graphs.

A decode step launches a few hundred small kernels; launched one by one from Python, the host
takes several times longer than the GPU needs to run them. A CUDA graph records the whole
forward once per batch-size bucket and replays it with one launch.

A graph reads its inputs from fixed addresses, so every step writes them into static buffers:
token ids, positions, cache slots, page-table rows and KV lengths are packed in one pinned
host buffer and copied to the device in one transfer; page ids come from the persistent
`DevicePageTable`. A batch runs in the smallest bucket that holds it; the padding rows have
slot -1 (nothing stored) and KV length 0 (nothing read), and their outputs are ignored.
The graph's output is the final hidden states; logits are computed outside it for the real
rows only.

Without CUDA (tests under the Triton interpreter) the same padded static inputs run eagerly,
so everything but the capture itself is exercised on CPU.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from pdserve.engine.attention import AttentionBackend, AttentionContext
from pdserve.engine.config import EngineConfig
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.models import CausalLM
from pdserve.engine.overlap import resolve_placeholders
from pdserve.engine.page_table import DevicePageTable

logger = logging.getLogger(__name__)

# Rows of the static input buffer.
_IDS, _POSITIONS, _SLOTS, _TABLE_ROWS, _KV_LENS = range(5)
# A padding row's values, in the same order: token 0 at position 0, stored nowhere, no KV.
_PADDING = (0, 0, -1, 0, 0)


def graph_batch_size(
    config: EngineConfig, backend: AttentionBackend, device: torch.device | None = None
) -> int:
    """The largest decode batch run over static inputs, 0 for none (graphs disabled, or a
    backend that cannot be captured). With `device`, 0 also where nothing is captured (CPU)."""
    if config.disable_cuda_graph or not backend.graph_capturable:
        return 0
    if device is not None and device.type != "cuda":
        return 0
    return min(config.cuda_graph_max_bs, config.max_running_requests)


def build_decode_graphs(
    config: EngineConfig,
    backend: AttentionBackend,
    model: CausalLM,
    kv_pool: KVPool,
    page_table: DevicePageTable,
    device: torch.device,
) -> DecodeGraphRunner | None:
    """The engine's decode graph runner, captured on CUDA; without CUDA (the Triton
    interpreter) it runs the same static inputs eagerly. None where graphs are off."""
    max_bs = graph_batch_size(config, backend)
    if not max_bs:
        return None
    runner = DecodeGraphRunner(model, kv_pool, page_table, max_bs, device)
    if device.type == "cuda":
        runner.capture()
    return runner


def batch_buckets(max_bs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 8 up to `max_bs` (and
    `max_bs` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += range(16, max_bs + 1, 8)
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphRunner:
    """Runs decode batches (one new token per request) of up to `max_bs` requests over static
    inputs: replayed from graphs once `capture()` has run, eagerly before (or without CUDA)."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        page_table: DevicePageTable,
        max_bs: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.page_table = page_table
        self.device = device
        self.buckets = batch_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        pin = device.type == "cuda"
        self._host = torch.zeros((len(_PADDING), self.max_bs), dtype=torch.int64, pin_memory=pin)
        self._host_rows = self._host.numpy()
        self._inputs = torch.zeros_like(self._host, device=device)
        hidden_size = model.config.hidden_size
        dtype = model.lm_head.weight.dtype
        self._hidden = torch.zeros((self.max_bs, hidden_size), dtype=dtype, device=device)
        self._contexts = {bs: self._context(bs) for bs in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Recorded after each copy out of the pinned buffer: the next step (prepared while
        # this one may still be queued, with overlap scheduling) waits for it before
        # overwriting the buffer.
        self._copied = torch.cuda.Event() if pin else None
        # Steps per bucket, replayed from a graph and run eagerly (statistics, tests).
        self.replays: Counter[int] = Counter()
        self.eager_runs: Counter[int] = Counter()

    def can_run(self, batch: ForwardBatch) -> bool:
        """A plain decode batch of known requests that a bucket holds."""
        return batch.is_decode and len(batch) <= self.max_bs and None not in batch.requests

    def bucket_for(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states `[len(batch), hidden]` of a decode batch (`can_run`), its KV
        written to the cache. A view of a static buffer: the next run overwrites it.
        `previous_tokens`: what the batch's placeholder ids stand for (overlap.py)."""
        bs = len(batch)
        bucket = self.bucket_for(bs)
        if self._copied is not None:
            self._copied.synchronize()
        self._fill(batch, bucket)
        self._inputs.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if previous_tokens is not None:
            ids = self._inputs[_IDS]
            ids.copy_(resolve_placeholders(ids, previous_tokens))
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
            self.replays[bucket] += 1
        else:
            self._forward(bucket)
            self.eager_runs[bucket] += 1
        return self._hidden[:bs]

    def _fill(self, batch: ForwardBatch, bucket: int) -> None:
        size = self.kv_pool.page_size
        positions = batch.num_computed
        slots = [
            pages[n // size] * size + n % size
            for pages, n in zip(batch.pages, positions, strict=True)
        ]
        bs = len(batch)
        host = self._host_rows
        host[_IDS, :bs] = [tokens[0] for tokens in batch.token_ids]
        host[_POSITIONS, :bs] = positions
        host[_SLOTS, :bs] = slots
        host[_TABLE_ROWS, :bs] = self.page_table.rows(batch.requests)
        host[_KV_LENS, :bs] = [n + 1 for n in positions]
        for field, value in enumerate(_PADDING):
            host[field, bs:bucket] = value

    def _forward(self, bucket: int) -> None:
        ctx = self._contexts[bucket]
        hidden = self.model(self._inputs[_IDS, :bucket], ctx.positions, self.kv_pool, ctx)
        self._hidden[:bucket].copy_(hidden)

    def _context(self, bs: int) -> AttentionContext:
        """Attention metadata of a `bs`-row decode batch, as views of the static inputs."""
        device = self.device
        rows = torch.arange(bs, dtype=torch.int64, device=device)
        nothing = torch.zeros(0, dtype=torch.int64, device=device)
        kv_lens = self._inputs[_KV_LENS, :bs]
        return AttentionContext(
            page_size=self.kv_pool.page_size,
            positions=self._inputs[_POSITIONS, :bs],
            slot_mapping=self._inputs[_SLOTS, :bs],
            # NOTE: host-side lengths are not known when a graph replays; only the torch
            # reference reads them, and it never runs here (its backend is not capturable).
            query_starts=list(range(bs)),
            query_lens=[1] * bs,
            kv_lens=[],
            page_table=self.page_table.table,
            seq_query_starts=rows,
            seq_query_lens=torch.ones(bs, dtype=torch.int64, device=device),
            seq_kv_lens=kv_lens,
            prefill_seqs=[],
            prefill_index=nothing,
            max_prefill_query_len=0,
            decode_token_rows=rows,
            decode_table_rows=self._inputs[_TABLE_ROWS, :bs],
            decode_kv_lens=kv_lens,
            max_decode_kv_len=0,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Record a graph per bucket (largest first, all in one memory pool)."""
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        for field, value in enumerate(_PADDING):
            self._host_rows[field, :] = value
        self._inputs.copy_(self._host)
        stream = torch.cuda.Stream(self.device)
        pool = None
        for bucket in reversed(self.buckets):
            # NOTE: one eager run first, on the capture stream: Triton compiles its kernels
            # and cuBLAS picks its algorithms outside the capture.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._forward(bucket)
            pool = graph.pool()
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs (decode batches %d..%d) in %.1f s, %.0f MiB",
            len(self._graphs),
            self.buckets[0],
            self.max_bs,
            time.perf_counter() - started,
            (torch.cuda.memory_reserved(self.device) - before) / 2**20,
        )
