"""The one-shot all-reduce kernel (`kernels/one_shot_all_reduce.py`) between two and four
processes on the CPU, under Triton's interpreter: each rank's buffer is shared memory every
process maps, so the ranks signal each other through the flags as GPUs do. Each rank checks
its sums, and its fused residual-add + RMSNorm, against the unfused kernels."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from pdserve.engine.parallel.symmetric_all_reduce import BUFFER_BYTES, SymmetricAllReduce

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("the interpreter's CPU case; tests/gpu runs the kernel", allow_module_level=True)

HIDDEN = 48
# Row counts of consecutive calls: repeats reuse both slots of a row; 3 after 1 starts rows
# 1-2 at their first call while row 0 is at its second.
ROWS = (1, 1, 3, 2, 1, 3)
EPS = 1e-6


def _inputs(rank: int, call: int, rows: int, dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(rows, HIDDEN, generator=generator).to(dtype)


def _rank(rank: int, buffers, dtype, results) -> None:
    from pdserve.engine.kernels.norm import rms_norm

    size = len(buffers)
    reducer = SymmetricAllReduce("test", rank, size, dtype, max_spins=10**7)
    reducer.attach([b.data_ptr() for b in buffers], torch.device("cpu"))
    weight = torch.linspace(0.5, 1.5, HIDDEN).to(dtype)
    failures = []
    for call, rows in enumerate(ROWS):
        parts = [_inputs(r, call, rows, dtype) for r in range(size)]
        expected = sum(part.float() for part in parts).to(dtype)
        if call % 2 == 0:
            got = reducer(parts[rank])
            if not torch.equal(got, expected):
                failures.append(f"call {call}: sum {got} != {expected}")
            continue
        residual = torch.full((rows, HIDDEN), 0.25 * call, dtype=dtype)
        want_normed, want_stream = rms_norm(expected, weight, EPS, residual.clone())
        normed, stream = reducer.sum_and_norm(parts[rank], residual, weight, EPS)
        if stream is not residual or not torch.equal(residual, want_stream):
            failures.append(f"call {call}: residual {residual} != {want_stream}")
        if not torch.equal(normed, want_normed):
            failures.append(f"call {call}: norm {normed} != {want_normed}")
    results.put((rank, failures, reducer.counters[: max(ROWS)].tolist()))


@pytest.mark.parametrize(
    ("size", "dtype"),
    [(2, torch.float32), (2, torch.bfloat16), (4, torch.bfloat16)],
    ids=["2-fp32", "2-bf16", "4-bf16"],
)
def test_ranks_sum_and_norm_through_each_others_buffers(size, dtype):
    buffers = [torch.zeros(BUFFER_BYTES, dtype=torch.uint8).share_memory_() for _ in range(size)]
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank, args=(r, buffers, dtype, results)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        reports = sorted(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    calls_per_row = [sum(rows > row for rows in ROWS) for row in range(max(ROWS))]
    for rank, failures, counters in reports:
        assert failures == [], f"rank {rank}: {failures}"
        assert counters == calls_per_row, f"rank {rank} counted {counters}"
