"""Prefix caching on multi-turn chat: the cache off and on, round robin and cache-aware routing.

Workload (`pdserve bench --workload multi-turn`, chat, streamed): --conversations
conversations of --turns turns, all at once; every system prompt starts with the same
--shared-words words (a shared system prompt), then --own-words of the conversation's own;
each user turn adds U[--turn-words] words, each answer U[--output-len] tokens (EOS ignored).
Turn n + 1's messages are turn n's plus the answer it got plus a new user message, so a
worker that kept turn n's KV computes only what is new.

Deployments, one after the other on this machine (each worker's memory is a share of the GPU):
- `single-off`: one `pdserve serve --disable-prefix-caching`;
- `single-on`: one `pdserve serve` (prefix caching on, the default);
- `replicas-rr`: two `pdserve serve` behind `pdserve router --policy round_robin`;
- `replicas-cache-aware`: the same behind `pdserve router --policy cache_aware`;
- `pd-off`: `pdserve prefill` + `pdserve decode` (tcp transfer, same GPU) behind `pdserve
  router`, both with `--disable-prefix-caching`;
- `pd-on`: the same with prefix caching on: prefill reuses its cache, and the decode worker,
  which holds the previous turn of a conversation it decoded, receives only the pages after
  what it holds.

Per deployment: TTFT (median, P99), prompt tokens sent, the ones the workers took from their
caches (usage.prompt_tokens_details.cached_tokens) and so the ones computed, throughput, and
the workers' own mean TTFT (their /metrics: from a request's arrival at the worker). PD rows
add the KV bytes the decode worker received and skipped (its /server_info), beside the KV of
the turns' new tokens: a turn's prompt less the previous turn's prompt and answer (a first
turn's whole prompt), at the model's KV bytes per token.

    python benchmarks/multiturn.py --preset llama-3.2-1b --out multiturn.json
    python benchmarks/multiturn.py --smoke   # the tiny model on CPU, a minute
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.server.local_process import LocalServer, free_port

START_S = 600.0
BENCH_S = 3600.0  # one deployment's whole benchmark run
DEPLOYMENTS = ("single-off", "single-on", "replicas-rr", "replicas-cache-aware", "pd-off", "pd-on")
WORKLOAD_FIELDS = (
    "max_concurrency",
    "conversations",
    "turns",
    "shared_words",
    "own_words",
    "turn_words",
    "output_len",
)


def _serve(model: str, args, extra: list[str], share: float, logs: Path, name: str, role="serve"):
    flags = [role, "--model-path", model, "--device", args.device, *extra]
    if args.device != "cpu":
        flags += ["--gpu-memory-utilization", f"{share:.3f}"]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    return LocalServer(flags, log_path=str(logs / f"{name}.log"))


def _start(name: str, model: str, args, logs: Path) -> tuple[list[LocalServer], LocalServer]:
    """The deployment's workers and the process clients talk to (a router in front of
    several workers, else the worker), all healthy; what started is stopped on a failure."""
    share = args.gpu_share
    off = ["--disable-prefix-caching"] if name.endswith("-off") else []
    if name.startswith("single"):
        workers = [_serve(model, args, off, share, logs, name)]
    elif name.startswith("pd"):
        boot = free_port()
        transfer = ["--transfer-backend", "tcp"]
        prefill = [*off, *transfer, "--bootstrap-port", str(boot)]
        workers = [
            _serve(model, args, prefill, share / 2, logs, f"{name}-prefill", "prefill"),
            _serve(model, args, [*off, *transfer], share / 2, logs, f"{name}-decode", "decode"),
        ]
    else:
        workers = [_serve(model, args, [], share / 2, logs, f"{name}-{i}") for i in range(2)]
    started = list(workers)
    try:
        for worker in workers:
            worker.wait_healthy(START_S)
        if len(workers) == 1:
            return workers, workers[0]
        if name.startswith("pd"):
            prefill, decode = workers
            route = ["--prefill", prefill.url, str(boot), "--decode", decode.url]
        else:
            policy = "cache_aware" if name == "replicas-cache-aware" else "round_robin"
            route = ["--worker-urls", *[w.url for w in workers], "--policy", policy]
        router = LocalServer(["router", *route], log_path=str(logs / f"{name}-router.log"))
        started.append(router)
        return workers, router.wait_healthy(START_S)
    except BaseException:
        _stop(started)
        raise


def _stop(processes: list[LocalServer]) -> None:
    """Front first, then the workers."""
    for process in reversed(processes):
        process.stop()


def _bench(url: str, args, out: Path) -> dict:
    command = [
        sys.executable, "-m", "pdserve.cli", "bench", "--base-url", url,
        "--workload", "multi-turn", "--endpoint", "chat",
        "--num-prompts", str(args.conversations), "--num-turns", str(args.turns),
        "--shared-prefix-len", str(args.shared_words), "--system-prompt-len", str(args.own_words),
        "--input-len", args.turn_words, "--output-len", args.output_len,
        "--warmup-requests", "0", "--disable-tqdm", "--result-json", str(out),
        # NOTE: a chunk per token, text or not: random weights sample many ids the tiny
        # tokenizer decodes to nothing, and a first chunk of text would come tokens late.
        "--logprobs", "0",
    ]  # fmt: skip
    if args.max_concurrency:
        command += ["--max-concurrency", str(args.max_concurrency)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=BENCH_S)
    return json.loads(out.read_text())


def _server_ttft_ms(workers: list[LocalServer]) -> float | None:
    """The workers' own mean TTFT (from a request's arrival at the worker to its first
    token, `pdserve:time_to_first_token_seconds`): beside the client's, it tells the time
    spent in the worker from the time spent on the way."""
    total = count = 0.0
    for worker in workers:
        for line in httpx.get(worker.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("pdserve:time_to_first_token_seconds_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("pdserve:time_to_first_token_seconds_count"):
                count += float(line.rsplit(" ", 1)[1])
    return 1e3 * total / count if count else None


def _transfer_counters(decode: LocalServer) -> dict:
    """A PD deployment's decode worker's KV bytes received and skipped (its /server_info)."""
    info = httpx.get(decode.url + "/server_info", timeout=10).json()
    counters = info["internal_states"][0]
    found = {key: counters[key] for key in ("bytes_received", "bytes_skipped")}
    return found | {"element_bytes": 4 if "float32" in info["dtype"] else 2}


def _new_tokens(requests: list[dict]) -> int:
    """Prompt tokens new in each turn: its prompt less the previous turn's prompt and answer
    (a first turn: its whole prompt)."""
    by_turn = {(r["conversation"], r["turn"]): r for r in requests if r["success"]}
    new = 0
    for (conversation, turn), request in by_turn.items():
        previous = by_turn.get((conversation, turn - 1))
        held = previous["prompt_tokens"] + previous["output_tokens"] if previous else 0
        new += max(request["prompt_tokens"] - held, 0)
    return new


def kv_bytes_per_token(model: str, element_bytes: int) -> int:
    """K and V of every layer for one token."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head_dim * element_bytes


