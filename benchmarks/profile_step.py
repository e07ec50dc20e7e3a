"""Where an engine step's time goes: host (Python) vs device kernels, at a fixed shape.

Decode (default): starts `--batch` requests with `--context` prompt tokens each, runs until
all are decoding, then times `--steps` engine steps and prints the mean step time, the top
host functions (cProfile), the top CUDA kernels (torch.profiler) and the GPU time per step.

With `--speculative eagle3-chain` (a chain of 4 drafts; the head `--draft`, else a random
one of the target's width, whose acceptance is about 1: every step is then a full draft +
verify + catch-up) or `ngram-chain`, each decode step is a speculative step.

Prefill (`--mode prefill`): times `--steps` steps that each prefill one fresh prompt of
`--context` tokens (and sample its first token); prints the median step time and the GPU
time per step.

    python benchmarks/profile_step.py --preset llama-3.2-1b --batch 256 --context 1024
    python benchmarks/profile_step.py --preset llama-3.1-8b --mode prefill --context 4096
    python benchmarks/profile_step.py --model-path M.gguf --batch 1 --context 64 \
        --speculative eagle3-chain
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import statistics
import tempfile
import time

import torch
from harness import add_model_arguments, model_directory, sync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--mode", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--unfused-elementwise",
        action="store_true",
        help="Triton attention with torch norm/activation (what the fused kernels save)",
    )
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--speculative", choices=["eagle3-chain", "ngram-chain"], default=None)
    parser.add_argument("--draft", default=None, help="EAGLE-3 head (default: a random one)")
    parser.add_argument("--tp-size", type=int, default=1, help="rank 0's view of a TP worker")
    parser.add_argument("--trace", help="write the profiled steps' Chrome trace here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.unfused_elementwise:
        from pdserve.engine.runtime.attention.triton_backend import TritonBackend

        TritonBackend.fused_elementwise = False

    from pdserve import LLM

    with tempfile.TemporaryDirectory() as scratch:
        model = model_directory(args, scratch)
        llm = LLM(
            model,
            max_model_len=args.context + 4 * args.steps + 64,
            chunked_prefill_size=max(8192, args.context),
            attention_backend=args.attention_backend,
            disable_cuda_graph=args.disable_cuda_graph,
            speculative=speculative_settings(args, model, scratch),
            tp_size=args.tp_size,
        )
    engine = llm.engine
    backend = type(engine.attention_backend).__name__
    if args.unfused_elementwise:
        backend += ", torch norm/activation"
    backend += ", eager" if engine.runner.decode_graphs is None else ", CUDA graphs"
    run = (prefill_steps if args.mode == "prefill" else decode_steps)(engine, args)

    host = cProfile.Profile()
    host.enable()
    run()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())

    if torch.cuda.is_available():
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            run()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top))
        kernels_us = sum(
            event.self_device_time_total
            for event in prof.key_averages()
            if event.device_type == torch.autograd.DeviceType.CUDA
        )
        print(f"GPU time per {args.mode} step ({backend}): {kernels_us / args.steps / 1e3:.2f} ms")
        print_kernel_classes(prof, args.steps)
        if args.trace:
            prof.export_chrome_trace(args.trace)


# NOTE: matched lower-cased; cuBLAS under CUDA 13 names its Hopper kernels nvjet_*.
KERNEL_CLASSES = {
    "matmul": ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitk", "matmul"),
    "all-reduce": ("one_shot", "all_reduce", "allreduce"),
    "other collective": ("nccl", "broadcast", "allgather"),
    "attention": ("attention", "attn", "flash", "decode_chunk", "merge_chunks", "extend"),
}


def print_kernel_classes(prof, steps: int) -> None:
    """GPU time per step by kind of kernel (first matching class by name), the launches per
    step, and the largest single kernels of the collective classes (a long one waited for a
    peer rank)."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.key.lower()
        kind = next(
            (k for k, needles in KERNEL_CLASSES.items() if any(n in name for n in needles)),
            "other",
        )
        totals[kind] = totals.get(kind, 0.0) + event.self_device_time_total
        counts[kind] = counts.get(kind, 0) + event.count
    for kind, us in sorted(totals.items(), key=lambda item: -item[1]):
        print(
            f"  {kind:>16}: {us / steps / 1e3:.3f} ms a step, "
            f"{counts[kind] / steps:.0f} kernels a step"
        )


def speculative_settings(args, model: str, scratch: str):
    from pdserve.protocol.spec_settings import SpecSettings

    if args.speculative == "ngram-chain":
        return SpecSettings("NGRAM", None, 4, 1, 5)
    if args.speculative != "eagle3-chain":
        return None
    draft = args.draft
    if draft is None:
        from pdserve.engine.checkpoint.model_files import resolve_model_dir
        from pdserve.speculative.checkpoints import make_tiny_eagle_draft

        target = resolve_model_dir(model)
        vocab = list(range(4096))  # a reduced draft vocabulary, as train-eagle writes
        draft = str(make_tiny_eagle_draft(f"{scratch}/eagle3", target, draft_vocab_ids=vocab))
    return SpecSettings("EAGLE3", draft, 4, 1, 5)


def random_prompt(engine, length: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, engine.model_config.vocab_size, (length,), generator=generator).tolist()


def decode_steps(engine, args):
    """Fill the batch, time `steps` decode steps; return a function that runs `steps` more."""
    from pdserve import SamplingParams

    generator = torch.Generator().manual_seed(0)
    # Enough tokens for the timed steps and the two profiled runs.
    params = SamplingParams(max_new_tokens=4 * args.steps + 32, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", random_prompt(engine, args.context, generator), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()

    def run() -> None:
        for _ in range(args.steps):
            engine.step()
        sync()

    for _ in range(3):
        engine.step()  # warm-up at the decode shape
    sync()
    start = time.perf_counter()
    run()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    print(
        f"decode step, batch {args.batch}, context ~{args.context}: {step_ms:.2f} ms "
        f"({args.batch / step_ms * 1e3:.0f} tokens/s)"
    )
    return run


def prefill_steps(engine, args):
    """Time `steps` one-prompt prefill steps (median); return a function that runs more."""
    from pdserve import SamplingParams

    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    counter = iter(range(1 << 30))

    def one() -> float:
        engine.add_request(
            f"p{next(counter)}", random_prompt(engine, args.context, generator), params
        )
        sync()
        start = time.perf_counter()
        engine.step()
        if engine.overlap and engine.requests:
            engine.step()  # NOTE: overlapped, the first token lands a step later
        sync()
        elapsed = time.perf_counter() - start
        if engine.requests:
            raise RuntimeError("the prompt did not finish in one step; raise the prefill budget")
        return elapsed

    def run() -> None:
        for _ in range(args.steps):
            one()

    for _ in range(2):
        one()  # warm-up: kernel compilation at this shape
    times = [one() for _ in range(args.steps)]
    median_ms = statistics.median(times) * 1e3
    print(
        f"prefill step, one prompt of {args.context} tokens: {median_ms:.2f} ms median "
        f"({args.context / median_ms * 1e3:.0f} tokens/s)"
    )
    return run


if __name__ == "__main__":
    main()
