"""CPU time a pdserve worker's processes spend per streamed token: its HTTP front end (one
process serving every stream) and its engine process.

A worker's front end turns each token the engine reports into an SSE event for its stream.
At a small model's decode rates that per-token work, in one Python process, can set the
pace instead of the GPU (see RESULTS.md, "Goodput on the 1B preset"). This starts
`pdserve serve` (the tiny model on CPU by default), streams `--streams` concurrent requests
of `--output-len` tokens through `pdserve bench`, and reads each process's CPU time from
/proc before and after: CPU µs per token, and the tokens/s one front end could carry at most
(1 / its µs per token) on this machine.

    python benchmarks/frontend_cost.py                       # tiny model, CPU, logprobs 0
    python benchmarks/frontend_cost.py --logprobs none
    python benchmarks/frontend_cost.py --stream-interval 4  # the worker's flag
    python benchmarks/frontend_cost.py --model-path M --device cuda:0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.server.local_process import LocalServer, engine_pid_of
from pdserve.synthetic.tiny_model import make_tiny_model


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="default: the tiny model, written to a temp dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=300)
    parser.add_argument("--logprobs", default="0", help="N, or none")
    parser.add_argument("--stream-interval", type=int, default=1, help="the worker's flag")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model_path or str(make_tiny_model(Path(scratch) / "tiny", "llama"))
        worker = ["serve", "--model-path", model, "--device", args.device, "--max-model-len", "512"]
        worker += ["--stream-interval", str(args.stream_interval)]
        server = LocalServer([*worker, "--max-running-requests", str(args.streams)])
        try:
            url = server.wait_healthy(600).url
            pids = {"front_end": server.process.pid, "engine": engine_pid_of(server.process.pid)}
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            result = Path(scratch) / "bench.json"
            command = [
                *(sys.executable, "-m", "pdserve.cli", "bench", "--base-url", url),
                *("--num-prompts", str(args.requests), "--concurrency", str(args.streams)),
                *("--input-len", "16", "--output-len", str(args.output_len)),
                *("--disable-tqdm", "--result-json", str(result)),
            ]
            if args.logprobs != "none":
                command += ["--logprobs", args.logprobs]
            started = time.monotonic()
            subprocess.run(command, check=True, capture_output=True, timeout=1800)
            wall = time.monotonic() - started
            used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        finally:
            server.stop()
        summary = json.loads(result.read_text())["runs"][0]["summary"]
    tokens = summary["output_tokens"]
    report = {
        "device": args.device,
        "logprobs": args.logprobs,
        "stream_interval": args.stream_interval,
        "streams": args.streams,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(summary["output_throughput"]),
        **{f"{name}_cpu_us_per_token": round(s / tokens * 1e6, 1) for name, s in used.items()},
        "front_end_ceiling_tokens_per_s": round(tokens / max(used["front_end"], 1e-9)),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
