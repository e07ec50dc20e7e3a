"""Decode latency at fixed batch sizes: pdserve's engine beside transformers' static-cache
`generate`, in one process.

Each batch of B prompts (`--prompt-len` random token ids each) is submitted at once, greedy
(or sampled with `--temperature`/`--top-p`, both engines alike), EOS ignored, so every sequence
generates exactly `--new-tokens` tokens. Every figure is the median of `--runs` timed runs
after `--warmup-runs` untimed ones at the same batch size, with fresh prompts each run.

pdserve: the engine is stepped until every sequence has its first token (time to first token
for the batch; the prefill budget fits the largest batch in one step), then the remaining
new_tokens - 1 decode steps are timed, CUDA-synchronized at both ends. Decode tok/s counts the
B x (new_tokens - 1) tokens of those steps.

transformers: `generate` with `cache_implementation="static"`, which on CUDA compiles the
decode forward itself (`torch.compile`, mode "reduce-overhead"; `--no-compile` turns that
off). It has no hook between prefill and decode, so time to first token is a run with
max_new_tokens=1 and decode time is a full run's time minus that. Batch 1 by default
(`--hf-batch-sizes` for more).

    python benchmarks/latency.py --preset llama-3.2-1b \\
        --backends pdserve,pdserve:torch,transformers --output $OUT/latency_llama1b.json
    python benchmarks/latency.py --preset llama-3.1-8b --output $OUT/latency_llama8b.json
    python benchmarks/latency.py --model-path DIR --batch-sizes 1,2 --prompt-len 8 \\
        --new-tokens 8 --no-compile                       # CPU smoke on a tiny model
    python benchmarks/plot_latency.py $OUT/latency_llama1b.json $OUT/latency_llama8b.json \\
        $OUT/latency.png

`pdserve:NAME` runs pdserve with `--attention-backend NAME` (plain `pdserve`: auto).
`--disable-cuda-graph` and `--cuda-graph-max-bs` go to the engine where its config has them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import (
    add_model_arguments,
    device_name,
    load_transformers_model,
    model_directory,
    split_backend,
    sync,
)


@dataclasses.dataclass(frozen=True)
class BatchTiming:
    """One run of one batch: submit -> every sequence has its first token, then decode."""

    first_token_s: float
    decode_s: float
    decode_steps: int


def summarize(engine: str, batch: int, timings: list[BatchTiming], **extra) -> dict:
    first_token = statistics.median(t.first_token_s for t in timings)
    decode = statistics.median(t.decode_s for t in timings)
    steps = timings[0].decode_steps
    return {
        "engine": engine,
        "batch": batch,
        "ttft_ms": round(first_token * 1e3, 2),
        "decode_step_ms": round(decode / steps * 1e3, 3),
        "decode_tokens_per_s": round(batch * steps / decode, 1),
        "decode_tokens_per_s_per_seq": round(steps / decode, 2),
        "decode_ms_runs": [round(t.decode_s * 1e3, 2) for t in timings],
        **extra,
    }


# ---- pdserve ------------------------------------------------------------------------------


def cuda_graph_options(args: argparse.Namespace) -> dict:
    """The CUDA graph settings for EngineConfig, only those it has (an engine without CUDA
    graphs runs every step eagerly, so leaving them out there changes nothing)."""
    from pdserve.engine.core.config import EngineConfig

    fields = {field.name for field in dataclasses.fields(EngineConfig)}
    options = {}
    if "disable_cuda_graph" in fields:
        options["disable_cuda_graph"] = args.disable_cuda_graph
    if args.cuda_graph_max_bs is not None:
        if "cuda_graph_max_bs" in fields:
            options["cuda_graph_max_bs"] = args.cuda_graph_max_bs
        else:
            print("note: this EngineConfig has no cuda_graph_max_bs; ignored", file=sys.stderr)
    return options


def run_pdserve(model_path: str, args: argparse.Namespace, attention_backend: str) -> list[dict]:
    from pdserve import LLM

    largest = max(args.batch_sizes)
    options = cuda_graph_options(args)
    llm = LLM(
        model_path,
        attention_backend=attention_backend,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.new_tokens + 1,
        max_running_requests=largest,
        # NOTE: the whole largest batch prefills in one step, so no sequence starts decoding
        # before the last prompt is in and every timed step decodes the full batch.
        chunked_prefill_size=max(8192, largest * args.prompt_len),
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        **options,
    )
    engine = llm.engine
    name = "pdserve" if attention_backend == "auto" else f"pdserve:{attention_backend}"
    generator = torch.Generator().manual_seed(args.seed)
    request_ids = (f"latency-{i}" for i in itertools.count())
    results = []
    for batch in args.batch_sizes:

        def run(batch: int = batch) -> BatchTiming:
            return time_pdserve_batch(engine, batch, args, generator, request_ids)

        for _ in range(args.warmup_runs):
            run()
        results.append(
            summarize(
                name,
                batch,
                [run() for _ in range(args.runs)],
                attention=type(engine.attention_backend).__name__,
                engine_options=options,
            )
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def time_pdserve_batch(engine, batch: int, args, generator, request_ids) -> BatchTiming:
    from pdserve import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        ignore_eos=True,
    )
    prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=generator).tolist()
    sync()
    start = time.perf_counter()
    requests = []
    for prompt in prompts:
        request_id = next(request_ids)
        engine.add_request(request_id, prompt, params)
        requests.append(engine.requests[request_id])
    # NOTE: with overlap scheduling a sampled token lands (joins `output_token_ids`) a step
    # after it was sampled.
    while any(not r.output_token_ids for r in requests):
        engine.step()
    sync()
    first_token = time.perf_counter()
    if any(len(r.output_token_ids) != 1 for r in requests):
        raise RuntimeError(
            f"batch {batch}: some sequences decoded before the last prompt finished prefill; "
            "the timed steps would not all decode the full batch"
        )
    decode_steps = 0
    while engine.has_unfinished():
        engine.step()
        decode_steps += 1
    sync()
    end = time.perf_counter()
    # Overlap scheduling adds up to one step: the one that lands the last tokens (it also ran
    # a decode whose tokens are dropped, the requests having reached their length).
    lag = 1 if engine.overlap else 0
    if decode_steps - lag != args.new_tokens - 1 or any(
        r.num_output_tokens != args.new_tokens for r in requests
    ):
        raise RuntimeError(
            f"batch {batch}: {decode_steps} decode steps for {args.new_tokens - 1} tokens per "
            "sequence; the batch did not decode together (preempted for lack of KV pages?)"
        )
    return BatchTiming(first_token - start, end - first_token, args.new_tokens - 1)


# ---- transformers -------------------------------------------------------------------------


def run_transformers(model_path: str, args: argparse.Namespace) -> list[dict]:
    model = load_transformers_model(model_path, args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    results = []
    for batch in args.hf_batch_sizes:

        def run(batch: int = batch) -> BatchTiming:
            first_token = time_generate(model, batch, 1, args, generator)
            full = time_generate(model, batch, args.new_tokens, args, generator)
            return BatchTiming(first_token, full - first_token, args.new_tokens - 1)

        for _ in range(args.warmup_runs):
            run()
        results.append(
            summarize(
                "transformers",
                batch,
                [run() for _ in range(args.runs)],
                cache="static",
                # What transformers itself did: it keeps the compiled forward it decoded with.
                compiled=getattr(model, "_compiled_call", None) is not None,
            )
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def time_generate(model, batch: int, new_tokens: int, args, generator) -> float:
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, args.prompt_len), generator=generator).to(model.device)
    sync()
    start = time.perf_counter()
    output = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=args.temperature > 0,
        **({"temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else {}),
        pad_token_id=0,
        cache_implementation="static",
        disable_compile=args.no_compile,
    )
    sync()
    elapsed = time.perf_counter() - start
    if output.shape != (batch, args.prompt_len + new_tokens):
        raise RuntimeError(f"transformers generated {tuple(output.shape)} for {new_tokens} tokens")
    return elapsed


# ---- report -------------------------------------------------------------------------------


def batch1_ratios(results: list[dict]) -> dict[str, float]:
    """Each pdserve engine's batch-1 decode tok/s over transformers' static-cache batch 1."""
    at_batch1 = {r["engine"]: r for r in results if r["batch"] == 1}
    baseline = at_batch1.get("transformers")
    if baseline is None:
        return {}
    return {
        f"{name}_over_transformers_static_batch1": round(
            result["decode_tokens_per_s"] / baseline["decode_tokens_per_s"], 2
        )
        for name, result in at_batch1.items()
        if name != "transformers"
    }


def markdown_table(report: dict) -> str:
    lines = [
        "| engine | batch | TTFT (ms) | decode step (ms) | decode tok/s | tok/s per sequence |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if r["engine"] == "transformers":
            label = "transformers `generate`, static cache"
            label += ", compiled" if r["compiled"] else ", eager"
        else:
            label = f"{r['engine']} ({r['attention']}{graphs_note(r)})"
        lines.append(
            f"| {label} | {r['batch']} | {r['ttft_ms']:,.1f} | {r['decode_step_ms']:.2f} | "
            f"{r['decode_tokens_per_s']:,.0f} | {r['decode_tokens_per_s_per_seq']:,.1f} |"
        )
    for key, ratio in report["ratios"].items():
        name = key.removesuffix("_over_transformers_static_batch1")
        lines.append(f"| **{name} / transformers static, batch 1** | | | | | **{ratio:.2f}x** |")
    return "\n".join(lines)


def graphs_note(result: dict) -> str:
    return ", no CUDA graphs" if result["engine_options"].get("disable_cuda_graph") else ""


def parse_sizes(text: str) -> list[int]:
    sizes = [int(size) for size in text.split(",")]
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--batch-sizes", type=parse_sizes, default=[1, 16, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per batch size")
    parser.add_argument("--warmup-runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--backends", default="pdserve,transformers")
    parser.add_argument(
        "--hf-batch-sizes", type=parse_sizes, default=[1], help="transformers' batch sizes"
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="transformers decodes eagerly (CPU smoke)"
    )
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--cuda-graph-max-bs", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--output", "--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2: one from prefill, the rest decode")
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    backends = args.backends.split(",")
    for name in backends:
        if name != "transformers" and split_backend(name)[0] != "pdserve":
            parser.error(f"unknown backend {name!r}: pdserve, pdserve:NAME or transformers")

    import transformers

    report = {
        "model": args.preset or args.model_path,
        "device": device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "runs": args.runs,
        "warmup_runs": args.warmup_runs,
        "results": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        model_path = model_directory(args, scratch)
        for name in backends:
            engine, attention = split_backend(name)
            if engine == "pdserve":
                report["results"] += run_pdserve(model_path, args, attention)
            else:
                report["results"] += run_transformers(model_path, args)
            gc.collect()  # the engine's KV pool goes before the next backend loads
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    report["ratios"] = batch1_ratios(report["results"])
    print(json.dumps(report, indent=2))
    print(markdown_table(report))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
