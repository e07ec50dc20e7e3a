"""Tensor parallelism's speed-up: the same model at each `--tp-sizes` size, one after another in
one job on one machine: decode tok/s at each batch size and the time to prefill one long prompt.

Decode: `latency.py`'s measurement (a batch of `--prompt-len`-token prompts submitted at once,
greedy, EOS ignored; the decode steps after every sequence's first token are timed, median of
`--runs` after `--warmup-runs`). Prefill: one `--prefill-len`-token prompt, submit to first
token, in one chunk (median of `--runs`). Ratios are each size's figure over the first size's.
`--two-batch-overlap both` measures every size above 1 twice, without and with
`--enable-two-batch-overlap` (long prefill passes as two halves whose all-reduces overlap);
compare the two prefill figures: torch maps one symmetric-memory group per process, so the
second engine's decode all-reduces fall back to NCCL.

    python benchmarks/tensor_parallel.py --preset llama-3.1-8b --tp-sizes 1,2 \\
        --batch-sizes 1,64 --prefill-len 4096 --output $OUT/tensor_parallel.json
    python benchmarks/tensor_parallel.py --model-path DIR --tp-sizes 1,2 --batch-sizes 1 \\
        --two-batch-overlap both --output $OUT/tensor_parallel_tbo.json
    python benchmarks/tensor_parallel.py --model-path DIR --tp-sizes 1,2 --batch-sizes 1,2 \\
        --prompt-len 8 --new-tokens 8 --prefill-len 64 --runs 1 --warmup-runs 0   # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import add_model_arguments, device_name, model_directory, sync
from latency import parse_sizes, summarize, time_pdserve_batch


def measure(model_path: str, tp_size: int, args: argparse.Namespace, overlap: bool) -> dict:
    from pdserve import LLM, SamplingParams

    largest = max(args.batch_sizes)
    options = dict(
        tp_size=tp_size,
        enable_two_batch_overlap=overlap,
        dtype=args.dtype,
        max_model_len=max(args.prompt_len + args.new_tokens, args.prefill_len) + 1,
        max_running_requests=largest,
        chunked_prefill_size=max(8192, largest * args.prompt_len, args.prefill_len),
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
    )
    if args.device:
        options["device"] = args.device
    with LLM(model_path, **options) as llm:
        engine = llm.engine
        generator = torch.Generator().manual_seed(args.seed)
        request_ids = (f"tp-{i}" for i in itertools.count())
        decode = []
        for batch in args.batch_sizes:
            for _ in range(args.warmup_runs):
                time_pdserve_batch(engine, batch, args, generator, request_ids)
            timings = [
                time_pdserve_batch(engine, batch, args, generator, request_ids)
                for _ in range(args.runs)
            ]
            decode.append(summarize("pdserve", batch, timings))
            print(json.dumps({"tp_size": tp_size, "overlap": overlap, **decode[-1]}), flush=True)
        one_token = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        vocab = engine.model_config.vocab_size
        prefill_s = []
        for run in range(args.warmup_runs + args.runs):
            prompt = torch.randint(0, vocab, (args.prefill_len,), generator=generator).tolist()
            sync()
            start = time.perf_counter()
            llm.generate([prompt], one_token, use_tqdm=False)
            sync()
            if run >= args.warmup_runs:
                prefill_s.append(time.perf_counter() - start)
    result = {
        "tp_size": tp_size,
        "two_batch_overlap": overlap,
        "decode": decode,
        "prefill_len": args.prefill_len,
        "prefill_ms": round(statistics.median(prefill_s) * 1e3, 2),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "decode"}), flush=True)
    return result


def ratios(results: list[dict]) -> dict:
    """Each size's decode tok/s and prefill speed over the first size's."""
    base = results[0]
    table = {}
    for result in results[1:]:
        row = {
            f"decode_b{d['batch']}": round(d["decode_tokens_per_s"] / b["decode_tokens_per_s"], 2)
            for d, b in zip(result["decode"], base["decode"], strict=True)
        }
        row["prefill"] = round(base["prefill_ms"] / result["prefill_ms"], 2)
        name = f"tp{result['tp_size']}{'_two_batch' if result['two_batch_overlap'] else ''}"
        table[f"{name}_over_tp{base['tp_size']}"] = row
    return table


def markdown_table(report: dict) -> str:
    lines = [
        f"{report['model']} on {report['device']} ({report['dtype']})",
        "",
        "| TP | "
        + " | ".join(f"decode b{b} tok/s" for b in report["batch_sizes"])
        + f" | prefill {report['prefill_len']} tok ms |",
        "|---|" + "---|" * (len(report["batch_sizes"]) + 1),
    ]
    for r in report["results"]:
        cells = [str(d["decode_tokens_per_s"]) for d in r["decode"]] + [str(r["prefill_ms"])]
        label = f"{r['tp_size']}{' two-batch' if r['two_batch_overlap'] else ''}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for name, row in report["ratios"].items():
        lines.append("")
        lines.append(f"{name}: " + ", ".join(f"{k} {v}x" for k, v in row.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--tp-sizes", type=parse_sizes, default=[1, 2])
    parser.add_argument("--batch-sizes", type=parse_sizes, default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup-runs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--device", help="rank 0's device (default: auto)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument(
        "--two-batch-overlap",
        choices=["off", "on", "both"],
        default="off",
        help="--enable-two-batch-overlap for sizes above 1 (both: each such size twice)",
    )
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2: one from prefill, the rest decode")
    report = {
        "model": args.preset or args.model_path,
        "device": device_name(),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "batch_sizes": args.batch_sizes,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "prefill_len": args.prefill_len,
        "runs": args.runs,
        "results": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        model_path = model_directory(args, scratch)
        for size in args.tp_sizes:
            overlaps = {"off": [False], "on": [True], "both": [False, True]}[args.two_batch_overlap]
            for overlap in overlaps if size > 1 else [False]:
                report["results"].append(measure(model_path, size, args, overlap))
                gc.collect()
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
    report["ratios"] = ratios(report["results"])
    print(markdown_table(report))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
