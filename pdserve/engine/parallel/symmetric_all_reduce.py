"""A one-shot all-reduce over symmetric memory for the small activations of decode steps.

Between two H200s an NCCL all-reduce of one token's hidden state costs ~21 µs inside a CUDA
graph (`benchmarks/all_reduce.py`), and a decode step of Llama-3.1-8B runs 65 of them: at
batch 1 that is more than a third of a TP 2 step. NCCL's ring is built for bandwidth; for a
few KiB the fixed cost is all there is. Here every rank writes its partial sum into a buffer
that every other rank of the node maps (torch's symmetric memory over CUDA IPC), and one
kernel reads all of them and adds them up (vLLM's and SGLang's "custom all-reduce"); the
same kernel can add the residual and take the RMSNorm after it
(`kernels/one_shot_all_reduce.py`, which says how the ranks signal each other).

It takes what fits in the buffer (`fits`); larger tensors (prefill) keep NCCL, which is
faster there. Only GPUs of one node can map each other's memory: a group that spans nodes, a
torch without symmetric memory, or `--disable-custom-all-reduce` keeps NCCL for everything."""

from __future__ import annotations

import contextlib
import logging
import uuid

import torch
import torch.distributed as dist
import triton

from pdserve.engine.kernels.norm import row_num_warps
from pdserve.engine.kernels.one_shot_all_reduce import one_shot_all_reduce_kernel
from pdserve.engine.parallel.process_groups import all_reduce_min

logger = logging.getLogger(__name__)

# NOTE: one slot: decode batches up to 128 at hidden size 4096 in bf16. Two slots a buffer.
MAX_BYTES = 1 << 20
MAX_ROWS = 256
MAX_HIDDEN = 16384
MAX_RANKS = 8  # NOTE: the GPUs of one node
# The buffer starts with each (row, sender)'s flag: the number of its last call.
FLAG_BYTES = MAX_ROWS * MAX_RANKS * 8
BUFFER_BYTES = FLAG_BYTES + 2 * MAX_BYTES
# NOTE: a rank that waits for the others longer than its group's timeout is stuck (its
# kernel traps). Counted in polls of its flags, an atomic at system scope each: at least
# ~0.1 µs (an L2 round trip), so the deadline errs long.
POLLS_PER_S = 10_000_000
NAME_KEY = "symmetric_all_reduce/name"
TEST_CALLS = 8
# NOTE: torch 2.11's rendezvous hangs, on every rank, for a second group in a process that
# mapped a buffer before (seen on two H100s: a second TP engine in one `LLM` process); a
# serving worker's engine has a process of its own, so only offline use meets it.
_process_mapped_before = False


