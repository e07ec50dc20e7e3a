"""Where a multi-turn chat's time to first token goes, step by step, with the prefix cache off
and on: the engine alone (no HTTP, no tokenizer), driven as `multiturn.py`'s workload drives a
`pdserve serve`, with a trace of every step.

Workload (random token ids): --conversations conversations, all at once, of --turns turns each.
Every prompt starts with the same --shared-tokens tokens, then --own-tokens of the
conversation's own; each user turn adds U[--turn-tokens] tokens, each answer U[--output-len]
(EOS ignored). Turn n + 1's prompt is turn n's prompt, its answer and the new user tokens,
added as soon as turn n finished (a closed loop, as a chat client).

Per setting: TTFT from `add_request` to the step that produced the first token (median, P99,
later turns only), the prompt tokens computed, and the steps: how many, how long, how many of
them ran prompt chunks, the mean tokens and sequences of those. `--trace` keeps every step.

    python benchmarks/multiturn_steps.py --preset llama-3.2-1b --out steps.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import add_model_arguments, device_name, model_directory, sync

from pdserve import LLM, SamplingParams


@dataclass
class Conversation:
    prompt: list[int]
    turns_left: int
    rng: random.Random
    answers: list[int] = field(default_factory=list)


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def run(model: str, args, cache: bool) -> dict:
    llm = LLM(
        model,
        device=args.device,
        disable_prefix_caching=not cache,
        max_model_len=args.max_model_len,
    )
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)

    def tokens(count: int, source: random.Random) -> list[int]:
        return [source.randrange(100, vocab) for _ in range(count)]

    shared = tokens(args.shared_tokens, rng)
    turn_low, turn_high = span(args.turn_tokens)
    out_low, out_high = span(args.output_len)
    conversations = {}
    added: dict[str, tuple[float, int]] = {}  # request id -> (time added, turn)
    ttfts: list[tuple[int, float]] = []
    steps: list[dict] = []

    def add_turn(index: int, conversation: Conversation, turn: int) -> None:
        conversation.prompt += tokens(conversation.rng.randint(turn_low, turn_high), rng)
        params = SamplingParams(
            max_new_tokens=conversation.rng.randint(out_low, out_high),
            temperature=0,
            ignore_eos=True,
            logprobs=args.logprobs,
        )
        request_id = f"c{index}t{turn}"
        engine.add_request(request_id, list(conversation.prompt), params)
        added[request_id] = (time.perf_counter(), turn)

    for index in range(args.conversations):
        own = random.Random(args.seed * 1000 + index)
        conversation = Conversation(shared + tokens(args.own_tokens, own), args.turns, own)
        conversations[index] = conversation
        add_turn(index, conversation, 0)
    started = time.perf_counter()
    first_seen: set[str] = set()
    while engine.has_unfinished():
        before = time.perf_counter()
        outputs = engine.step()
        sync()
        now = time.perf_counter()
        batch = engine.current_batch
        chunks = [
            (r, n) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True) if n > 1
        ]
        steps.append(
            {
                "ms": 1e3 * (now - before),
                "seqs": len(batch),
                "prompt_seqs": len(chunks),
                "prompt_tokens": sum(n for _, n in chunks),
                "prompt_kv": sum(r.num_computed_tokens for r, _ in chunks),
            }
        )
        for output in outputs:
            if output.request_id not in first_seen and output.token_ids:
                first_seen.add(output.request_id)
                added_at, turn = added[output.request_id]
                ttfts.append((turn, 1e3 * (now - added_at)))
            if output.finished:
                index = int(output.request_id[1:].split("t")[0])
                conversation = conversations[index]
                conversation.prompt += list(output.token_ids)
                conversation.turns_left -= 1
                if conversation.turns_left:
                    add_turn(index, conversation, args.turns - conversation.turns_left)
    duration = time.perf_counter() - started
    with_prompts = [s for s in steps if s["prompt_seqs"]]
    decode_only = [s for s in steps if not s["prompt_seqs"]]
    all_ttft = [t for _, t in ttfts]
    later = [t for turn, t in ttfts if turn > 0]
    row = {
        "cache": cache,
        "duration_s": duration,
        "requests": len(ttfts),
        "ttft_median_ms": statistics.median(all_ttft),
        "ttft_p99_ms": _percentile(all_ttft, 0.99),
        "later_turns_ttft_median_ms": statistics.median(later) if later else None,
        "prompt_tokens_computed": sum(s["prompt_tokens"] for s in steps),
        "steps": len(steps),
        "prompt_steps": len(with_prompts),
        "prompt_steps_ms_total": sum(s["ms"] for s in with_prompts),
        "prompt_step_ms_mean": _mean(s["ms"] for s in with_prompts),
        "prompt_step_tokens_mean": _mean(s["prompt_tokens"] for s in with_prompts),
        "prompt_step_seqs_mean": _mean(s["prompt_seqs"] for s in with_prompts),
        "prompt_step_kv_mean": _mean(s["prompt_kv"] for s in with_prompts),
        "decode_steps_ms_total": sum(s["ms"] for s in decode_only),
        "decode_step_ms_mean": _mean(s["ms"] for s in decode_only),
        "decode_step_seqs_mean": _mean(s["seqs"] for s in decode_only),
    }
    if args.trace:
        row["trace"] = steps
    return row


def _mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--shared-tokens", type=int, default=1300)
    parser.add_argument("--own-tokens", type=int, default=32)
    parser.add_argument("--turn-tokens", default="130:400")
    parser.add_argument("--output-len", default="128:256")
    parser.add_argument("--logprobs", type=int, default=0, help="as multiturn.py asks (-1: none)")
    parser.add_argument("--settings", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true", help="keep every step in the JSON")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.logprobs < 0:
        args.logprobs = None
    model = model_directory(args, tempfile.mkdtemp(prefix="pdserve-steps-"))
    rows = []
    for setting in args.settings:
        row = run(model, args, cache=setting == "on")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
    report = {
        "device": device_name(),
        "model": args.preset or args.model_path,
        "command": " ".join(["python", "benchmarks/multiturn_steps.py", *sys.argv[1:]]),
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
