"""What a tensor-parallel worker adds to a handoff: rank 0 gathering a piece's pages from
every rank in the layout of one rank with every KV head (prefill), and scattering them back
(decode's commit), beside a TP 1 worker's gather and scatter of the same pages, in one job.

The model is Llama-3.1-8B's KV layout (32 layers, 8 KV heads of 128, bf16) on a thin random
model (the weights do not matter here), so a page of 16 tokens is 2 MiB whatever the TP size.

    python benchmarks/tensor_parallel_staging.py --tp-sizes 1,2 --mib 16,128,512 \\
        --output $OUT/tensor_parallel_staging.json
    python benchmarks/tensor_parallel_staging.py --device cpu --tp-sizes 1,2 --mib 2 --runs 2

Each figure: median of `--runs` of one gather (or scatter) of that many MiB of pages, the
device synchronized before and after (a handoff waits for it the same way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve import LLM
from pdserve.disagg.handoff_common import engine_transfer_layout
from pdserve.synthetic.tiny_model import make_tiny_model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, runs: int) -> float:
    """Median milliseconds of fn() over `runs`, after one untimed call."""
    fn()
    results = []
    for _ in range(runs):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        results.append((time.perf_counter() - started) * 1e3)
    return statistics.median(results)


def measure(model: str, tp_size: int, args) -> list[dict]:
    rows = []
    options = dict(device=args.device, dtype="bfloat16", kv_cache_memory=args.kv_gib << 30)
    with LLM(model, tp_size=tp_size, **options) as llm:
        stager = engine_transfer_layout(llm.engine).stager
        page_bytes = stager.page_bytes[0]
        for mib in args.mib:
            pages = list(range(0, 2 * (mib << 20) // page_bytes, 2))  # every other page
            buffer = stager.gather([pages])
            gather_ms = timed(lambda pages=pages: stager.gather([pages]), args.device, args.runs)
            scatter_ms = timed(
                lambda pages=pages, buffer=buffer: stager.scatter([pages], buffer),
                args.device,
                args.runs,
            )
            row = {
                "tp_size": tp_size,
                "mib": mib,
                "pages": len(pages),
                "gather_ms": round(gather_ms, 3),
                "scatter_ms": round(scatter_ms, 3),
                "gather_gib_s": round(buffer.numel() / gather_ms / 1e6 / 1.073741824, 1),
                "scatter_gib_s": round(buffer.numel() / scatter_ms / 1e6 / 1.073741824, 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tp-sizes", default="1,2")
    parser.add_argument("--mib", default="16,128,512")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kv-gib", type=int, default=4, help="KV cache per rank")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    args.mib = [int(m) for m in args.mib.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        # NOTE: Llama-3.1-8B's KV layout; hidden and MLP kept thin (weights do not matter).
        model = str(
            make_tiny_model(
                scratch,
                "llama",
                hidden_size=256,
                num_layers=32,
                num_heads=8,
                num_kv_heads=8,
                head_dim=128,
                intermediate_size=256,
                dtype="bfloat16",
            )
        )
        rows = [row for size in args.tp_sizes.split(",") for row in measure(model, int(size), args)]
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"\n{device}\n| TP | MiB | gather ms (GiB/s) | scatter ms (GiB/s) |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tp_size']} | {r['mib']} | {r['gather_ms']} ({r['gather_gib_s']}) "
            f"| {r['scatter_ms']} ({r['scatter_gib_s']}) |"
        )
    if args.output:
        args.output.write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
