"""How much of a long prompt's KV handoff hides behind its prefill: for one prompt, the time
from the start of its prefill to the decode worker's commit, against the prefill alone.

Both workers' engine loops are turned here, as `pdserve prefill` and `pdserve decode` would turn
them, so the figure is the handoff's own cost: the prefill alone is the same engine settings'
time to the first token of the same prompt. By default both run in this process on one device;
with `--decode-device` the decode worker runs in a process of its own on that device (nccl needs
it: prefill on cuda:0, decode on cuda:1), and its commit is read from the host's monotonic
clock, which both processes share. Each setting is measured with the KV sent whole after the
prefill (`--transfer-piece-bytes 0`) and streamed while the prompt is computed (pieces of
`--piece-bytes`), at each prefill chunk size.

    python benchmarks/handoff_overlap.py --preset llama-3.1-8b --prompt-len 8192 \
        --chunk-sizes 2048 8192 --backend tcp
    NCCL_NVLS_ENABLE=0 python benchmarks/handoff_overlap.py --preset llama-3.1-8b \
        --prompt-len 8192 --chunk-sizes 2048 8192 --backend nccl --decode-device cuda:1
    # both workers at TP 2 (prefill on cuda:0-1, decode on cuda:2-3): per-rank-pair links
    NCCL_NVLS_ENABLE=0 python benchmarks/handoff_overlap.py --preset llama-3.1-8b \
        --prompt-len 8192 --chunk-sizes 2048 --backend nccl --decode-device cuda:2 --tp-size 2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing
import multiprocessing.connection
import select
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import add_model_arguments, device_name, model_directory, sync

from pdserve import LLM, SamplingParams
from pdserve.decode.connector import DecodeConnector
from pdserve.disagg import rank_worker
from pdserve.engine_process.loop import EngineLoop
from pdserve.prefill.connector import PrefillConnector
from pdserve.protocol.engine_messages import Bootstrap, GenerateRequest
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


class LocalDecode:
    """The decode worker's loop turned in this process."""

    def __init__(self, decode: DecodeConnector):
        self.connector = decode
        self.loop = EngineLoop(decode.engine)
        self.committed_at: float | None = None
        self.receiver = None

    def start(self, request: GenerateRequest) -> None:
        self.committed_at, self.receiver = None, None
        self.loop.tick([request])

    def turn(self) -> float | None:
        """One tick; the clock at the commit of the room's first token, once it happened."""
        if self.receiver is None:
            rooms = [r.transfer.receiver for r in self.connector.requests.values()]
            self.receiver = next((r for r in rooms if r is not None), None)
        sent = self.loop.tick([])
        for output in sent.outputs if sent is not None else []:
            if output.error:
                raise RuntimeError(f"{output.request_id}: {output.error}")
            if self.committed_at is None:
                sync()
                self.committed_at = time.monotonic()
        return self.committed_at

    def stamps(self) -> dict[str, float]:
        """The decode side's protocol steps of the last room (monotonic clock)."""
        stamps = dict(self.receiver.stamps) if self.receiver is not None else {}
        return {f"decode_{name}": t for name, t in stamps.items()} | {
            "decode_committed": self.committed_at
        }

    def stop(self) -> None:
        self.connector.stop()


