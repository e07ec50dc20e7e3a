"""Decode steps replayed from CUDA graphs: plain decoding, and speculative verification.

A decode step launches a few hundred small kernels; launched one by one from Python, the host
takes several times longer than the GPU needs to run them. A CUDA graph records the whole
forward once per batch-size bucket and replays it with one launch.

A runner serves batches whose every sequence computes at most `tokens_per_seq` new tokens:
one for plain decoding; for speculative verification, the last committed token and the
drafted ones (`num_draft_tokens`, whatever the tree). Sequence i's tokens take rows
`i * tokens_per_seq ...`; rows past its own count are padding.

A graph reads its inputs from fixed addresses, so every step writes them into static buffers:
token ids, positions and cache slots per row, page-table rows, KV lengths, new-token counts
and masks per sequence, all packed in one pinned host buffer and copied to the device in one
transfer; page ids come from the persistent `DevicePageTable`. A batch runs in the smallest
bucket that holds it; padding rows have slot -1 (nothing stored), padding sequences no new
tokens and no KV (nothing read), and their outputs are ignored. With several tokens per
sequence every sequence attends through the extend kernel: a tree draft with its mask over
its new tokens (`Draft.mask`), a chain causally. The graph's outputs are the final hidden
states and the features the engine's `Capture` keeps; logits are computed outside it, for the
rows that need them.

Without CUDA (tests under the Triton interpreter) the same padded static inputs run eagerly,
so everything but the capture itself is exercised on CPU.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from pdserve.engine.core.config import EngineConfig
from pdserve.engine.runtime.attention import AttentionBackend, AttentionContext
from pdserve.engine.runtime.forward_batch import Capture, ForwardBatch
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.engine.runtime.models import CausalLM
from pdserve.engine.runtime.overlap import resolve_placeholders
from pdserve.engine.runtime.page_table import DevicePageTable

logger = logging.getLogger(__name__)


def graph_batch_size(
    config: EngineConfig, backend: AttentionBackend, device: torch.device | None = None
) -> int:
    """The largest decode batch run over static inputs, 0 for none (graphs disabled, or a
    backend that cannot be captured). With `device`, 0 also where nothing is captured (CPU).
    A runner of several tokens per sequence holds as many tokens in all (KV sizing counts
    the activations of this many)."""
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
    *,
    capture: Capture = Capture.NONE,
    tokens_per_seq: int = 1,
    share_pool_with: DecodeGraphRunner | None = None,
) -> DecodeGraphRunner | None:
    """A decode graph runner for `tokens_per_seq` new tokens per sequence, captured on CUDA
    (in the memory pool of `share_pool_with`: the engine never replays two graphs at once);
    without CUDA (the Triton interpreter) it runs the same static inputs eagerly. None where
    graphs are off."""
    max_tokens = graph_batch_size(config, backend)
    if not max_tokens:
        return None
    max_bs = max(1, max_tokens // tokens_per_seq)
    width = model.config.hidden_size

    def forward(ids, positions, ctx):
        if capture.kind == "layers":
            return model.forward_capture(ids, positions, kv_pool, ctx, capture.layer_ids)
        return model(ids, positions, kv_pool, ctx), None

    runner = DecodeGraphRunner(
        forward,
        kv_pool.page_size,
        page_table,
        max_bs,
        device,
        hidden_size=width,
        dtype=model.lm_head.weight.dtype,
        feature_width=width * len(capture.layer_ids),
        tokens_per_seq=tokens_per_seq,
        capture_kind=capture,
    )
    if device.type == "cuda":
        runner.capture(pool=share_pool_with.pool if share_pool_with is not None else None)
    return runner


def batch_buckets(max_bs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 8 up to `max_bs` (and
    `max_bs` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += range(16, max_bs + 1, 8)
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class _StaticInputs:
    """Every input of a step as views of one flat int64 buffer: per row (`rows` of them)
    token ids, positions and slots; per sequence (`seqs`) page-table rows, KV lengths,
    new-token counts and mask offsets; then the masks, `tokens_per_seq ** 2` per sequence."""

    ROW_FIELDS = ("ids", "positions", "slots")
    SEQ_FIELDS = ("table_rows", "kv_lens", "query_lens", "mask_offsets")

    def __init__(self, seqs: int, tokens_per_seq: int, **tensor_options):
        """`tensor_options`: where the buffer lives (`device=...` or `pin_memory=True`)."""
        rows = seqs * tokens_per_seq
        sizes = {name: rows for name in self.ROW_FIELDS}
        sizes |= {name: seqs for name in self.SEQ_FIELDS}
        sizes["masks"] = seqs * tokens_per_seq**2 if tokens_per_seq > 1 else 0
        # NOTE: every view starts 16 bytes aligned (see attention.context._pack).
        total = sum(size + size % 2 for size in sizes.values())
        self.buffer = torch.zeros(total, dtype=torch.int64, **tensor_options)
        self.views: dict[str, torch.Tensor] = {}
        start = 0
        for name, size in sizes.items():
            self.views[name] = self.buffer[start : start + size]
            start += size + size % 2


class BucketGraphs:
    """CUDA graphs per batch-size bucket over static buffers, shared by every runner: the
    bucket of a batch, the one copy of its inputs into the static buffers, replaying (or,
    before capture and without CUDA, running `_forward` eagerly), and capture. A subclass
    implements `_forward(bucket)`, which reads and writes its static buffers only."""

    def __init__(self, max_bs: int, device: torch.device):
        self.device = device
        self.buckets = batch_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # the graphs' memory pool, once captured
        # Recorded after each copy out of the pinned input buffer: the next step (prepared
        # while this one may still be queued, with overlap scheduling) waits for it before
        # overwriting the buffer.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        # Runs per bucket, replayed from a graph and run eagerly (statistics, tests).
        self.replays: Counter[int] = Counter()
        self.eager_runs: Counter[int] = Counter()

    def bucket_for(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _forward(self, bucket: int) -> None:
        raise NotImplementedError

    def _wait_for_inputs(self) -> None:
        """Before overwriting the pinned input buffer: its previous copy has left it."""
        if self._copied is not None:
            self._copied.synchronize()

    def _upload(self, host: torch.Tensor, inputs: torch.Tensor) -> None:
        """The filled pinned buffer into the static device inputs, in one copy."""
        inputs.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _launch(self, bucket: int) -> None:
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
            self.replays[bucket] += 1
        else:
            self._forward(bucket)
            self.eager_runs[bucket] += 1

    def _capture(self, pool=None) -> float:
        """Record every bucket's graph (in `pool`, or a new one) -> the seconds it took."""
        started = time.perf_counter()
        self._graphs, self.pool = capture_graphs(self.buckets, self._forward, self.device, pool)
        return time.perf_counter() - started


