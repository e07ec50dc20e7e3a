"""What one tensor-parallel all-reduce costs between two GPUs, inside a CUDA graph as decode
replays it: NCCL beside the one-shot all-reduce over symmetric memory
(`pdserve.engine.parallel.symmetric_all_reduce`, which `TensorParallel.all_reduce` takes for
what fits its buffer) and torch's own one-shot operator on the same buffer, for activations of
`tokens x hidden` bf16; then each followed by the residual add and RMSNorm a layer runs
after it, against pdserve's kernel that does all three in one
(`TensorParallel.sum_and_norm`).

A decode step of an L-layer model runs 2L + 1 of these (attention output, MLP output, the
embedding), so at batch 1 the per-call latency times ~65 is what TP adds to every step.

    python benchmarks/all_reduce.py --tokens 1 8 64 512 4096 --output $OUT/all_reduce.json
    python benchmarks/all_reduce.py --tokens 4096 8192 --two-shot-mib 64   # prefill sizes

Each figure: one graph of `--calls` all-reduces replayed `--replays` times, timed by CUDA
events on rank 0, divided by the number of calls (median of `--runs`). The one-shot sums are
checked against NCCL's before they are timed. With `--two-shot-mib`, sizes the one-shot does
not take (prefill's) are also timed eagerly, as prefill runs them: NCCL, and torch's two-shot
operator (reduce-scatter and all-gather through symmetric memory, the copy in included),
whose sums are checked too: what a fused two-shot kernel for prefill would start from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZE = 2


def time_graph(body, calls: int, replays: int, runs: int) -> float:
    """Microseconds per call of `body` captured `calls` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            body()
    graph.replay()
    torch.cuda.synchronize()
    return _median_us(graph.replay, replays, runs) / calls


def time_eager(body, calls: int, runs: int) -> float:
    """Microseconds per call of `body` run `calls` times in a row, eagerly (as prefill runs)."""
    for _ in range(3):
        body()
    torch.cuda.synchronize()
    return _median_us(body, calls, runs)


def _median_us(body, repeats: int, runs: int) -> float:
    """Median over `runs` of the microseconds one of `repeats` back-to-back `body()` calls
    takes, timed by CUDA events."""
    results = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            body()
        end.record()
        end.synchronize()
        results.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(results)