def _row(name, result, seconds, worker_ttft_ms, transfer, model) -> dict:
    run = result["runs"][0]
    summary, ttft = run["summary"], run["summary"]["ttft_ms"]
    later = sorted(r["ttft_s"] for r in run["requests"] if r["success"] and r["turn"] > 0)
    row = {
        "deployment": name,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "ttft_median_ms": ttft.get("median"),
        "ttft_p99_ms": ttft.get("p99"),
        # turns after the first: the ones whose conversation's earlier KV can be cached
        "later_turns_ttft_median_ms": 1e3 * later[len(later) // 2] if later else None,
        "input_tokens": summary["input_tokens"],
        "cached_input_tokens": summary["cached_input_tokens"],
        "computed_input_tokens": summary["computed_input_tokens"],
        "output_throughput": summary["output_throughput"],
        "duration_s": summary["duration_s"],
        "elapsed_s": seconds,
        "worker_ttft_mean_ms": worker_ttft_ms,
    }
    if transfer is not None:
        bytes_per_token = kv_bytes_per_token(model, transfer["element_bytes"])
        new_kv = _new_tokens(run["requests"]) * bytes_per_token
        row |= {
            "kv_bytes_received": transfer["bytes_received"],
            "kv_bytes_skipped": transfer["bytes_skipped"],
            "new_tokens_kv_bytes": new_kv,
            "received_over_new_tokens_kv": transfer["bytes_received"] / new_kv,
            "prompt_kv_bytes": summary["input_tokens"] * bytes_per_token,
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--preset", default="llama-3.2-1b", help="random weights, real config")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU, a small workload")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=DEPLOYMENTS)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--shared-words", type=int, default=1000)
    parser.add_argument("--own-words", type=int, default=24)
    parser.add_argument("--turn-words", default="100:300")
    parser.add_argument("--output-len", default="128:256")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--gpu-share", type=float, default=0.8, help="of GPU memory, all workers")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="pdserve-multiturn-"))
    if args.smoke:
        from pdserve.synthetic.tiny_model import default_model_dir

        model = str(default_model_dir())
        args.device, args.conversations, args.turns = "cpu", 4, 3
        args.shared_words, args.turn_words, args.output_len = 40, "8:16", "4:8"
        args.max_model_len = 1024
    elif args.model_path:
        model = args.model_path
    else:
        from pdserve.synthetic.random_model import make_random_model

        model = str(make_random_model(scratch / "model", args.preset))
    logs = scratch / "logs"
    logs.mkdir()
    rows = []
    for name in args.deployments:
        started = time.perf_counter()
        workers, front = _start(name, model, args, logs)
        try:
            result = _bench(front.url, args, scratch / f"{name}.json")
            worker_ttft = _server_ttft_ms(workers)
            # NOTE: a PD deployment's workers are [prefill, decode] (_start).
            transfer = _transfer_counters(workers[1]) if name.startswith("pd") else None
        finally:
            _stop(workers if front in workers else [*workers, front])
        seconds = time.perf_counter() - started
        rows.append(_row(name, result, seconds, worker_ttft, transfer, model))
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "model": args.model_path or ("tiny" if args.smoke else f"random {args.preset}"),
        "workload": {k: getattr(args, k) for k in WORKLOAD_FIELDS},
        "results": rows,
        "logs": str(logs),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
