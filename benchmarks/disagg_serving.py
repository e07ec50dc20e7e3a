"""Disaggregated serving beside colocated serving, on the same workload and machine.

Colocated: one `pdserve serve` on cuda:0. Disaggregated: `pdserve prefill` on cuda:0,
`pdserve decode` on cuda:1 (nccl or tcp transfer) and `pdserve router` in front. Both get the
same streaming completions (random token prompts, lengths uniform in [min_len, max_len], EOS
ignored, at most `--concurrency` in flight); we report throughput, time to first token and
inter-token latency, and their ratios. The disaggregated side uses two GPUs, the colocated
one; the point of the split is decode that prefills never interrupt (steadier ITL) at the
cost of a KV handoff in every TTFT.

    python benchmarks/disagg_serving.py --preset llama-3.2-1b --concurrency 64 \
        --transfer-backends nccl tcp
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from serving import add_workload_args, drive, model_and_workload, stream_summary

from pdserve.server.local_process import LocalServer, free_port


def measure(name: str, url: str, workload, concurrency: int) -> dict:
    drive(url, workload[: concurrency // 4 or 1], concurrency)  # warm-up
    result, _ = drive(url, workload, concurrency)
    return {"deployment": name, **stream_summary(result, workload)}


def engine_args(model_path: str, args) -> list[str]:
    return [
        "--model-path",
        model_path,
        "--max-running-requests",
        str(args.concurrency),
        "--max-model-len",
        str(2 * args.max_len + 1),
        "--gpu-memory-utilization",
        "0.8",
        *(["--kv-cache-memory", str(1 << 30)] if args.prefill_device == "cpu" else []),
    ]


def run_colocated(model_path: str, workload, args) -> dict:
    server = LocalServer(["serve", *engine_args(model_path, args), "--device", args.prefill_device])
    try:
        server.wait_healthy(deadline_s=600)
        return measure(
            f"colocated on {args.prefill_device}", server.url, workload, args.concurrency
        )
    finally:
        server.stop(timeout_s=60)


def run_disaggregated(model_path: str, workload, args, backend: str) -> dict:
    bootstrap = free_port()
    transfer = ["--transfer-backend", backend]
    prefill_args = ["--device", args.prefill_device, *transfer, "--bootstrap-port", str(bootstrap)]
    prefill = LocalServer(["prefill", *engine_args(model_path, args), *prefill_args])
    decode = LocalServer(
        ["decode", *engine_args(model_path, args), "--device", args.decode_device, *transfer]
    )
    servers = [prefill, decode]
    try:
        prefill.wait_healthy(deadline_s=600)
        decode.wait_healthy(deadline_s=600)
        router = LocalServer(
            ["router", "--prefill", prefill.url, str(bootstrap), "--decode", decode.url]
        )
        servers.append(router)
        router.wait_healthy(deadline_s=60)
        name = (
            f"disaggregated ({backend}), prefill on {args.prefill_device} + "
            f"decode on {args.decode_device}"
        )
        return measure(name, router.url, workload, args.concurrency)
    finally:
        for server in reversed(servers):
            server.stop(timeout_s=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument(
        "--transfer-backends", nargs="+", default=["nccl"], choices=["nccl", "tcp", "gloo", "ipc"]
    )
    parser.add_argument("--prefill-device", default="cuda:0", help="also the colocated one's")
    parser.add_argument("--decode-device", default="cuda:1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_path, workload = model_and_workload(args, Path(scratch))
        colocated = run_colocated(model_path, workload, args)
        print(json.dumps(colocated), flush=True)
        split = []
        for backend in args.transfer_backends:
            split.append(run_disaggregated(model_path, workload, args, backend))
            print(json.dumps(split[-1]), flush=True)
    report = {
        "model": args.preset or args.model_path,
        "num_prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "lengths": [args.min_len, args.max_len],
        "results": [colocated, *split],
        "disagg_over_colocated": {
            backend: {
                key: round(result[key] / colocated[key], 3)
                for key in ("output_tokens_per_s", "ttft_median_ms", "itl_median_ms", "itl_p99_ms")
            }
            for backend, result in zip(args.transfer_backends, split, strict=True)
        },
    }
    print(json.dumps(report, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
