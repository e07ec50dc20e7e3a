"""A one-shot all-reduce over symmetric memory for the small activations of decode steps.

Between two H200s an NCCL all-reduce of one token's hidden state costs ~21 µs inside a CUDA
graph (`benchmarks/all_reduce.py`), and a decode step of Llama-3.1-8B runs 65 of them: at
batch 1 that is more than a third of a TP 2 step. NCCL's ring is built for bandwidth; for a
few KiB the fixed cost is all there is. Here every rank writes its partial sum into a buffer
that every other rank of the node maps (torch's symmetric memory over CUDA IPC), and one
kernel reads all of them and adds them up (vLLM's and SGLang's "custom all-reduce").

It takes what fits in the buffer (`MAX_BYTES`); larger tensors (prefill) keep NCCL, which is
faster there. Only GPUs of one node can map each other's memory: a group that spans nodes, a
torch without the operators, or `--disable-custom-all-reduce` keeps NCCL for everything.
"""

from __future__ import annotations

import contextlib
import logging
import uuid

import torch
import torch.distributed as dist

from pdserve.engine.tensor_parallel import all_reduce_min

logger = logging.getLogger(__name__)

# NOTE: decode batches up to 128 at hidden size 4096 in bf16.
MAX_BYTES = 1 << 20
NAME_KEY = "symmetric_all_reduce/name"
TEST_CALLS = 8
# NOTE: torch 2.11's rendezvous hangs, on every rank, for a second group in a process that
# mapped a buffer before (seen on two H100s: a second TP engine in one `LLM` process); a
# serving worker's engine has a process of its own, so only offline use meets it.
_process_mapped_before = False


class SymmetricAllReduce:
    """One rank's side: the mapped buffer, and the name its group is registered under (the
    operators find the group by name)."""

    def __init__(self, name: str, buffer: torch.Tensor):
        self.name = name
        self.buffer = buffer

    @classmethod
    def open(
        cls,
        group: dist.ProcessGroup,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> SymmetricAllReduce | None:
        """Map the buffer on every rank (a collective: every rank of the group calls it), or
        None where this group cannot have it (then NCCL does every all-reduce). It must sum
        right eagerly and replayed from a CUDA graph; every rank reaches the same answer (each
        stage agrees over NCCL before the next, so no rank waits in a kernel another skips)."""
        if device.type != "cuda" or size < 2:
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
        opened, reason = None, ""
        try:
            opened = cls._map(group, store, rank, size, device, dtype, name)
        except Exception as error:  # NOTE: whatever this torch lacks, NCCL still works
            reason = f"{type(error).__name__}: {error}"
        if _everyone(group, device, opened is not None):
            reason = opened._test(size, rank, group, device)
            if not reason:
                return opened
        if opened is not None:
            opened.close()
        logger.warning(
            "custom all-reduce unavailable (%s); NCCL does every all-reduce",
            reason or "another rank could not map it",
        )
        return None

    @classmethod
    def _map(cls, group, store, rank, size, device, dtype, name) -> SymmetricAllReduce:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

        named = dist.ProcessGroup(store, rank, size)
        named._register_backend(device, dist.ProcessGroup.BackendType.NCCL, group)
        named._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        named._set_group_name(name)
        _register_process_group(name, named)
        global _process_mapped_before
        opened = cls(name, torch.empty(0))
        _process_mapped_before = True
        try:
            # NOTE: releases that look the group up by name refuse this second way; older ones
            # need it.
            with contextlib.suppress(Exception):
                _SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore(name, store))
            opened.buffer = symm_mem.empty(MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(opened.buffer, name)
        except BaseException:
            opened.close()
            raise
        return opened

    def _test(self, size: int, rank: int, group: dist.ProcessGroup, device) -> str:
        """Sum `TEST_CALLS` back-to-back inputs of different values (so that a rank rewriting
        its buffer while another still reads it shows), eagerly and then replayed from a
        captured CUDA graph: '' if every sum is right on every rank, else why not (a
        collective: the ranks agree before the graph runs)."""
        reason, graph = "", None
        inputs = [
            torch.full((8,), call + rank, dtype=self.buffer.dtype, device=device)
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
        return x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` summed (a new tensor); `x` must fit."""
        # NOTE: the operator wants the mapped buffer shaped like `x`: its head (same address,
        # so the same mapping) viewed so.
        mapped = self.buffer[: x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(mapped, x.contiguous(), "sum", self.name)

    def close(self) -> None:
        from torch._C._distributed_c10d import _unregister_process_group

        with contextlib.suppress(Exception):  # NOTE: already gone
            _unregister_process_group(self.name)
        self.buffer = torch.empty(0)


def _wrong_sums(totals: list[torch.Tensor], expected: list[int], how: str = "") -> str:
    for call, (total, value) in enumerate(zip(totals, expected, strict=True)):
        if not torch.equal(total, torch.full_like(total, value)):
            return f"test sum {call} {how}came back {total.tolist()}, not {value}s"
    return ""


def _everyone(group: dist.ProcessGroup, device: torch.device, ok: bool) -> bool:
    """Whether `ok` holds on every rank (a collective)."""
    return all_reduce_min(group, device, int(ok)) == 1
