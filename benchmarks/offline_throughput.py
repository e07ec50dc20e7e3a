"""Offline generation throughput: pdserve's `LLM.generate` beside transformers' `generate`.

Workload (seeded): N prompts of random token ids, input and output lengths uniform in
[min_len, max_len]; every request generates exactly its output length (EOS ignored).
Output tokens/s counts only the requested output tokens. transformers runs batches of
`--hf-batch-size` prompts sorted by output length (left padding, greedy); the tokens it
generates past a request's own length are work it cannot avoid, not counted as output.

    python benchmarks/offline_throughput.py --preset llama-3.2-1b            # both engines
    python benchmarks/offline_throughput.py --model-path DIR --backends pdserve
    python benchmarks/offline_throughput.py --preset llama-3.2-1b \
        --backends pdserve,pdserve:torch,transformers    # also pdserve on torch attention

`pdserve:NAME` runs pdserve with `--attention-backend NAME` (plain `pdserve`: auto).
"""

from __future__ import annotations

import argparse
import json
import random
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


def make_workload(num_prompts: int, min_len: int, max_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    workload = []
    for _ in range(num_prompts):
        prompt_len, output_len = rng.randint(min_len, max_len), rng.randint(min_len, max_len)
        workload.append(([rng.randrange(vocab) for _ in range(prompt_len)], output_len))
    return workload


def run_pdserve(model_path: str, workload, args, attention_backend: str = "auto") -> dict:
    from pdserve import LLM, SamplingParams

    llm = LLM(
        model_path,
        attention_backend=attention_backend,
        dtype=args.dtype,
        max_model_len=2 * args.max_len + 1,
        max_running_requests=args.max_running_requests,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for _, n in workload]
    llm.generate([p for p, _ in workload[:4]], params[:4], use_tqdm=False)  # warm-up
    sync()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    assert produced == sum(n for _, n in workload), "pdserve produced the wrong token count"
    name = "pdserve" if attention_backend == "auto" else f"pdserve:{attention_backend}"
    return _result(
        name,
        workload,
        elapsed,
        kv_pages=llm.engine.kv_pool.num_pages,
        attention=type(llm.engine.attention_backend).__name__,
    )


def run_transformers(model_path: str, workload, args) -> dict:
    model = load_transformers_model(model_path, args.dtype)
    device = model.device
    order = sorted(range(len(workload)), key=lambda i: workload[i][1])
    batches = [order[i : i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]

    def generate(batch):
        prompts = [workload[i][0] for i in batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        new = max(workload[i][1] for i in batch)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )

    generate(batches[0][:2])  # warm-up
    sync()
    start = time.perf_counter()
    for batch in batches:
        generate(batch)
    sync()
    return _result(
        "transformers", workload, time.perf_counter() - start, batch_size=args.hf_batch_size
    )


def _result(name: str, workload, elapsed: float, **extra) -> dict:
    output_tokens = sum(n for _, n in workload)
    input_tokens = sum(len(p) for p, _ in workload)
    return {
        "engine": name,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "total_tokens_per_s": round((input_tokens + output_tokens) / elapsed, 1),
        "requests_per_s": round(len(workload) / elapsed, 3),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--backends", default="pdserve,transformers")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        model_path = model_directory(args, scratch)
        config = json.loads((Path(model_path) / "config.json").read_text())
        workload = make_workload(
            args.num_prompts, args.min_len, args.max_len, config["vocab_size"], args.seed
        )
        report = {
            "model": args.preset or model_path,
            "device": device_name(),
            "num_prompts": args.num_prompts,
            "lengths": [args.min_len, args.max_len],
            "results": [],
        }
        for name in args.backends.split(","):
            engine, attention = split_backend(name)
            if name == "transformers":
                result = run_transformers(model_path, workload, args)
            elif engine == "pdserve":
                result = run_pdserve(model_path, workload, args, attention)
            else:
                parser.error(f"unknown backend {name!r}: pdserve, pdserve:NAME or transformers")
            report["results"].append(result)
            print(json.dumps(report["results"][-1]), flush=True)
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    results = {r["engine"]: r for r in report["results"]}
    if "transformers" in results:
        baseline = results["transformers"]["output_tokens_per_s"]
        for name, result in results.items():
            if name != "transformers":
                report[f"{name}_over_transformers"] = round(
                    result["output_tokens_per_s"] / baseline, 2
                )
    print(json.dumps(report, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
