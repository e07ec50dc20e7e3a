"""How much of a long prompt's KV handoff hides behind its prefill: for one prompt, the time
from the start of its prefill to the decode worker's commit, against the prefill alone.

Both handoffs run in this process on one device (`drive` turns both workers' engine loops, as
`pdserve prefill` and `pdserve decode` would), so the figure is the handoff's own cost: the
prefill alone is the same engine settings' time to the first token of the same prompt. Each
setting is measured with the KV sent whole after the prefill (`--transfer-piece-bytes 0`) and
streamed while the prompt is computed (pieces of `--piece-bytes`), at each prefill chunk size.

    python benchmarks/handoff_overlap.py --preset llama-3.1-8b --prompt-len 8192 \
        --chunk-sizes 2048 8192 --backend tcp
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import add_model_arguments, device_name, model_directory, sync

from pdserve import LLM, SamplingParams
from pdserve.decode.handoff import DecodeHandoff
from pdserve.prefill.handoff import PrefillHandoff
from pdserve.protocol.engine_messages import Bootstrap, GenerateRequest
from pdserve.server.engine_process import EngineLoop
from pdserve.transfer.config import TransferConfig

FIRST = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)


def prompt_of(length: int, vocab_size: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(min(100, vocab_size // 2), vocab_size) for _ in range(length)]


def prefill_alone(llm: LLM, prompt: list[int]) -> float:
    sync()
    started = time.perf_counter()
    llm.generate([prompt], FIRST, use_tqdm=False)
    sync()
    return time.perf_counter() - started


def handoff(prefill: PrefillHandoff, decode: DecodeHandoff, prompt: list[int], room: int):
    """Seconds from handing the prompt to the prefill loop (decode's pages already reserved,
    prefill already asked) to the decode loop reporting the committed first token."""
    body = dataclasses.asdict(FIRST)
    boot = Bootstrap("127.0.0.1", prefill.bootstrap_port, room)
    loops = {"p": EngineLoop(prefill), "d": EngineLoop(decode)}
    loops["d"].tick([GenerateRequest(f"d{room}", prompt, body, boot)])
    deadline = time.monotonic() + 60
    while prefill.server.rooms.get(room) is None or prefill.server.rooms[room].peer is None:
        loops["d"].tick([])
        if time.monotonic() > deadline:
            raise TimeoutError("decode's transfer request never reached prefill")
    sync()
    started = time.perf_counter()
    loops["p"].tick([GenerateRequest(f"p{room}", prompt, body, boot)])
    committed = None
    while committed is None or prefill.sending or prefill.prefilling:
        for name, loop in loops.items():
            sent = loop.tick([])
            for output in sent.outputs if sent is not None else []:
                if output.error:
                    raise RuntimeError(f"{output.request_id}: {output.error}")
                if name == "d" and committed is None:
                    sync()
                    committed = time.perf_counter() - started
        if time.monotonic() > deadline:
            raise TimeoutError("the handoff did not finish within 60 s")
    return committed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--piece-bytes", type=int, default=64 << 20)
    parser.add_argument("--backend", default="tcp", choices=("tcp", "gloo"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="pdserve-overlap-")
    model = model_directory(args, scratch)
    engine = dict(
        device=args.device,
        kv_cache_memory=int(args.kv_cache_gib * (1 << 30)),
        max_model_len=args.prompt_len + 64,
    )
    rows = []
    room = 1
    base = TransferConfig(bootstrap_port=0, backend=args.backend)
    decode_llm = LLM(model, **engine)
    prompt = prompt_of(args.prompt_len, decode_llm.engine.model_config.vocab_size, seed=0)
    for chunk in args.chunk_sizes:
        prefill_llm = LLM(model, chunked_prefill_size=chunk, **engine)
        alone = [prefill_alone(prefill_llm, prompt) for _ in range(args.repeats + 1)][1:]
        for piece_bytes in (0, args.piece_bytes):
            config = dataclasses.replace(base, piece_bytes=piece_bytes)
            prefill = PrefillHandoff(prefill_llm.engine, config)
            decode = DecodeHandoff(decode_llm.engine, config)
            try:
                times = []
                for _ in range(args.repeats + 1):
                    times.append(handoff(prefill, decode, prompt, room))
                    room += 1
                times = times[1:]  # the first builds the connection
            finally:
                prefill.stop()
                decode.stop()
            row = {
                "chunk": chunk,
                "streamed": piece_bytes > 0,
                "prefill_alone_ms": 1e3 * statistics.median(alone),
                "start_to_commit_ms": 1e3 * statistics.median(times),
            }
            row["ratio"] = row["start_to_commit_ms"] / row["prefill_alone_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del prefill_llm, prefill
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report = {
        "device": device_name(),
        "model": args.preset or args.model_path,
        "prompt_len": args.prompt_len,
        "backend": args.backend,
        "piece_bytes": args.piece_bytes,
        "rows": rows,
        "command": " ".join(["python", "benchmarks/handoff_overlap.py", *sys.argv[1:]]),
    }
    print(
        f"\n{report['device']}, {report['model']}, {args.prompt_len}-token prompt, {args.backend}"
    )
    print(f"{'chunk':>6} {'KV sent':>10} {'prefill ms':>11} {'to commit ms':>13} {'ratio':>6}")
    for row in rows:
        sent = "streamed" if row["streamed"] else "after"
        print(
            f"{row['chunk']:>6} {sent:>10} {row['prefill_alone_ms']:>11.1f} "
            f"{row['start_to_commit_ms']:>13.1f} {row['ratio']:>6.2f}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