# A forward pass a runner records: (token ids, positions, attention context) of its static
# rows -> final hidden states and kept features (None: none kept).
StepForward = Callable[
    [torch.Tensor, torch.Tensor, AttentionContext], tuple[torch.Tensor, torch.Tensor | None]
]


class DecodeGraphRunner(BucketGraphs):
    """Runs `forward` over decode batches (up to `tokens_per_seq` new tokens per sequence,
    `max_bs` sequences) from static inputs: replayed from graphs once `capture()` has run,
    eagerly before (or without CUDA). Its outputs: hidden states `hidden_size` wide and,
    with `feature_width`, features that wide."""

    def __init__(
        self,
        forward: StepForward,
        page_size: int,
        page_table: DevicePageTable,
        max_bs: int,
        device: torch.device,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        feature_width: int = 0,
        tokens_per_seq: int = 1,
        capture_kind: Capture = Capture.NONE,
    ):
        if tokens_per_seq < 1:
            raise ValueError(f"tokens_per_seq must be at least 1, got {tokens_per_seq}")
        super().__init__(max_bs, device)
        self.forward = forward
        self.page_size = page_size
        self.page_table = page_table
        self.capture_kind = capture_kind  # the target features its forward keeps
        self.tokens_per_seq = tokens_per_seq
        self._host = _StaticInputs(self.max_bs, tokens_per_seq, pin_memory=device.type == "cuda")
        self._host_views = {name: view.numpy() for name, view in self._host.views.items()}
        self._inputs = _StaticInputs(self.max_bs, tokens_per_seq, device=device)
        rows = self.max_bs * tokens_per_seq
        self._hidden = torch.zeros((rows, hidden_size), dtype=dtype, device=device)
        self._features = None
        if feature_width:
            self._features = torch.zeros((rows, feature_width), dtype=dtype, device=device)
        self._contexts = {bs: self._context(bs) for bs in self.buckets}

    def can_run(self, batch: ForwardBatch) -> bool:
        """A batch of known requests that a bucket holds, each computing at most
        `tokens_per_seq` tokens (one, plain and causal, without several); a mask must cover
        just the sequence's new tokens."""
        if len(batch) > self.max_bs or None in batch.requests or not len(batch):
            return False
        if self.tokens_per_seq == 1:
            return batch.is_decode
        return all(len(t) <= self.tokens_per_seq for t in batch.token_ids) and all(
            mask.shape[1] == mask.shape[0] for mask in batch.masks.values()
        )

    def query_starts(self, batch_size: int) -> list[int]:
        """Where each sequence's rows start in the outputs."""
        return list(range(0, batch_size * self.tokens_per_seq, self.tokens_per_seq))

    @torch.inference_mode()
    def run(
        self, batch: ForwardBatch, device_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states `[len(batch) * tokens_per_seq, hidden]` of a batch (`can_run`),
        its KV written to the cache, and the kept features (None without). Views of static
        buffers: the next run overwrites them. `device_tokens`: what the batch's
        placeholder ids stand for (`ModelRunner.forward`)."""
        bs = len(batch)
        bucket = self.bucket_for(bs)
        self._wait_for_inputs()
        if self.tokens_per_seq == 1:
            self._fill_decode(batch, bucket)
        else:
            self._fill(batch, bucket)
        self._upload(self._host.buffer, self._inputs.buffer)
        if device_tokens is not None:
            ids = self._inputs.views["ids"]
            ids.copy_(resolve_placeholders(ids, device_tokens))
        self._launch(bucket)
        rows = bs * self.tokens_per_seq
        return self._hidden[:rows], None if self._features is None else self._features[:rows]

    def _fill_decode(self, batch: ForwardBatch, bucket: int) -> None:
        """One token per sequence (the hot path at large batches: no per-row loop)."""
        size = self.page_size
        positions = batch.num_computed
        bs = len(batch)
        host = self._host_views
        host["ids"][:bs] = [tokens[0] for tokens in batch.token_ids]
        host["positions"][:bs] = positions
        host["slots"][:bs] = [
            pages[n // size] * size + n % size
            for pages, n in zip(batch.pages, positions, strict=True)
        ]
        host["table_rows"][:bs] = self.page_table.rows(batch.requests)
        host["kv_lens"][:bs] = [n + 1 for n in positions]
        self._pad(bs, bucket)

    def _fill(self, batch: ForwardBatch, bucket: int) -> None:
        """Up to `tokens_per_seq` tokens per sequence, padded to that many rows each."""
        size = self.page_size
        per_seq = self.tokens_per_seq
        host = self._host_views
        ids, positions, slots = host["ids"], host["positions"], host["slots"]
        masks, mask_offsets = host["masks"], host["mask_offsets"]
        bs = len(batch)
        for i, (pages, start, tokens) in enumerate(
            zip(batch.pages, batch.num_computed, batch.token_ids, strict=True)
        ):
            count, row = len(tokens), i * per_seq
            ids[row : row + count] = tokens
            explicit = batch.positions[i]
            positions[row : row + count] = (
                explicit if explicit is not None else range(start, start + count)
            )
            slots[row : row + count] = [
                pages[n // size] * size + n % size for n in range(start, start + count)
            ]
            ids[row + count : row + per_seq] = 0
            positions[row + count : row + per_seq] = 0
            slots[row + count : row + per_seq] = -1
            host["kv_lens"][i] = start + count
            host["query_lens"][i] = count
            mask = batch.masks.get(i)
            if mask is None:
                mask_offsets[i] = -1
            else:
                offset = i * per_seq * per_seq
                mask_offsets[i] = offset
                masks[offset : offset + count * count] = np.asarray(mask).reshape(-1)
        host["table_rows"][:bs] = self.page_table.rows(batch.requests)
        self._pad(bs, bucket)

    def _pad(self, bs: int, bucket: int) -> None:
        """Padding sequences: token 0 at position 0, stored nowhere, no new tokens, no KV."""
        host = self._host_views
        rows = slice(bs * self.tokens_per_seq, bucket * self.tokens_per_seq)
        host["ids"][rows] = 0
        host["positions"][rows] = 0
        host["slots"][rows] = -1
        for name in ("table_rows", "kv_lens", "query_lens"):
            host[name][bs:bucket] = 0
        host["mask_offsets"][bs:bucket] = -1

    def _forward(self, bucket: int) -> None:
        ctx = self._contexts[bucket]
        rows = bucket * self.tokens_per_seq
        hidden, features = self.forward(self._inputs.views["ids"][:rows], ctx.positions, ctx)
        self._hidden[:rows].copy_(hidden)
        if self._features is not None:
            self._features[:rows].copy_(features)

    def _context(self, bs: int) -> AttentionContext:
        """Attention metadata of a `bs`-sequence batch, as views of the static inputs."""
        device = self.device
        per_seq = self.tokens_per_seq
        inputs = self._inputs.views
        kv_lens = inputs["kv_lens"][:bs]
        table_rows = inputs["table_rows"][:bs]
        if per_seq == 1:
            return decode_context(
                self.page_size,
                self.page_table,
                inputs["positions"][:bs],
                inputs["slots"][:bs],
                kv_lens,
                table_rows,
            )
        seqs = torch.arange(bs, dtype=torch.int64, device=device)
        nothing = torch.zeros(0, dtype=torch.int64, device=device)
        query_lens = inputs["query_lens"][:bs]
        return AttentionContext(
            page_size=self.page_size,
            positions=inputs["positions"][: bs * per_seq],
            slot_mapping=inputs["slots"][: bs * per_seq],
            # NOTE: host-side lengths are not known when a graph replays; only the torch
            # reference reads them, and it never runs here (its backend is not capturable).
            query_starts=self.query_starts(bs),
            query_lens=[per_seq] * bs,
            kv_lens=[],
            page_table=self.page_table.table,
            seq_table_rows=table_rows,
            seq_query_starts=seqs * per_seq,
            seq_kv_lens=kv_lens,
            seq_query_lens=query_lens,
            prefill_seqs=list(range(bs)),
            prefill_index=seqs,
            max_prefill_query_len=per_seq,
            decode_token_rows=nothing,
            decode_table_rows=nothing,
            decode_kv_lens=nothing,
            max_decode_kv_len=0,
            mask_data=inputs["masks"],
            mask_offsets=inputs["mask_offsets"][:bs],
            mask_widths=query_lens,  # a mask covers its sequence's new tokens
            rows_per_seq=per_seq,
        )

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Record a graph per bucket (largest first, all in one memory pool: `pool`, or a
        new one)."""
        before = torch.cuda.memory_reserved(self.device)
        self._pad(0, self.max_bs)
        self._inputs.buffer.copy_(self._host.buffer)
        seconds = self._capture(pool)
        logger.info(
            "captured %d CUDA graphs (batches %d..%d, %d tokens per sequence) in %.1f s, %.0f MiB",
            len(self._graphs),
            self.buckets[0],
            self.max_bs,
            self.tokens_per_seq,
            seconds,
            (torch.cuda.memory_reserved(self.device) - before) / 2**20,
        )


def decode_context(
    page_size: int,
    page_table: DevicePageTable,
    positions: torch.Tensor,
    slots: torch.Tensor,
    kv_lens: torch.Tensor,
    table_rows: torch.Tensor,
) -> AttentionContext:
    """Metadata of a decode batch (one token per sequence, in row order) over static device
    tensors, for a graph to capture."""
    device = positions.device
    bs = positions.shape[0]
    rows = torch.arange(bs, dtype=torch.int64, device=device)
    nothing = torch.zeros(0, dtype=torch.int64, device=device)
    return AttentionContext(
        page_size=page_size,
        positions=positions,
        slot_mapping=slots,
        # NOTE: host-side lengths are not known when a graph replays; only the torch reference
        # reads them, and it never runs here (its backend is not capturable).
        query_starts=list(range(bs)),
        query_lens=[1] * bs,
        kv_lens=[],
        page_table=page_table.table,
        seq_table_rows=table_rows,
        seq_query_starts=rows,
        seq_query_lens=torch.ones(bs, dtype=torch.int64, device=device),
        seq_kv_lens=kv_lens,
        prefill_seqs=[],
        prefill_index=nothing,
        max_prefill_query_len=0,
        decode_token_rows=rows,
        decode_table_rows=table_rows,
        decode_kv_lens=kv_lens,
        max_decode_kv_len=0,
    )


def capture_graphs(
    buckets: list[int], forward: Callable[[int], None], device: torch.device, pool=None
) -> tuple[dict[int, torch.cuda.CUDAGraph], object]:
    """A graph of `forward(bucket)` per bucket, largest first, all in one memory pool
    (`pool`, or a new one) -> the graphs and the pool. `forward` must read and write static
    buffers only."""
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    graphs = {}
    with _no_garbage_collection():
        for bucket in sorted(buckets, reverse=True):
            # NOTE: one eager run first, on the capture stream: Triton compiles its kernels
            # and cuBLAS picks its algorithms outside the capture.
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                forward(bucket)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                forward(bucket)
            pool = graph.pool()
            graphs[bucket] = graph
    torch.cuda.synchronize(device)
    return graphs, pool


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's cyclic collector off while graphs are captured (what was garbage before is
    collected first). NOTE: a collection in the middle of a capture may free the CUDA graphs
    of an engine this process made before (an `LLM` made twice in one process), and a graph
    reset while a stream captures invalidates the capture ("operation not permitted when
    stream is capturing"): the engine then fails to start."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
