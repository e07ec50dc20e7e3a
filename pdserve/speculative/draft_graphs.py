"""A chain proposal's draft steps replayed from CUDA graphs.

Drafting a chain of S tokens runs the draft S - 1 times, one token per request each time: a
few dozen small kernels per step, launched from Python far slower than the GPU runs them.
One graph per batch-size bucket records all S - 1 steps (forward, logits, argmax, the map to
target ids), so a proposal is one replay and one copy of the drafted tokens to the host.

Static inputs, as in the target's decode graphs (`pdserve.engine.runtime.decode_graphs`): each
step's positions, cache slots and KV lengths and each request's page-table row travel in one pinned
buffer and one copy; the first drafted token and (EAGLE) the draft's hidden state are copied
into device buffers. Padding requests store nothing (slot -1) and read nothing (KV length 0).
Without CUDA the same static inputs run eagerly (tests under the Triton interpreter).
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine.runtime.attention import AttentionContext
from pdserve.engine.runtime.decode_graphs import BucketGraphs, decode_context
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.engine.runtime.page_table import DevicePageTable

logger = logging.getLogger(__name__)


class ChainDraftGraphs(BucketGraphs):
    """Runs the `num_steps - 1` draft steps of chain proposals for up to `max_bs` requests
    over static inputs: replayed from graphs once `capture()` has run, eagerly before (or
    without CUDA)."""

    def __init__(
        self,
        net,
        pool: KVPool,
        page_table: DevicePageTable,
        max_bs: int,
        num_steps: int,
        hidden_size: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """`net`: the `DraftNet`; `hidden_size`: the recurrent hidden width it feeds itself
        (None: the draft carries no hidden state), in `dtype`."""
        super().__init__(max_bs, device)
        self.net = net
        self.kv_pool = pool
        self.page_table = page_table
        self.steps = num_steps - 1
        pin = device.type == "cuda"
        # Rows: per step positions, slots and KV lengths; then page-table rows.
        shape = (3 * self.steps + 1, self.max_bs)
        self._host = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
        self._host_rows = self._host.numpy()
        self._inputs = torch.zeros(shape, dtype=torch.int64, device=device)
        self._token = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self._hidden = None
        if hidden_size is not None:
            self._hidden = torch.zeros((self.max_bs, hidden_size), dtype=dtype, device=device)
        self._drafted = torch.zeros((self.max_bs, self.steps), dtype=torch.int64, device=device)
        self._contexts = {
            bs: [self._context(bs, s) for s in range(self.steps)] for bs in self.buckets
        }

    def can_run(self, num_requests: int) -> bool:
        return 0 < num_requests <= self.max_bs

    @torch.inference_mode()
    def run(
        self, requests: list, first: torch.Tensor, hidden: torch.Tensor | None, prefix: list[int]
    ) -> torch.Tensor:
        """The drafted tokens after `first` (`[B]`, target ids), `[B, num_steps - 1]`: request
        b's step s feeds its previous token at position `prefix[b] + s`. A view of a static
        buffer: the next run overwrites it."""
        bs = len(requests)
        bucket = self.bucket_for(bs)
        self._wait_for_inputs()
        self._fill(requests, prefix, bs, bucket)
        self._upload(self._host, self._inputs)
        self._token[:bs].copy_(first)
        if self._hidden is not None:
            self._hidden[:bs].copy_(hidden)
        self._launch(bucket)
        return self._drafted[:bs]

    def _fill(self, requests: list, prefix: list[int], bs: int, bucket: int) -> None:
        size = self.kv_pool.page_size
        host, steps = self._host_rows, self.steps
        for s in range(steps):
            at = [p + s for p in prefix]
            host[s, :bs] = at
            host[steps + s, :bs] = [
                r.pages[n // size] * size + n % size for r, n in zip(requests, at, strict=True)
            ]
            host[2 * steps + s, :bs] = [n + 1 for n in at]
        host[3 * steps, :bs] = self.page_table.rows(requests)
        self._pad(bs, bucket)

    def _pad(self, bs: int, bucket: int) -> None:
        steps = self.steps
        self._host_rows[:, bs:bucket] = 0
        self._host_rows[steps : 2 * steps, bs:bucket] = -1

    def _forward(self, bucket: int) -> None:
        net = self.net
        token = self._token[:bucket]
        hidden = None if self._hidden is None else self._hidden[:bucket]
        for s, ctx in enumerate(self._contexts[bucket]):
            out = net.forward(token, ctx.positions, hidden, False, self.kv_pool, ctx)
            token = net.to_target_ids(net.logits(out).argmax(dim=-1))
            hidden = out
            self._drafted[:bucket, s].copy_(token)

    def _context(self, bs: int, step: int) -> AttentionContext:
        """Step `step`'s decode metadata of a `bs`-request batch, as views of the static
        inputs."""
        steps = self.steps
        return decode_context(
            self.kv_pool.page_size,
            self.page_table,
            self._inputs[step, :bs],
            self._inputs[steps + step, :bs],
            self._inputs[2 * steps + step, :bs],
            self._inputs[3 * steps, :bs],
        )

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        self._pad(0, self.max_bs)
        self._inputs.copy_(self._host)
        seconds = self._capture(pool)
        logger.info(
            "captured %d CUDA graphs of %d draft steps (batches %d..%d) in %.1f s",
            len(self._graphs),
            self.steps,
            self.buckets[0],
            self.max_bs,
            seconds,
        )
