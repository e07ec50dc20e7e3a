"""Online serving through HTTP beside the engine alone, on the same workload and GPU.

Starts `pdserve serve`, sends `--num-prompts` streaming completions with at most
`--concurrency` in flight (random token prompts, input/output lengths uniform in
[min_len, max_len], EOS ignored), and records throughput, time to first token and the gaps
between streamed chunks. Then runs the same workload through the offline `LLM` with
`max_running_requests = concurrency` and reports its mean step time: the inter-token latency
the engine achieves when nothing else shares its process. Their ratio says whether the HTTP
front end slows the engine.

    python benchmarks/serving.py --preset llama-3.2-1b --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx


def make_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))],
            rng.randint(min_len, max_len),
        )
        for _ in range(n)
    ]


async def one_request(client: httpx.AsyncClient, url: str, prompt, max_tokens, record) -> None:
    # NOTE: logprobs=0 makes every step's token a chunk even when it decodes to no text (the
    # random model's ids mostly lie outside the tiny tokenizer), so gaps are per token.
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,
    }
    start = time.perf_counter()
    stamps, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["logprobs"]:
                stamps.append(time.perf_counter())
    record.append(
        {
            "ttft": stamps[0] - start if stamps else None,
            "gaps": [b - a for a, b in itertools.pairwise(stamps)],
            "tokens": tokens,
            "latency": time.perf_counter() - start,
        }
    )


async def sample_running(client: httpx.AsyncClient, url: str, samples: list[float]) -> None:
    """Poll the server's running-batch size, to see whether it kept the batch full."""
    while True:
        text = (await client.get(url + "/metrics")).text
        for line in text.splitlines():
            if line.startswith("pdserve:num_requests_running{"):
                samples.append(float(line.rsplit(" ", 1)[1]))
        await asyncio.sleep(0.25)


async def drive(url: str, workload, concurrency: int) -> tuple[list[dict], float, list]:
    record: list[dict] = []
    running: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def guarded(prompt, max_tokens):
            async with gate:
                await one_request(client, url, prompt, max_tokens, record)

        sampler = asyncio.create_task(sample_running(client, url, running))
        start = time.perf_counter()
        await asyncio.gather(*(guarded(p, n) for p, n in workload))
        elapsed = time.perf_counter() - start
        sampler.cancel()
        return record, elapsed, running


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def stream_summary(record, elapsed: float, workload) -> dict:
    """Throughput, time to first token and inter-token latency of one `drive`."""
    gaps = [g for r in record for g in r["gaps"]]
    ttfts = [r["ttft"] for r in record if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in record)
    assert tokens == sum(n for _, n in workload), "server produced the wrong token count"
    return {
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "ttft_median_ms": round(statistics.median(ttfts) * 1e3, 1),
        "ttft_p99_ms": round(percentile(ttfts, 0.99) * 1e3, 1),
        "itl_median_ms": round(statistics.median(gaps) * 1e3, 2),
        "itl_p99_ms": round(percentile(gaps, 0.99) * 1e3, 2),
    }


def _engine_counters(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]


def run_http(model_path: str, workload, args) -> dict:
    from pdserve.server.local_process import LocalServer

    server = LocalServer(
        [
            "serve",
            "--model-path",
            model_path,
            "--max-running-requests",
            str(args.concurrency),
            "--max-model-len",
            str(2 * args.max_len + 1),
        ]
    )
    url = server.url
    try:
        server.wait_healthy(deadline_s=600)
        asyncio.run(drive(url, workload[: args.concurrency // 4 or 1], args.concurrency))
        before = _engine_counters(url)
        record, elapsed, running = asyncio.run(drive(url, workload, args.concurrency))
        after = _engine_counters(url)
    finally:
        server.stop(timeout_s=60)
    return {
        "engine": "pdserve serve (HTTP, streaming)",
        **stream_summary(record, elapsed, workload),
        "mean_running_batch": round(statistics.mean(running), 1) if running else None,
        "engine_mean_step_ms": round(
            (after["step_seconds"] - before["step_seconds"])
            / max(after["num_steps"] - before["num_steps"], 1)
            * 1e3,
            2,
        ),
        "engine_steps": after["num_steps"] - before["num_steps"],
    }


def run_offline(model_path: str, workload, args) -> dict:
    import torch

    from pdserve import LLM, SamplingParams

    llm = LLM(model_path, max_model_len=2 * args.max_len + 1, max_running_requests=args.concurrency)
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for _, n in workload]
    llm.generate([p for p, _ in workload[:4]], params[:4], use_tqdm=False)
    engine = llm.engine
    steps = 0
    original = engine.step

    def counted():
        nonlocal steps
        steps += 1
        return original()

    engine.step = counted
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    start = time.perf_counter()
    llm.generate([p for p, _ in workload], params, use_tqdm=False)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    elapsed = time.perf_counter() - start
    tokens = sum(n for _, n in workload)
    return {
        "engine": "offline LLM (engine alone)",
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "mean_step_ms": round(elapsed / steps * 1e3, 2),
        "steps": steps,
    }


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model and the streaming workload, shared with disagg_serving.py."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path")
    source.add_argument("--preset")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output")


def model_and_workload(args, scratch: Path):
    """The model directory (a random one written to `scratch` for --preset) and the
    workload for its vocabulary."""
    model_path = args.model_path
    if model_path is None:
        from pdserve.engine.random_model import make_random_model

        model_path = str(make_random_model(scratch / args.preset, args.preset))
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    workload = make_workload(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    return model_path, workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_path, workload = model_and_workload(args, Path(scratch))
        results = [run_http(model_path, workload, args)]
        print(json.dumps(results[-1]), flush=True)
        results.append(run_offline(model_path, workload, args))
        print(json.dumps(results[-1]), flush=True)
    report = {
        "model": args.preset or args.model_path,
        "num_prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "lengths": [args.min_len, args.max_len],
        "results": results,
        "http_over_offline_throughput": round(
            results[0]["output_tokens_per_s"] / results[1]["output_tokens_per_s"], 3
        ),
        "http_itl_median_over_offline_step": round(
            results[0]["itl_median_ms"] / results[1]["mean_step_ms"], 3
        ),
    }
    print(json.dumps(report, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
