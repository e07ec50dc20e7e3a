"""Speculative vs plain decoding at batch 1, in one run on one machine.

A random-weight target gets an EAGLE-3 head trained by `pdserve train-eagle` on its own
generations (or `--draft DIR`): a real config (`--preset llama-3.2-1b`), or a small random
model of the tiny tokenizer's vocabulary (`--tiny HIDDENxLAYERSxINIT_STDxRESIDUAL_SCALE`; a
small residual scale makes each token mostly decide the next, so the target's own text is
learnable, which a normally initialized random network's is not). Then the same prompts run
one at a time (batch 1, greedy, EOS ignored) through the plain engine and through each
speculative setting; tokens/s counts output tokens over wall time, and the mean acceptance
length is tokens per verify step (the first token comes from the prefill, not a verify step).
In float32, greedy speculative output equals plain output token for token (the GPU tests check
that); in bfloat16 verification runs other kernels than one-token decoding, so a near tie can
flip late in a sequence: the report gives the tokens agreeing with plain before the first
difference.

    python benchmarks/speculative.py --tiny 512x16x0.05x0.001 --out results.json
    python benchmarks/speculative.py --preset llama-3.2-1b --out results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(model_path: str, settings, prompts, args) -> dict:
    from pdserve import LLM, SamplingParams

    llm = LLM(
        model_path,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        kv_cache_memory=args.kv_cache_gib << 30,
        speculative=settings,
    )
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    outputs, seconds = [], 0.0
    for prompt in prompts:
        _sync()
        start = time.perf_counter()
        outputs.extend(llm.generate([prompt], params, use_tqdm=False))
        _sync()
        seconds += time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    verify = sum(o.spec_verify_ct for o in outputs)
    emitted = sum(o.spec_emitted_tokens for o in outputs)
    del llm
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "tokens": tokens,
        "accept_length": emitted / verify if verify else None,
        "token_ids": [o.token_ids for o in outputs],
    }


def _agreeing(result: dict, plain: dict) -> float:
    """Fraction of plain's tokens matched before each sequence's first difference."""
    same = 0
    for ours, theirs in zip(result["token_ids"], plain["token_ids"], strict=True):
        for a, b in zip(ours, theirs, strict=False):
            if a != b:
                break
            same += 1
    return same / max(1, sum(len(t) for t in plain["token_ids"]))


def _tiny_target(path: Path, spec: str) -> Path:
    from pdserve.engine.tiny_model import make_tiny_model

    hidden, layers, std, scale = spec.split("x")
    heads = max(4, int(hidden) // 64)
    return make_tiny_model(
        path,
        "llama",
        hidden_size=int(hidden),
        num_layers=int(layers),
        num_heads=heads,
        num_kv_heads=max(1, heads // 4),
        intermediate_size=4 * int(hidden),
        init_std=float(std),
        residual_scale=float(scale),
        dtype="bfloat16",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--model-path", default=None, help="a target (default: random preset)")
    parser.add_argument("--tiny", default=None, help="HIDDENxLAYERSxINIT_STDxRESIDUAL_SCALE")
    parser.add_argument("--draft", default=None, help="an EAGLE-3 draft (default: train one)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--train-sequences", type=int, default=512)
    parser.add_argument("--train-steps", type=int, default=2000)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from pdserve.engine.random_model import make_random_model
    from pdserve.protocol.spec_settings import SpecSettings
    from pdserve.speculative.train_eagle import TrainConfig, train_eagle

    work = Path(tempfile.mkdtemp(prefix="pdserve-spec-"))
    if args.tiny:
        model_path = str(_tiny_target(work / "target", args.tiny))
        target_name = f"tiny random {args.tiny}"
    else:
        model_path = args.model_path or str(make_random_model(work / "target", args.preset))
        target_name = args.model_path or f"random {args.preset}"
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    draft = args.draft
    if draft is None:
        started = time.perf_counter()
        trained = train_eagle(
            TrainConfig(
                model_path=model_path,
                out_dir=str(work / "eagle3"),
                num_sequences=args.train_sequences,
                steps=args.train_steps,
                dtype=args.dtype,
            )
        )
        draft = str(trained.out_dir)
        report["train"] = {
            "seconds_total": time.perf_counter() - started,
            "seconds_optimizer": trained.train_seconds,
            "final_loss": trained.final_loss,
            "held_out_accuracy_per_step": trained.eval_accuracy,
        }
    generator = torch.Generator().manual_seed(12345)
    prompts = torch.randint(3, 1000, (args.num_prompts, args.prompt_len), generator=generator)
    prompts = prompts.tolist()
    configs = {
        "plain": None,
        "EAGLE3 chain (topk 1, 4 steps)": SpecSettings("EAGLE3", draft, 4, 1, 5),
        "EAGLE3 tree (topk 4, 4 steps, 8 tokens)": SpecSettings("EAGLE3", draft, 4, 4, 8),
        "NGRAM chain (4 steps)": SpecSettings("NGRAM", None, 4, 1, 5),
    }
    results = {name: measure(model_path, s, prompts, args) for name, s in configs.items()}
    plain = results["plain"]
    rows = []
    for name, result in results.items():
        exact = result["token_ids"] == plain["token_ids"]
        rows.append(
            {
                "config": name,
                "tokens_per_s": round(result["tokens_per_s"], 1),
                "speedup_vs_plain": round(result["tokens_per_s"] / plain["tokens_per_s"], 3),
                "accept_length": None
                if result["accept_length"] is None
                else round(result["accept_length"], 3),
                "identical_to_plain": exact,
                "agreeing_prefix_fraction": round(_agreeing(result, plain), 3),
            }
        )
    report["batch1"] = rows
    report["workload"] = {
        "prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "target": target_name,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
