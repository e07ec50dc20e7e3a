"""A 64-token greedy generation on CPU, offline (`LLM`) and through a colocated `pdserve
serve` (one chat request), with other processes keeping the machine's cores busy: how much
an engine's torch threads suffer from sharing their cores (`pdserve.engine.runtime.cpu_threads`).

`--load N` starts N busy-looping processes for the run (bounded: they exit with it, and after
`--load-seconds` at the latest). Compare two code versions by running this once with each on
PYTHONPATH; every figure is one timed generation after an untimed warm-up.

    python benchmarks/cpu_threads.py --load 2 --rounds 3 --output $OUT/cpu_threads.json
    pdserve make-tiny-model /tmp/small --hidden-size 512 --num-layers 8 --num-heads 8 \
        --num-kv-heads 4 --intermediate-size 1536
    python benchmarks/cpu_threads.py --model-path /tmp/small --load 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

import httpx
import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.llm import LLM
from pdserve.server.local_process import LocalServer

PROMPT = "Tell me a story about a dragon who learns to cook."
NEW_TOKENS = 64


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def offline_seconds(model: str | None, rounds: int) -> tuple[int, list[float]]:
    llm = LLM(model, device="cpu")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], params, use_tqdm=False)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return torch.get_num_threads(), times


def serve_seconds(model: str | None, rounds: int) -> list[float]:
    model_args = ["--model-path", model] if model else []
    server = LocalServer(["serve", *model_args, "--device", "cpu"]).wait_healthy(300)
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    try:
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600)
            answer.raise_for_status()
            times.append(time.perf_counter() - start)
            tokens = answer.json()["usage"]["completion_tokens"]
            assert tokens == NEW_TOKENS, f"{tokens} tokens generated, not {NEW_TOKENS}"
        return times
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="default: the built-in tiny model")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the run")
    parser.add_argument("--load-seconds", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    load = [
        multiprocessing.Process(target=_busy, args=(args.load_seconds,), daemon=True)
        for _ in range(args.load)
    ]
    for process in load:
        process.start()
    try:
        threads, offline = offline_seconds(args.model_path, args.rounds)
        served = serve_seconds(args.model_path, args.rounds)
    finally:
        for process in load:
            process.terminate()
    result = {
        "cores": len(os.sched_getaffinity(0)),
        "model": args.model_path or "built-in tiny",
        "load_processes": args.load,
        "offline_threads": threads,
        "offline_s": [round(t, 2) for t in offline],
        "serve_s": [round(t, 2) for t in served],
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    print(json.dumps(result))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
