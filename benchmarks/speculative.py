"""Speculative vs plain decoding, in one run on one machine: acceptance and speedup.

Targets:
- a real model (`--model-path`: a directory, a .gguf file or a hub id). Its EAGLE-3 head is
  trained by `pdserve train-eagle` on the target's own greedy answers to the *training* chat
  prompts of `real_text_prompts.py` (or given with `--draft`); it is measured on
  `--prompts`: `chat` (held-out chat prompts: topics and phrasings never trained on) and/or
  `repetition` (answers that repeat their context: code edits, passage summaries, where
  NGRAM has matches). Answers end at EOS or `--max-tokens`.
- a random-weight target (`--preset`, or `--tiny HIDDENxLAYERSxINIT_STDxRESIDUAL_SCALE`: a
  small residual scale makes each token mostly decide the next, so the target's own text is
  learnable, which a normally initialized random network's is not), on random prompts with
  EOS ignored; its head is trained on random prompts.

Every setting runs the same prompts greedily, in groups of each `--batch-sizes`, in each of
`--deployments`: `colocated` (the engine in this process; a group is one `generate` call)
and `disaggregated` (prefill and decode workers sharing this GPU, KV over tcp, `pdserve
router` in front; a group is that many concurrent /generate requests). tokens/s = output
tokens / wall time; acceptance length = tokens per verify step (SGLang's spec_accept_length:
the bonus token included, so a chain of 4 drafts gives at most 5). In float32 greedy
speculative output equals plain output token for token; in bfloat16 verification runs other
kernels than one-token decoding, so a near tie can flip late in a sequence: the report gives
the fraction of plain's tokens matched before each sequence's first difference.

    python benchmarks/speculative.py --model-path SmolLM2-135M-Instruct.Q4_1.gguf \
        --deployments colocated disaggregated --out results.json
    python benchmarks/speculative.py --tiny 512x16x0.05x0.001 --out results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_text_prompts import chat_prompts, repetition_prompts, write_jsonl

PD_START_S = 600.0
# A real target's head: more sequences per step, and a draft vocabulary that covers nearly
# every answer token (99.8% for SmolLM2's answers at 16,384).
REAL_TRAINING = {"batch_size": 32, "draft_vocab_size": 16384}
CONFIG_NAMES = {
    "plain": "plain",
    "eagle3-chain": "EAGLE3 chain (topk 1, 4 steps)",
    "eagle3-tree": "EAGLE3 tree (topk 4, 4 steps, 8 tokens)",
    "ngram-chain": "NGRAM chain (4 steps)",
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _groups(prompts: list, size: int) -> list[list]:
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def _summary(outputs: list[dict], seconds: float) -> dict:
    tokens = sum(len(o["token_ids"]) for o in outputs)
    verify = sum(o["verify_steps"] for o in outputs)
    emitted = sum(o["emitted"] for o in outputs)
    return {
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "tokens": tokens,
        "accept_length": emitted / verify if verify else None,
        "token_ids": [o["token_ids"] for o in outputs],
    }


def measure_colocated(model_path, settings, prompt_sets, args) -> dict:
    """{(prompt set, batch size): summary}, one engine in this process for all of them."""
    from pdserve import LLM, SamplingParams

    llm = LLM(
        model_path,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_gib << 30,
        speculative=settings,
    )
    params = SamplingParams(
        max_new_tokens=args.max_tokens, temperature=0, ignore_eos=args.ignore_eos
    )
    results = {}
    for name, prompts in prompt_sets.items():
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        for batch in args.batch_sizes:
            outputs, seconds = [], 0.0
            for group in _groups(prompts, batch):
                _sync()
                start = time.perf_counter()
                done = llm.generate(group, params, use_tqdm=False)
                _sync()
                seconds += time.perf_counter() - start
                outputs += [
                    {
                        "token_ids": o.token_ids,
                        "verify_steps": o.spec_verify_ct,
                        "emitted": o.spec_emitted_tokens,
                    }
                    for o in done
                ]
            results[name, batch] = _summary(outputs, seconds)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def measure_pd(model_path, settings, prompt_sets, args, log_dir: Path) -> dict:
    """As measure_colocated, through prefill + decode workers on this GPU behind the router;
    a group of B prompts is B concurrent /generate requests."""
    from pd_goodput_deploy import DeploymentSpec, deploy

    from pdserve.protocol.flags import to_argv

    engine_args = [
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--gpu-memory-utilization",
        "0.4",  # two workers share the GPU
        *(to_argv(settings) if settings is not None else []),
    ]
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    spec = DeploymentSpec(
        model_path=model_path,
        devices=(device, device),
        transfer_backend="tcp",
        engine_args=tuple(engine_args),
        log_dir=log_dir,
        start_timeout_s=PD_START_S,
    )
    sampling = {
        "temperature": 0,
        "max_new_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
    }
    results = {}
    with deploy("disaggregated", spec) as deployment, httpx.Client(timeout=600) as client:

        def one(prompt: list[int]) -> dict:
            body = {"input_ids": prompt, "sampling_params": sampling}
            response = client.post(deployment.url + "/generate", json=body)
            response.raise_for_status()
            answer = response.json()
            meta = answer["meta_info"]
            verify = meta.get("spec_verify_ct", 0)
            return {
                "token_ids": answer["output_ids"],
                "verify_steps": verify,
                "emitted": round(meta.get("spec_accept_length", 0) * verify),
            }

        with ThreadPoolExecutor(max(args.batch_sizes)) as pool:
            for name, prompts in prompt_sets.items():
                one(prompts[0])  # warm-up
                for batch in args.batch_sizes:
                    outputs = []
                    start = time.perf_counter()
                    for group in _groups(prompts, batch):
                        outputs += list(pool.map(one, group))
                    results[name, batch] = _summary(outputs, time.perf_counter() - start)
    return results


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
    from pdserve.synthetic.tiny_model import make_tiny_model

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


def _prompt_sets(args, tokenizer) -> dict[str, list[list[int]]]:
    if not args.real:
        generator = torch.Generator().manual_seed(12345)
        prompts = torch.randint(3, 1000, (args.num_prompts, 16), generator=generator)
        return {"random": prompts.tolist()}
    from pdserve.speculative.training.train_eagle import read_prompts_file

    sets = {}
    for name in args.prompts:
        records = chat_prompts("held_out") if name == "chat" else repetition_prompts()
        path = write_jsonl(args.work / f"{name}.jsonl", records[: args.num_prompts])
        sets[name] = read_prompts_file(path, tokenizer)
    return sets


def _train_draft(model_path: str, args, report: dict) -> str:
    from pdserve.speculative.training.train_eagle import TrainConfig, train_eagle

    prompts_file = None
    if args.real:
        prompts_file = str(write_jsonl(args.work / "chat_train.jsonl", chat_prompts("train")))
    started = time.perf_counter()
    trained = train_eagle(
        TrainConfig(
            model_path=model_path,
            out_dir=str(args.work / "eagle3"),
            prompts_file=prompts_file,
            num_sequences=args.train_sequences,
            gen_len=args.train_gen_len,
            steps=args.train_steps,
            **(REAL_TRAINING if args.real else {}),
            dtype=args.dtype,
        )
    )
    report["train"] = {
        "prompts": "chat_train (real_text_prompts.py)" if args.real else "random tokens",
        "sequences": args.train_sequences,
        "steps": args.train_steps,
        "seconds_total": time.perf_counter() - started,
        "seconds_optimizer": trained.train_seconds,
        "final_loss": trained.final_loss,
        "held_out_accuracy_per_step": trained.eval_accuracy,
    }
    return str(trained.out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--model-path", default=None, help="a real target (dir, .gguf, hub id)")
    parser.add_argument("--tiny", default=None, help="HIDDENxLAYERSxINIT_STDxRESIDUAL_SCALE")
    parser.add_argument("--draft", default=None, help="an EAGLE-3 draft (default: train one)")
    parser.add_argument(
        "--prompts", nargs="+", default=["chat", "repetition"], choices=["chat", "repetition"]
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--deployments",
        nargs="+",
        default=["colocated"],
        choices=["colocated", "disaggregated"],
        help="disaggregated: prefill + decode workers on this GPU behind the router",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIG_NAMES),
        choices=list(CONFIG_NAMES),
        help="the settings to run (plain always runs: speedups are against it)",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument(
        "--train-sequences", type=int, default=None, help="default: 32000 real, 512 random"
    )
    parser.add_argument(
        "--train-gen-len", type=int, default=None, help="default: 256 real, 112 random"
    )
    parser.add_argument(
        "--train-steps", type=int, default=None, help="default: 3500 real, 2000 random"
    )
    parser.add_argument("--work-dir", default=None, help="drafts, prompts and logs go here")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from pdserve.engine.checkpoint.model_files import resolve_model_dir
    from pdserve.protocol.spec_settings import SpecSettings
    from pdserve.synthetic.random_model import make_random_model

    args.work = Path(args.work_dir or tempfile.mkdtemp(prefix="pdserve-spec-"))
    args.work.mkdir(parents=True, exist_ok=True)
    args.real = args.model_path is not None and not args.tiny
    if args.tiny:
        model_path = str(_tiny_target(args.work / "target", args.tiny))
        target_name = f"tiny random {args.tiny}"
    else:
        model_path = args.model_path or str(make_random_model(args.work / "target", args.preset))
        target_name = args.model_path or f"random {args.preset}"
    model_dir = str(resolve_model_dir(model_path))
    args.ignore_eos = not args.real
    defaults = (32000, 256, 3500) if args.real else (512, 112, 2000)
    names = ("train_sequences", "train_gen_len", "train_steps")
    for name, default in zip(names, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    prompt_sets = _prompt_sets(args, AutoTokenizer.from_pretrained(model_dir))
    args.max_model_len = max(len(p) for s in prompt_sets.values() for p in s) + args.max_tokens
    args.max_model_len += 16
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    needs_draft = any(name.startswith("eagle3") for name in args.configs)
    draft = args.draft or (_train_draft(model_dir, args, report) if needs_draft else None)
    every = {
        "plain": None,
        "eagle3-chain": SpecSettings("EAGLE3", draft, 4, 1, 5),
        "eagle3-tree": SpecSettings("EAGLE3", draft, 4, 4, 8),
        "ngram-chain": SpecSettings("NGRAM", None, 4, 1, 5),
    }
    configs = {
        CONFIG_NAMES[name]: settings
        for name, settings in every.items()
        if name == "plain" or name in args.configs
    }
    measures = {
        "colocated": lambda s: measure_colocated(model_dir, s, prompt_sets, args),
        "disaggregated": lambda s: measure_pd(model_dir, s, prompt_sets, args, args.work / "logs"),
    }
    rows = []
    for deployment in args.deployments:
        measure = measures[deployment]
        results = {name: measure(settings) for name, settings in configs.items()}
        for (prompts, batch), plain in results["plain"].items():
            for name, by_key in results.items():
                result = by_key[prompts, batch]
                accept = result["accept_length"]
                rows.append(
                    {
                        "deployment": deployment,
                        "prompts": prompts,
                        "batch": batch,
                        "config": name,
                        "tokens_per_s": round(result["tokens_per_s"], 1),
                        "speedup_vs_plain": round(
                            result["tokens_per_s"] / plain["tokens_per_s"], 3
                        ),
                        "accept_length": None if accept is None else round(accept, 3),
                        "output_tokens": result["tokens"],
                        "identical_to_plain": result["token_ids"] == plain["token_ids"],
                        "agreeing_prefix_fraction": round(_agreeing(result, plain), 3),
                    }
                )
    report["results"] = rows
    report["workload"] = {
        "target": target_name,
        "prompts": {name: len(p) for name, p in prompt_sets.items()},
        "max_tokens": args.max_tokens,
        "stops_at_eos": not args.ignore_eos,
        "dtype": args.dtype,
        "batch_sizes": args.batch_sizes,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
