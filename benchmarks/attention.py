"""Triton attention kernels beside their GPU ceilings and the torch reference, in one process.

Ceilings, measured first: HBM copy bandwidth (one large device-to-device copy, bytes read +
written over its time) and bf16 GEMM throughput (an N^3 matmul).

Decode (`paged_decode_attention`): every sequence has exactly `context` tokens of KV (uniform,
not ragged), pages are a random permutation of page ids, K/V random and never zero. Achieved
bandwidth counts the bytes the attention must touch: K+V of every sequence, q, out and the page
table; not the split-KV partials the kernel chooses to write and re-read. It is set against the
copy figure as is, although the copy's bytes are half reads, half writes. The kernel's time
includes its merge kernel and the allocation of its partial buffers.

Extend (`paged_extend_attention`): one sequence of T new tokens, no cached prefix, causal.
TFLOP/s counts causal FLOPs, 4 * heads * head_dim * T^2 / 2, against the GEMM ceiling.

The torch reference is the reference backend's attention (`_decode_batch` / `_prefill_one`,
without its rotary and KV write). Its decode gathers the whole KV: a case whose gather would
pass `--max-ref-gib` is not timed, and its kernel output is checked against the reference on
as many of its sequences as fit. Every output is checked before timing (poisoned with NaN
first); the relative error is printed.

Block-size variants: `--extend-configs` replaces the extend kernel's `_block_sizes` (BLOCK_M x
BLOCK_N x warps x stages), `--decode-configs` the decode kernel's launch parameters (BLOCK_N x
warps x stages, optionally @splits to replace `num_splits_for`); `default` is the kernels' own
choice. A variant a GPU cannot compile (out of shared memory) is reported as such.

On an H100 (about 2-3 minutes, estimated; mostly Triton compiling the variants):

    python benchmarks/attention.py --output attention.json \\
        --decode-configs default,32x4x3,128x4x3,64x8x3,default@1 \\
        --extend-configs default,128x64x4x3,128x64x8x3,64x64x4x3,128x128x8x3,128x32x4x4

On a CPU, under Triton's interpreter (checks that the script runs; timings mean nothing):

    TRITON_INTERPRET=1 python benchmarks/attention.py --device cpu --batches 1,3 \\
        --contexts 40,100 --extend-lens 48 --copy-mib 16 --gemm-size 128 --extend-configs \\
        default,32x16x4x2 --decode-configs default,16x4x2@3
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

# A sibling file: found on sys.path, which starts with this script's folder.
from attention_tables import decode_line, decode_table, extend_line, extend_table
from torch.nn.attention import sdpa_kernel
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from pdserve.engine.kernels import decode_attention, extend_attention
from pdserve.engine.runtime.attention.context import AttentionContext
from pdserve.engine.runtime.attention.torch_ref import _SDPA_BACKENDS, _decode_batch, _prefill_one
from pdserve.engine.runtime.kv_pool import KVPool

GIB = 1 << 30
# Errors that make a block-size variant unrunnable on this GPU, reported instead of raised.
UNRUNNABLE = (OutOfResources, CompilationError, torch.OutOfMemoryError)


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


PRESETS = {
    "1b": Shape("1b", 32, 8, 64),  # Llama-3.2-1B
    "8b": Shape("8b", 32, 8, 128),  # Llama-3.1-8B
}


def parse_shape(text: str) -> Shape:
    """A preset name, or heads/kv_heads/head_dim."""
    if text in PRESETS:
        return PRESETS[text]
    heads, kv_heads, head_dim = (int(x) for x in text.split("/"))
    return Shape(text, heads, kv_heads, head_dim)


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes for a kernel; None fields keep the kernel's own choice."""

    label: str
    blocks: tuple[int, ...] | None  # extend: (M, N, warps, stages); decode: (N, warps, stages)
    splits: int | None = None  # decode only: replaces num_splits_for


def parse_configs(text: str, fields: int) -> list[LaunchConfig]:
    configs = []
    for label in text.split(","):
        blocks_text, _, splits = label.partition("@")
        blocks = None
        if blocks_text != "default":
            blocks = tuple(int(x) for x in blocks_text.split("x"))
            tiles = blocks[: fields - 2]
            if len(blocks) != fields or any(t < 16 or t & (t - 1) for t in tiles):
                raise SystemExit(
                    f"config {label!r}: want {fields} numbers joined by 'x', block sizes "
                    f"powers of two >= 16 (tl.dot's smallest tile)"
                )
        if splits and int(splits) < 1:
            raise SystemExit(f"config {label!r}: splits must be at least 1")
        configs.append(LaunchConfig(label, blocks, int(splits) if splits else None))
    return configs


