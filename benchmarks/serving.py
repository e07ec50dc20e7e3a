"""Online serving through HTTP beside the engine alone, on the same workload and GPU.

Starts `pdserve serve`, sends `--num-prompts` streaming completions with at most
`--concurrency` in flight through pdserve.bench (its random workload: token prompts,
input/output lengths uniform in [min_len, max_len], EOS ignored), and records throughput,
time to first token and the gaps between streamed chunks (one per token: logprobs are on).
Then runs the same workload through the offline `LLM` with `max_running_requests =
concurrency` and reports its mean step time: the inter-token latency the engine achieves when
nothing else shares its process. Their ratio says whether the HTTP
front end slows the engine.

    python benchmarks/serving.py --preset llama-3.2-1b --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench.client import BenchClient, ClientSettings, served_models
from pdserve.bench.metrics import SLO, summarize
from pdserve.bench.runner import Load, RunResult, run_load
from pdserve.bench.workloads import Conversation, LengthRange, WorkloadSpec, build_workload


def make_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[Conversation]:
    """`n` random token prompts (ids in [0, vocab)), input and output lengths uniform in
    [min_len, max_len]: pdserve.bench's random workload."""
    lengths = LengthRange(min_len, max_len)
    spec = WorkloadSpec("random", False, lengths, lengths, token_id_min=0, token_id_max=vocab)
    return build_workload(spec, n, seed)


async def sample_running(client: httpx.AsyncClient, url: str, samples: list[float]) -> None:
    """Poll the server's running-batch size, to see whether it kept the batch full."""
    while True:
        text = (await client.get(url + "/metrics")).text
        for line in text.splitlines():
            if line.startswith("pdserve:num_requests_running{"):
                samples.append(float(line.rsplit(" ", 1)[1]))
        await asyncio.sleep(0.25)


def drive(url: str, workload: list[Conversation], concurrency: int) -> tuple[RunResult, list]:
    """Stream every request of `workload` through pdserve.bench, at most `concurrency` in
    flight, sampling the server's running batch meanwhile."""
    # NOTE: logprobs=0 makes every step's token a chunk even when it decodes to no text (the
    # random model's ids mostly lie outside the tiny tokenizer), so gaps are per token.
    settings = ClientSettings(url, served_models(url, None)[0], logprobs=0)
    return asyncio.run(_drive(settings, workload, concurrency))


async def _drive(settings: ClientSettings, workload, concurrency: int):
    client = BenchClient(settings, max_connections=concurrency)
    running: list[float] = []
    async with httpx.AsyncClient(timeout=30) as poller:
        sampler = asyncio.create_task(sample_running(poller, settings.base_url, running))
        try:
            result = await run_load(client, workload, Load(math.inf, concurrency))
        finally:
            sampler.cancel()
            await client.aclose()
    return result, running


def stream_summary(result: RunResult, workload: list[Conversation]) -> dict:
    """Throughput, time to first token and inter-token latency of one `drive`
    (pdserve.bench.metrics: percentiles interpolate between closest ranks)."""
    summary = summarize(result.records, result.duration_s, SLO())
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors'][0]['error']}")
    expected = sum(turn.max_tokens for c in workload for turn in c.turns)
    assert summary["output_tokens"] == expected, "server produced the wrong token count"
    return {
        "seconds": round(result.duration_s, 2),
        "output_tokens_per_s": round(summary["output_throughput"], 1),
        "ttft_median_ms": round(summary["ttft_ms"]["median"], 1),
        "ttft_p99_ms": round(summary["ttft_ms"]["p99"], 1),
        "itl_median_ms": round(summary["itl_ms"]["median"], 2),
        "itl_p99_ms": round(summary["itl_ms"]["p99"], 2),
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
        drive(url, workload[: args.concurrency // 4 or 1], args.concurrency)
        before = _engine_counters(url)
        result, running = drive(url, workload, args.concurrency)
        after = _engine_counters(url)
    finally:
        server.stop(timeout_s=60)
    return {
        "engine": "pdserve serve (HTTP, streaming)",
        **stream_summary(result, workload),
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
    turns = [conversation.turns[0] for conversation in workload]
    prompts = [list(turn.prompt) for turn in turns]
    params = [
        SamplingParams(max_new_tokens=turn.max_tokens, temperature=0, ignore_eos=True)
        for turn in turns
    ]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
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
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    elapsed = time.perf_counter() - start
    tokens = sum(turn.max_tokens for turn in turns)
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
        from pdserve.synthetic.random_model import make_random_model

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
