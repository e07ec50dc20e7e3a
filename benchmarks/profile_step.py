"""Where a decode step's time goes: host (Python) vs device kernels, at a fixed batch shape.

Starts `--batch` requests with `--context` prompt tokens each, runs until all are decoding,
then times `--steps` engine steps and prints the mean step time, the top host functions
(cProfile) and the top CUDA kernels (torch.profiler).

    python benchmarks/profile_step.py --preset llama-3.2-1b --batch 256 --context 1024
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path")
    source.add_argument("--preset")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args()

    from pdserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as scratch:
        model_path = args.model_path
        if model_path is None:
            from pdserve.engine.random_model import make_random_model

            model_path = str(make_random_model(Path(scratch) / args.preset, args.preset))
        llm = LLM(
            model_path,
            max_model_len=args.context + 4 * args.steps + 64,
            attention_backend=args.attention_backend,
        )
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=4 * args.steps + 32, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(0, vocab, (args.context,), generator=generator).tolist()
        engine.add_request(f"p{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()  # warm-up at the decode shape
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    print(
        f"decode step, batch {args.batch}, context ~{args.context}: {step_ms:.2f} ms "
        f"({args.batch / step_ms * 1e3:.0f} tokens/s)"
    )

    host = cProfile.Profile()
    host.enable()
    for _ in range(args.steps):
        engine.step()
    sync()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())

    if torch.cuda.is_available():
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                engine.step()
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top))
        kernels_us = sum(
            event.self_device_time_total
            for event in prof.key_averages()
            if event.device_type == torch.autograd.DeviceType.CUDA
        )
        print(
            f"GPU time per decode step ({type(engine.attention_backend).__name__}): "
            f"{kernels_us / args.steps / 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