class _LaunchRecorder:
    """Stands in for a Triton kernel: launches it with some keyword arguments replaced and
    remembers the launch parameters it used."""

    def __init__(self, kernel, overrides: dict[str, int]):
        self.kernel, self.overrides, self.used = kernel, overrides, {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs.update(self.overrides)
            self.used = {k: kwargs[k] for k in ("BLOCK_N", "num_warps", "num_stages")}
            return self.kernel[grid](*args, **kwargs)

        return launch


@contextmanager
def decode_blocks(config: LaunchConfig) -> Iterator[_LaunchRecorder]:
    """`paged_decode_attention` looks its kernel up at each call: swap in a recorder."""
    original = decode_attention._decode_chunk_kernel
    overrides = {}
    if config.blocks is not None:
        overrides = dict(zip(("BLOCK_N", "num_warps", "num_stages"), config.blocks, strict=True))
    recorder = _LaunchRecorder(original, overrides)
    decode_attention._decode_chunk_kernel = recorder
    try:
        yield recorder
    finally:
        decode_attention._decode_chunk_kernel = original


@contextmanager
def extend_blocks(config: LaunchConfig) -> Iterator[list[tuple[int, ...]]]:
    """`paged_extend_attention` calls its module's `_block_sizes`: swap in the config's."""
    original = extend_attention._block_sizes
    used: list[tuple[int, ...]] = []

    def block_sizes(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
        sizes = config.blocks if config.blocks is not None else original(head_dim, dtype)
        used[:] = [sizes]
        return sizes

    extend_attention._block_sizes = block_sizes
    try:
        yield used
    finally:
        extend_attention._block_sizes = original


class Timer:
    """Median milliseconds of a callable: `triton.testing.do_bench` (CUDA events, L2 flushed
    before each run) on a GPU, wall clock on a CPU."""

    def __init__(self, device: torch.device, warmup_ms: int, rep_ms: int, cpu_reps: int):
        self.device, self.cpu_reps = device, cpu_reps
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            return triton.testing.do_bench(
                fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"
            )
        fn()
        times = []
        for _ in range(self.cpu_reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_ceiling(args, timer: Timer, device: torch.device) -> dict:
    """One device-to-device copy of `--copy-mib`: bytes read + written over its time."""
    src = torch.randn(args.copy_mib * (1 << 20) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    moved = 2 * src.nbytes
    return {"copy_bytes": moved, "copy_us": copy_ms * 1e3, "copy_gb_per_s": moved / copy_ms / 1e6}


def gemm_ceiling(args, timer: Timer, device: torch.device) -> dict:
    n = args.gemm_size
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    gemm_ms = timer(lambda: a @ b)
    return {"gemm_size": n, "gemm_us": gemm_ms * 1e3, "gemm_tflop_per_s": 2 * n**3 / gemm_ms / 1e9}


def random_pool(shape: Shape, num_pages: int, page_size: int, dtype, device) -> KVPool:
    """One layer of paged KV filled with random values, none of them zero (a kernel reading
    the wrong slot, or none, cannot pass for right)."""
    pool = KVPool(
        num_layers=1,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
        device=device,
    )
    for chunk in pool.storage.view(-1).split(1 << 27):
        chunk.normal_()
        chunk.masked_fill_(chunk == 0, 1.0)
    return pool


def shuffled_pages(num_seqs: int, pages_per_seq: int) -> list[list[int]]:
    return torch.randperm(num_seqs * pages_per_seq).view(num_seqs, pages_per_seq).tolist()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32; NaN if any output was left unwritten."""
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm())


def run_decode_case(args, shape, batch, context, configs, timer, device, ceilings) -> dict:
    dtype, page_size = args.torch_dtype, args.page_size
    element = torch.empty((), dtype=dtype).element_size()
    pages_per_seq = math.ceil(context / page_size)
    kv_bytes = 2 * batch * context * shape.kv_heads * shape.head_dim * element
    case = {"shape": shape.name, "batch": batch, "context": context, "kv_bytes": kv_bytes}
    if kv_bytes > args.max_kv_gib * GIB:
        case["skipped"] = f"KV {kv_bytes / GIB:.1f} GiB > --max-kv-gib {args.max_kv_gib}"
        return case

    pool = random_pool(shape, batch * pages_per_seq, page_size, dtype, device)
    k_cache, v_cache = pool.k[0], pool.v[0]
    pages = shuffled_pages(batch, pages_per_seq)
    ctx = AttentionContext.build(
        page_size=page_size,
        pages=pages,
        num_computed=[context - 1] * batch,
        query_lens=[1] * batch,
        device=device,
    )
    q = torch.randn(batch, shape.heads, shape.head_dim, dtype=dtype, device=device)
    scale = shape.head_dim**-0.5
    # q and out, the page table, the KV lengths and rows: all read or written once.
    case["bytes"] = kv_bytes + 2 * q.nbytes + 8 * batch * (pages_per_seq + 2)

    def reference(seqs: int, seq_ctx: AttentionContext) -> torch.Tensor:
        with sdpa_kernel(_SDPA_BACKENDS):
            return _decode_batch(q[:seqs], k_cache, v_cache, seq_ctx, scale, None)

    # The reference gathers each checked sequence's K and V (kv_bytes / batch); allow as much
    # again for SDPA's own copies. A case too large for it is checked on its first sequences.
    checked = min(batch, int(args.max_ref_gib * GIB // (2 * kv_bytes / batch)))
    check_ctx = ctx
    if 0 < checked < batch:
        check_ctx = AttentionContext.build(
            page_size=page_size,
            pages=pages[:checked],
            num_computed=[context - 1] * checked,
            query_lens=[1] * checked,
            device=device,
        )
        case["ref_skipped"] = f"gather > --max-ref-gib {args.max_ref_gib}"
    ref_out = None
    try:
        if checked > 0:
            ref_out = reference(checked, check_ctx)
        if checked == batch:
            case["ref_us"] = timer(lambda: reference(batch, ctx)) * 1e3
    except torch.OutOfMemoryError:
        case["ref_skipped"] = "torch reference out of memory"
        release(device)
    case["checked_seqs"] = 0 if ref_out is None else ref_out.shape[0]

    case["configs"] = []
    for config in configs:
        splits = config.splits or decode_attention.num_splits_for(
            batch, shape.kv_heads, args.num_sms
        )
        out = torch.full_like(q, float("nan"))

        def kernel(out=out, splits=splits):
            decode_attention.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                ctx.page_table,
                ctx.decode_table_rows,
                ctx.decode_kv_lens,
                ctx.decode_token_rows,
                out,
                scale=scale,
                sliding_window=None,
                num_splits=splits,
            )

        result = {"config": config.label, "splits": splits}
        with decode_blocks(config) as recorder:
            try:
                kernel()
                if ref_out is not None:
                    result["rel_error"] = relative_error(out[: ref_out.shape[0]], ref_out)
                us = timer(kernel) * 1e3
            except UNRUNNABLE as exc:
                result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                release(device)
            else:
                gb_per_s = case["bytes"] / us / 1e3
                result.update(
                    us=us,
                    gb_per_s=gb_per_s,
                    pct_copy=100 * gb_per_s / ceilings["copy_gb_per_s"],
                )
            result["launch"] = recorder.used
        case["configs"].append(result)
    return case


def run_extend_case(args, shape, length, configs, timer, device, ceilings) -> dict:
    dtype, page_size = args.torch_dtype, args.page_size
    pages_per_seq = math.ceil(length / page_size)
    pool = random_pool(shape, pages_per_seq, page_size, dtype, device)
    k_cache, v_cache = pool.k[0], pool.v[0]
    ctx = AttentionContext.build(
        page_size=page_size,
        pages=shuffled_pages(1, pages_per_seq),
        num_computed=[0],
        query_lens=[length],
        device=device,
    )
    q = torch.randn(length, shape.heads, shape.head_dim, dtype=dtype, device=device)
    scale = shape.head_dim**-0.5
    flops = 4 * shape.heads * shape.head_dim * length**2 / 2
    case = {"shape": shape.name, "tokens": length, "causal_flops": flops}

    def reference():
        with sdpa_kernel(_SDPA_BACKENDS):
            return _prefill_one(q, k_cache, v_cache, ctx, 0, scale, None)

    ref_out = reference()
    case["ref_us"] = timer(reference) * 1e3
    case["ref_tflop_per_s"] = flops / case["ref_us"] / 1e6

    case["configs"] = []
    for config in configs:
        out = torch.full_like(q, float("nan"))

        def kernel(out=out):
            extend_attention.paged_extend_attention(
                q,
                k_cache,
                v_cache,
                out,
                ctx.page_table,
                ctx.seq_table_rows,
                ctx.prefill_index,
                ctx.seq_query_starts,
                ctx.seq_query_lens,
                ctx.seq_kv_lens,
                ctx.max_prefill_query_len,
                scale=scale,
                sliding_window=None,
            )

        result = {"config": config.label}
        with extend_blocks(config) as used:
            try:
                kernel()
                result["rel_error"] = relative_error(out, ref_out)
                us = timer(kernel) * 1e3
            except UNRUNNABLE as exc:
                result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                release(device)
            else:
                tflops = flops / us / 1e6
                result.update(
                    us=us,
                    tflop_per_s=tflops,
                    pct_gemm=100 * tflops / ceilings["gemm_tflop_per_s"],
                    speedup=case["ref_us"] / us,
                )
            result["blocks"] = list(used[0]) if used else None
        case["configs"].append(result)
    return case


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--decode-shapes", default="1b,8b", help="presets or heads/kv/dim")
    parser.add_argument("--batches", type=int_list, default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int_list, default=[512, 4096, 32768])
    parser.add_argument("--extend-shapes", default="8b,1b")
    parser.add_argument("--extend-lens", type=int_list, default=[4096, 8192])
    parser.add_argument("--decode-configs", default="default", help="NxWARPSxSTAGES[@SPLITS]")
    parser.add_argument("--extend-configs", default="default", help="MxNxWARPSxSTAGES")
    parser.add_argument("--max-kv-gib", type=float, default=40, help="skip larger decode cases")
    parser.add_argument(
        "--max-ref-gib", type=float, default=24, help="time the decode reference below this"
    )
    parser.add_argument("--num-sms", type=int, help="for num_splits_for (default: the GPU's)")
    parser.add_argument("--copy-mib", type=int, default=2048, help="HBM copy ceiling size")
    parser.add_argument("--gemm-size", type=int, default=8192, help="GEMM ceiling N (N^3)")
    parser.add_argument("--warmup-ms", type=int, default=10)
    parser.add_argument("--rep-ms", type=int, default=40)
    parser.add_argument("--cpu-reps", type=int, default=2, help="timed runs per case on CPU")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-extend", action="store_true")
    parser.add_argument("--output", help="write every figure as JSON here")
    args = parser.parse_args()

    device = torch.device(args.device)
    args.torch_dtype = getattr(torch, args.dtype)
    if args.num_sms is None:
        args.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4
        )
    decode_configs = parse_configs(args.decode_configs, 3)
    extend_configs = parse_configs(args.extend_configs, 4)
    torch.manual_seed(0)
    timer = Timer(device, args.warmup_ms, args.rep_ms, args.cpu_reps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    report = {
        "device": name or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "torch_dtype"},
        "decode": [],
        "extend": [],
    }

    def save() -> None:
        if args.output:
            Path(args.output).write_text(json.dumps(report, indent=2) + "\n")

    ceilings = report["ceilings"] = {
        **copy_ceiling(args, timer, device),
        **gemm_ceiling(args, timer, device),
    }
    release(device)
    print(
        f"{report['device']}, torch {torch.__version__}, triton {triton.__version__}: "
        f"copy {ceilings['copy_gb_per_s']:,.0f} GB/s (read + written), "
        f"bf16 GEMM {ceilings['gemm_tflop_per_s']:,.0f} TFLOP/s",
        flush=True,
    )
    if not args.skip_decode:
        for shape in map(parse_shape, args.decode_shapes.split(",")):
            for context in args.contexts:
                for batch in args.batches:
                    case = run_decode_case(
                        args, shape, batch, context, decode_configs, timer, device, ceilings
                    )
                    report["decode"].append(case)
                    release(device)
                    print(decode_line(case), flush=True)
                    save()
    if not args.skip_extend:
        for shape in map(parse_shape, args.extend_shapes.split(",")):
            for length in args.extend_lens:
                case = run_extend_case(args, shape, length, extend_configs, timer, device, ceilings)
                report["extend"].append(case)
                release(device)
                print(extend_line(case), flush=True)
                save()
    save()
    if any("configs" in case for case in report["decode"]):
        print("\n" + decode_table(report["decode"], ceilings))
    if report["extend"]:
        print("\n" + extend_table(report["extend"], ceilings))


if __name__ == "__main__":
    main()