class SymmetricAllReduce:
    """One rank's side: its mapped buffer, every rank's buffer as this process maps it, and
    the per-row call counts the kernel keeps."""

    def __init__(self, name: str, rank: int, size: int, dtype: torch.dtype, max_spins: int):
        self.name = name
        self.rank = rank
        self.size = size
        self.dtype = dtype
        self.max_spins = max_spins
        self.buffer = torch.empty(0)
        self.data_ptrs = self.flag_ptrs = self.counters = torch.empty(0)

    @classmethod
    def open(
        cls,
        group: dist.ProcessGroup,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        dtype: torch.dtype,
        timeout_s: float = 600.0,
    ) -> SymmetricAllReduce | None:
        """Map the buffer on every rank (a collective: every rank of the group calls it), or
        None where this group cannot have it (then NCCL does every all-reduce). It must sum
        right eagerly and replayed from a CUDA graph; every rank reaches the same answer (each
        stage agrees over NCCL before the next, so no rank waits in a kernel another skips).
        A rank that waits for the others longer than about `timeout_s` traps."""
        if device.type != "cuda" or not 2 <= size <= MAX_RANKS:
            return None
        if rank == 0:
            # NOTE: rank 0's process is the one an engine can reuse (the other ranks are new
            # processes), so rank 0 decides for all: an empty name means NCCL only.
            name = "" if _process_mapped_before else f"pdserve-tp-{uuid.uuid4().hex[:12]}"
            store.set(NAME_KEY, name)
        name = store.get(NAME_KEY).decode()
        if not name:
            logger.warning(
                "custom all-reduce unavailable (rank 0's process mapped one for an earlier "
                "tensor-parallel engine, and torch maps one per process); NCCL does every "
                "all-reduce"
            )
            return None
        max_spins = min(int(timeout_s * POLLS_PER_S), 2**31 - 1)
        opened, reason = None, ""
        try:
            opened = cls(name, rank, size, dtype, max_spins)
            opened._map(group, store, device)
        except Exception as error:  # NOTE: whatever this torch lacks, NCCL still works
            reason, opened = f"{type(error).__name__}: {error}", None
        # NOTE: also the barrier after which every rank's flags are zero.
        if _everyone(group, device, opened is not None):
            reason = opened._test(group, device)
            if not reason:
                return opened
        if opened is not None:
            opened.close()
        logger.warning(
            "custom all-reduce unavailable (%s); NCCL does every all-reduce",
            reason or "another rank could not map it",
        )
        return None

    def _map(self, group: dist.ProcessGroup, store: dist.Store, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

        name, rank, size = self.name, self.rank, self.size
        named = dist.ProcessGroup(store, rank, size)
        named._register_backend(device, dist.ProcessGroup.BackendType.NCCL, group)
        named._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        named._set_group_name(name)
        _register_process_group(name, named)
        self._named_group = named  # NOTE: the registry does not keep it alive on its own
        global _process_mapped_before
        _process_mapped_before = True
        try:
            # NOTE: releases that look the group up by name refuse this second way; older ones
            # need it.
            with contextlib.suppress(Exception):
                _SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore(name, store))
            self.buffer = symm_mem.empty(BUFFER_BYTES, dtype=torch.uint8, device=device)
            mapped = symm_mem.rendezvous(self.buffer, name)
            ptrs = list(mapped.buffer_ptrs)
        except BaseException:
            self.close()
            raise
        self.buffer[:FLAG_BYTES].zero_()
        self.attach(ptrs, device)

    def attach(self, ptrs: list[int], device: torch.device) -> None:
        """Sum through the buffers at `ptrs`: every rank's, in rank order, as this process
        maps them (`BUFFER_BYTES` each, flags zeroed on every rank before any calls)."""
        self.flag_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self.data_ptrs = self.flag_ptrs + FLAG_BYTES
        self.counters = torch.zeros(MAX_ROWS, dtype=torch.int64, device=device)

    def _test(self, group: dist.ProcessGroup, device) -> str:
        """Sum `TEST_CALLS` back-to-back inputs of different values (so that a rank rewriting
        its buffer while another still reads it shows), eagerly and then replayed from a
        captured CUDA graph: '' if every sum is right on every rank, else why not (a
        collective: the ranks agree before the graph runs)."""
        size, rank = self.size, self.rank
        reason, graph = "", None
        inputs = [
            torch.full((8,), call + rank, dtype=self.dtype, device=device)
            for call in range(TEST_CALLS)
        ]
        expected = [size * call + size * (size - 1) // 2 for call in range(TEST_CALLS)]
        try:
            reason = _wrong_sums([self(x) for x in inputs], expected)
            if not reason:
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    totals = [self(x) for x in inputs]
        except Exception as error:
            reason, graph = f"{type(error).__name__}: {error}", None
        if not _everyone(group, device, graph is not None):
            return reason or "another rank failed the test sums"
        graph.replay()
        reason = _wrong_sums(totals, expected, "replayed from a graph ")
        if not _everyone(group, device, not reason):
            return reason or "another rank's test sums from a graph were wrong"
        return ""

    def fits(self, x: torch.Tensor) -> bool:
        hidden = x.shape[-1] if x.dim() else 0
        rows = x.numel() // max(hidden, 1)
        return (
            x.dtype == self.dtype
            and 0 < hidden <= MAX_HIDDEN
            and 0 < rows <= MAX_ROWS
            and x.numel() * x.element_size() <= MAX_BYTES
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` summed (a new tensor); `x` must fit."""
        rows = _rows(x)
        out = torch.empty_like(rows)
        self._launch(rows, out, None, None, 0.0)
        return out.view(x.shape)

    def sum_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`kernels.norm.rms_norm(sum of every rank's x, weight, eps, residual)` in one
        kernel: `(normed, residual)`, the residual updated in place to the stream's value.
        `x` must fit; `residual` is shaped like it."""
        rows = _rows(x)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match the input "
                f"{tuple(x.shape)} {x.dtype}, contiguous in its last dimension"
            )
        out = torch.empty_like(rows)
        self._launch(rows, out, residual.view(rows.shape), weight, eps)
        return out.view(x.shape), residual

    def _launch(self, rows, out, residual, weight, eps) -> None:
        count, hidden = rows.shape
        block = triton.next_power_of_2(hidden)
        add_norm = residual is not None
        one_shot_all_reduce_kernel[(count,)](
            rows,
            rows.stride(0),
            self.data_ptrs,
            self.flag_ptrs,
            self.counters,
            residual if add_norm else rows,
            residual.stride(0) if add_norm else 0,
            weight if add_norm else rows,
            out,
            out.stride(0),
            hidden,
            MAX_BYTES // rows.element_size(),
            eps,
            self.max_spins,
            RANK=self.rank,
            WORLD=self.size,
            ADD_NORM=add_norm,
            BLOCK=block,
            num_warps=row_num_warps(block),
        )

    def close(self) -> None:
        from torch._C._distributed_c10d import _unregister_process_group

        with contextlib.suppress(Exception):  # NOTE: already gone
            _unregister_process_group(self.name)
        self.buffer = torch.empty(0)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[rows, hidden]`, contiguous."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _wrong_sums(totals: list[torch.Tensor], expected: list[int], how: str = "") -> str:
    for call, (total, value) in enumerate(zip(totals, expected, strict=True)):
        if not torch.equal(total, torch.full_like(total, value)):
            return f"test sum {call} {how}came back {total.tolist()}, not {value}s"
    return ""


def _everyone(group: dist.ProcessGroup, device: torch.device, ok: bool) -> bool:
    """Whether `ok` holds on every rank (a collective)."""
    return all_reduce_min(group, device, int(ok)) == 1