def decode_process(conn, model: str, engine: dict) -> None:
    """A decode worker on a device of its own. Commands from `conn`: ("config", TransferConfig)
    starts a handoff with it (stopping the last); ("run", request) hands it a request and
    answers with the clock at its commit (or the error); ("stop", None) ends."""
    if engine["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(engine["device"]))
    llm = LLM(model, **engine)
    decode = None
    conn.send(("ready", None))
    waiting = False
    try:
        while True:
            # NOTE: as `pdserve decode` waits for its next message: not while the engine has
            # work, else until a message or the handoff's doorbell (a room moved).
            if decode is None:
                ready = conn.poll(0.01)
            else:
                idle_s = min(decode.loop.idle_wait_ms(), 10) / 1000
                doorbell = decode.connector.doorbell
                ready = conn in multiprocessing.connection.wait([conn, doorbell], idle_s)
                doorbell.answer()
            if ready:
                command, value = conn.recv()
                if command == "stop":
                    return
                if command == "config":
                    if decode is not None:
                        decode.stop()
                    decode = LocalDecode(DecodeConnector(llm.engine, value))
                    conn.send(("ready", None))
                    continue
                decode.start(value)
                waiting = True
            if decode is None:
                continue
            try:
                committed_at = decode.turn()
            except RuntimeError as exc:
                conn.send(("error", str(exc)))
                waiting = False
                continue
            if waiting and committed_at is not None:
                conn.send(("committed", decode.stamps()))
                waiting = False
    finally:
        if decode is not None:
            decode.stop()


class RemoteDecode:
    """The decode worker in a child process (decode_process), as a second GPU's worker; its
    model is loaded once, a handoff is started per transfer setting (`use`)."""

    def __init__(self, model: str, engine: dict):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=decode_process, args=(child, model, engine), daemon=True
        )
        self.process.start()
        self.committed_at: float | None = None
        self._stamps: dict[str, float] = {}
        self._expect("ready", timeout=600)

    def _expect(self, kind: str, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the decode process sent no {kind!r} within {timeout:.0f} s")
        got, value = self.conn.recv()
        if got != kind:
            raise RuntimeError(f"the decode process: {got}: {value}")
        return value

    def use(self, config: TransferConfig) -> RemoteDecode:
        self.conn.send(("config", config))
        self._expect("ready", timeout=60)
        return self

    def start(self, request: GenerateRequest) -> None:
        self.committed_at = None
        self.conn.send(("run", request))

    def turn(self) -> float | None:
        if self.committed_at is None and self.conn.poll(0):
            self._stamps = self._expect("committed", timeout=0)
            self.committed_at = self._stamps["decode_committed"]
        return self.committed_at

    def stamps(self) -> dict[str, float]:
        return self._stamps

    def stop(self) -> None:
        """The handoff's end is the next `use` (or `close`)."""

    def close(self) -> None:
        self.conn.send(("stop", None))
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


def handoff(prefill: PrefillConnector, decode: LocalDecode | RemoteDecode, prompt, room):
    """Seconds from handing the prompt to the prefill loop (decode's pages already reserved,
    prefill already asked) to the decode loop reporting the committed first token, and each
    side's protocol steps as ms since that start. Both loops wait between turns as the
    workers' loops do (`EngineLoop.idle_wait_ms`, woken by the handoff's doorbell), so that
    the transfer threads get the GIL as they would in the workers."""
    body = dataclasses.asdict(FIRST)
    boot = Bootstrap("127.0.0.1", prefill.bootstrap_port, room)
    loop = EngineLoop(prefill.engine)
    decode.start(GenerateRequest(f"d{room}", prompt, body, boot))
    deadline = time.monotonic() + 60
    while prefill.server.rooms.get(room) is None or prefill.server.rooms[room].peer is None:
        decode.turn()
        if time.monotonic() > deadline:
            raise TimeoutError("decode's transfer request never reached prefill")
    sender = prefill.server.rooms[room]
    sync()
    started = time.monotonic()
    loop.tick([GenerateRequest(f"p{room}", prompt, body, boot)])
    committed_at = None
    while committed_at is None or prefill.requests:
        sent = loop.tick([])
        for output in sent.outputs if sent is not None else []:
            if output.error:
                raise RuntimeError(f"{output.request_id}: {output.error}")
        committed_at = decode.turn()
        if sent is None:  # NOTE: as `pdserve prefill` waits: until its doorbell rings
            doorbells = [prefill.doorbell]
            if isinstance(decode, LocalDecode):
                doorbells.append(decode.connector.doorbell)
            select.select(doorbells, [], [], loop.idle_wait_ms() / 1000)
            for doorbell in doorbells:
                doorbell.answer()
        if time.monotonic() > deadline:
            raise TimeoutError("the handoff did not finish within 60 s")
    steps = {f"prefill_{name}": t for name, t in sender.stamps.items()} | decode.stamps()
    ordered = sorted((t, name) for name, t in steps.items() if t is not None)
    return committed_at - started, {name: round((t - started) * 1e3, 2) for t, name in ordered}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--piece-bytes", type=int, default=64 << 20)
    parser.add_argument("--backend", default="tcp", choices=("tcp", "gloo", "nccl", "ipc"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--decode-device",
        help="run the decode worker in a process of its own on this device (nccl: cuda:1)",
    )
    parser.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="both workers' TP size (nccl: decode from --decode-device on, e.g. cuda:2 for 2)",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.backend == "nccl" and args.decode_device is None:
        parser.error("--backend nccl needs --decode-device (a second GPU, e.g. cuda:1)")
    scratch = tempfile.mkdtemp(prefix="pdserve-overlap-")
    model = model_directory(args, scratch)
    engine = dict(
        device=args.device,
        kv_cache_memory=int(args.kv_cache_gib * (1 << 30)),
        max_model_len=args.prompt_len + 64,
        disable_prefix_caching=True,  # every repeat computes the whole prompt again
        tp_size=args.tp_size,
        # NOTE: as the worker factories start them: each rank moves its own KV heads.
        rank_worker_module=rank_worker.__name__,
    )
    rows = []
    room = 1
    base = TransferConfig(bootstrap_port=0, backend=args.backend)
    if args.decode_device:
        decode_llm, remote = None, RemoteDecode(model, dict(engine, device=args.decode_device))
    else:
        decode_llm, remote = LLM(model, **engine), None
    for chunk in args.chunk_sizes:
        prefill_llm = LLM(model, chunked_prefill_size=chunk, **engine)
        prompt = prompt_of(args.prompt_len, prefill_llm.engine.model_config.vocab_size, seed=0)
        alone = [prefill_alone(prefill_llm, prompt) for _ in range(args.repeats + 1)][1:]
        for piece_bytes in (0, args.piece_bytes):
            config = dataclasses.replace(base, piece_bytes=piece_bytes)
            prefill = PrefillConnector(prefill_llm.engine, config)
            if remote is not None:
                decode = remote.use(config)
            else:
                decode = LocalDecode(DecodeConnector(decode_llm.engine, config))
            try:
                runs = []
                for _ in range(args.repeats + 1):
                    runs.append(handoff(prefill, decode, prompt, room))
                    room += 1
                runs = sorted(runs[1:], key=lambda run: run[0])  # the first connects
                times = [elapsed for elapsed, _ in runs]
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
            row["median_run_steps_ms"] = runs[len(runs) // 2][1]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del prefill_llm, prefill
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if remote is not None:
        remote.close()
    report = {
        "device": device_name(),
        "model": args.preset or args.model_path,
        "prompt_len": args.prompt_len,
        "backend": args.backend,
        "decode": args.decode_device or "in this process, same device",
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
