"""One-shot all-reduce between the GPUs of one node, fused with the residual add and RMSNorm.

Under tensor parallelism every write into the residual stream (attention's o projection, the
MLP's down projection) is a partial sum that an all-reduce adds up, and the next thing read
is the RMSNorm of the stream. At decode's batch sizes an all-reduce moves a few KiB, so its
cost is all latency; this kernel does the sum and the norm after it in one launch.

Each rank's buffer is mapped by every rank of the node (`symmetric_all_reduce`). One
program per row:
1. copies the row of its partial sum into its own buffer, in the slot of this call's parity;
2. tells every rank so: it writes this call's number into the rank's flag for (row, sender),
   a release at system scope, after a block barrier so that the whole row is written first;
3. waits until every rank's flag for the row holds this call's number (an acquire);
4. reads the row from every rank's buffer, adds the rows in rank order in float32 (so every
   rank gets the same bits) and rounds the sum to the dtype;
5. stores the sum; or, with `ADD_NORM`, adds the residual to it (the residual updated in
   place) and stores the RMSNorm of that: `kernels/norm.py`'s numerics, step by step.

Why one wait is enough: a rank writes a slot again two calls later, and it can only get there
after every rank flagged the call in between, which each did after its kernel for this call
(and its reads of this slot) ended. Call numbers count per row in a counter each rank keeps
(`counter_ptr`); the ranks run the same passes, so their counts agree.

A wait that outlasts `max_spins` polls means a rank is gone or stuck: the kernel then traps
(the process's CUDA context fails, and the worker with it) rather than sum what is there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.engine.kernels import INTERPRETING
from pdserve.engine.kernels.norm import add_and_norm
from pdserve.engine.kernels.rounding import round_to

# NOTE: the interpreter runs no PTX; there a stuck wait just ends.
_CAN_TRAP = tl.constexpr(not INTERPRETING)


@triton.jit
def _trap_if(stuck):
    """Abort the kernel (and the process's CUDA context) where `stuck` holds."""
    if _CAN_TRAP:
        tl.inline_asm_elementwise(
            "{ .reg .pred %p; setp.ne.u32 %p, $1, 0; @%p trap; mov.u32 $0, $1; }",
            "=r,r",
            [stuck.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _buffer_of(data_ptrs, rank, dtype: tl.constexpr):
    """Rank `rank`'s buffer: 16-byte aligned, which lets loads and stores of it vectorize."""
    return tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def one_shot_all_reduce_kernel(
    x_ptr,
    x_row_stride,
    data_ptrs,
    flag_ptrs,
    counter_ptr,
    residual_ptr,
    residual_row_stride,
    weight_ptr,
    out_ptr,
    out_row_stride,
    hidden,
    slot_elems,
    eps,
    max_spins,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ADD_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    call = tl.load(counter_ptr + row) + 1
    offset = (call % 2) * slot_elems + row * hidden
    own = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    own_buffer = _buffer_of(data_ptrs, RANK, dtype)
    tl.store(own_buffer + offset + cols, own, mask=mask)
    tl.debug_barrier()

    ranks = tl.arange(0, WORLD)
    their_flags = tl.load(flag_ptrs + ranks).to(tl.pointer_type(tl.int64))
    calls = tl.zeros([WORLD], dtype=tl.int64) + call
    tl.atomic_xchg(their_flags + row * WORLD + RANK, calls, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int64)) + row * WORLD + ranks
    nothing = tl.zeros([WORLD], dtype=tl.int64)
    seen = tl.atomic_add(own_flags, nothing, sem="acquire", scope="sys")
    spins = 0
    while (tl.min(seen, axis=0) < call) & (spins < max_spins):
        seen = tl.atomic_add(own_flags, nothing, sem="acquire", scope="sys")
        spins += 1
    _trap_if(spins >= max_spins)
    tl.debug_barrier()

    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank in tl.static_range(WORLD):
        if rank == RANK:
            part = own
        else:
            buffer = _buffer_of(data_ptrs, rank, dtype)
            part = tl.load(buffer + offset + cols, mask=mask, other=0.0, cache_modifier=".cg")
        total += part.to(tl.float32)
    tl.store(counter_ptr + row, call)
    total = round_to(total, dtype)

    if ADD_NORM:
        residual_row = residual_ptr + row * residual_row_stride + cols
        total = add_and_norm(total, residual_row, weight_ptr, cols, mask, hidden, eps, dtype, True)
    tl.store(out_ptr + row * out_row_stride + cols, total.to(dtype), mask=mask)