def two_shot_buffer(small, mib: int, device) -> torch.Tensor | None:
    """A second symmetric buffer of `mib` MiB in the one-shot's group, for torch's two-shot
    operator (None without the one-shot's group)."""
    if small is None or not mib:
        return None
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty((mib << 20) // 2, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buffer, small.name)
    return buffer


def time_prefill_sizes(row, local, expect, group, big, args) -> None:
    """Eager timings of a prefill-sized all-reduce: NCCL, and torch's two-shot operator
    (copy into the symmetric buffer included) where it fits `big`."""
    scratch = torch.zeros_like(local)
    row["nccl_eager_us"] = time_eager(
        lambda: group.allreduce([scratch]).wait(), args.calls, args.runs
    )
    if big is None or local.numel() > big.numel():
        return
    mapped = big[: local.numel()].view(local.shape)

    def two_shot(x=local):
        mapped.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(mapped, "sum", args.group_name)

    two_shot()
    torch.cuda.synchronize()
    row["two_shot_max_error"] = float((mapped.float() - expect.float()).abs().max())
    row["two_shot_eager_us"] = time_eager(two_shot, args.calls, args.runs)


def rank_main(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    from pdserve.engine.kernels.norm import rms_norm
    from pdserve.engine.parallel.process_groups import open_group
    from pdserve.engine.parallel.symmetric_all_reduce import FLAG_BYTES, SymmetricAllReduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, SIZE, rank == 0)
    group = open_group(store, rank, SIZE, device, timeout_s=120)
    small = SymmetricAllReduce.open(group, store, rank, SIZE, device, torch.bfloat16)
    big = two_shot_buffer(small, args.two_shot_mib, device)
    args.group_name = small.name if small is not None else ""
    generator = torch.Generator(device).manual_seed(rank)
    rows = []
    for tokens in args.tokens:
        local = torch.randn(
            (tokens, args.hidden), dtype=torch.bfloat16, device=device, generator=generator
        )
        expect = local.clone()
        group.allreduce([expect]).wait()
        scratch = torch.zeros_like(local)
        row = {"tokens": tokens, "bytes": local.numel() * local.element_size()}
        row["nccl_us"] = time_graph(
            lambda scratch=scratch: group.allreduce([scratch]).wait(),
            args.calls,
            args.replays,
            args.runs,
        )
        weight = torch.rand(args.hidden, dtype=torch.bfloat16, device=device, generator=generator)
        residual = torch.randn_like(local)

        def norm_after(total, residual=residual, weight=weight):
            return rms_norm(total, weight, 1e-5, residual)

        def nccl_then_norm(x=scratch):
            group.allreduce([x]).wait()
            return norm_after(x)

        row["nccl_norm_us"] = time_graph(
            nccl_then_norm,
            args.calls,
            args.replays,
            args.runs,
        )
        if small is not None and small.fits(local):
            got = small(local)
            fused, stream = small.sum_and_norm(local, residual.clone(), weight, 1e-5)
            want, want_stream = rms_norm(expect, weight, 1e-5, residual.clone())
            torch.cuda.synchronize()
            row["one_shot_max_error"] = float((got.float() - expect.float()).abs().max())
            row["fused_equals_unfused"] = torch.equal(fused, want) and torch.equal(
                stream, want_stream
            )
            row["one_shot_us"] = time_graph(
                lambda scratch=scratch: small(scratch), args.calls, args.replays, args.runs
            )
            mapped = small.buffer[FLAG_BYTES:].view(torch.bfloat16)[: local.numel()]
            mapped = mapped.view(local.shape)

            def torch_one_shot(x=scratch, mapped=mapped):
                return torch.ops.symm_mem.one_shot_all_reduce_copy(mapped, x, "sum", small.name)

            row["torch_one_shot_us"] = time_graph(
                torch_one_shot, args.calls, args.replays, args.runs
            )
            row["one_shot_norm_us"] = time_graph(
                lambda s=scratch: norm_after(small(s)), args.calls, args.replays, args.runs
            )
            row["fused_norm_us"] = time_graph(
                lambda s=scratch, r=residual, w=weight: small.sum_and_norm(s, r, w, 1e-5),
                args.calls,
                args.replays,
                args.runs,
            )
        if args.two_shot_mib and not (small is not None and small.fits(local)):
            time_prefill_sizes(row, local, expect, group, big, args)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        queue.put({"rows": rows, "one_shot": small is not None})
    done = torch.zeros(1, device=device)
    group.allreduce([done]).wait()  # neither rank leaves (taking the store) before the other
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 128, 512, 4096])
    parser.add_argument("--hidden", type=int, default=4096, help="Llama-3.1-8B's")
    parser.add_argument(
        "--two-shot-mib",
        type=int,
        default=0,
        help="also time what the one-shot does not take eagerly, NCCL beside torch's two-shot "
        "operator over a symmetric buffer of this many MiB (0: not)",
    )
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the ranks")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < SIZE:
        print(f"needs {SIZE} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    from pdserve.server.local_process import free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(r, port, args, queue)) for r in range(SIZE)]
    for process in ranks:
        process.start()
    answer, deadline = None, time.monotonic() + args.timeout
    while answer is None:
        try:
            answer = queue.get(timeout=1.0)
        except Empty:
            failed = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"exit codes {failed}" if failed else f"no result in {args.timeout:.0f} s"
                print(f"the ranks failed ({why})", file=sys.stderr)
                for process in ranks:
                    process.kill()
                return 1
    for process in ranks:
        process.join(timeout=60)
    rows = answer["rows"]
    report = {
        "device": torch.cuda.get_device_name(0),
        "hidden": args.hidden,
        "one_shot_available": answer["one_shot"],
        "results": rows,
    }
    columns = [
        "nccl_us",
        "nccl_eager_us",
        "two_shot_eager_us",
        "torch_one_shot_us",
        "one_shot_us",
        "nccl_norm_us",
        "one_shot_norm_us",
        "fused_norm_us",
    ]
    print("\n tokens     bytes " + " ".join(f"{c:>17}" for c in columns))
    nan = float("nan")
    for row in rows:
        figures = " ".join(f"{row.get(c, nan):17.1f}" for c in columns)
        print(f"{row['tokens']:7d} {row['bytes']:9d} {figures}")
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
