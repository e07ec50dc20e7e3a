"""A run spread over several client processes, for loads one process cannot read.

One Python process that reads every streamed token (httpx, an SSE parse and a JSON decode
per chunk) tops out near ten thousand chunks a second: on the GPU host it was busy 89-98% of
a run at 9-18k output tokens/s, and requests then queued in the client, which the run
charged to the server as time to first token. So the conversations are dealt round-robin to
`processes` spawned clients, which all keep the one arrival schedule: the parent draws the
Poisson offsets as `run_load` does, each child waits for the same start (a wall-clock
instant the parent names once every child is ready) and sends its conversations at their
offsets. Children get their share and give their records back as JSON over a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import time
from multiprocessing.connection import Connection

from pdserve.bench.client import BenchClient, ClientSettings, RequestRecord
from pdserve.bench.runner import Load, RunResult, arrival_offsets, run_scheduled
from pdserve.bench.workloads import Conversation, Turn

READY_DEADLINE_S = 120.0  # a child's start (imports, its event loop)
_START_MARGIN_S = 0.05  # from naming the start to the start: the message's trip


@dataclasses.dataclass
class ProcessesResult:
    run: RunResult
    cpu_s: list[float]  # each child's CPU time during the run


def run_load_in_processes(
    settings: ClientSettings,
    conversations: list[Conversation],
    load: Load,
    processes: int,
    seed: int = 0,
    deadline_s: float | None = None,
) -> ProcessesResult:
    """`run_load` of the conversations at `load` (arrival rate only: a concurrency cap is
    one process's), over `processes` client processes."""
    if processes < 1:
        raise ValueError(f"{processes} client processes: must be >= 1")
    if load.max_concurrency is not None and processes > 1:
        raise ValueError("a concurrency cap needs one client process")
    if deadline_s is not None and not deadline_s > 0:
        raise ValueError(f"deadline {deadline_s} s: must be > 0")
    if not conversations:
        return ProcessesResult(RunResult(load, [], 0.0), [])
    offsets = arrival_offsets(len(conversations), load.request_rate, seed)
    shares = [[] for _ in range(min(processes, len(conversations)))]
    for index, (conversation, offset) in enumerate(zip(conversations, offsets, strict=True)):
        shares[index % len(shares)].append([index, _conversation_json(conversation), offset])
    spawn = multiprocessing.get_context("spawn")
    children = []
    try:
        for share in shares:
            ours, theirs = spawn.Pipe()
            request = {
                "settings": dataclasses.asdict(settings),
                "load": [load.request_rate, load.max_concurrency],
                "scheduled": share,
                "deadline_s": deadline_s,
            }
            child = spawn.Process(target=_child, args=(theirs, json.dumps(request)), daemon=True)
            child.start()
            theirs.close()
            children.append((child, ours))
        for _, pipe in children:
            _expect(pipe, READY_DEADLINE_S, "ready")
        start_wall = time.time() + _START_MARGIN_S
        for _, pipe in children:
            pipe.send_bytes(json.dumps(start_wall).encode())
        longest = deadline_s or settings.timeout_s * max(len(c.turns) for c in conversations)
        results = [_expect(pipe, longest + READY_DEADLINE_S, "records") for _, pipe in children]
    finally:
        for child, pipe in children:
            pipe.close()
            child.join(5)
            if child.is_alive():
                child.kill()
    records = [RequestRecord(**record) for result in results for record in result["records"]]
    records.sort(key=lambda r: (r.conversation, r.turn))
    duration = max(result["end_wall"] for result in results) - start_wall
    return ProcessesResult(RunResult(load, records, duration), [r["cpu_s"] for r in results])


def _expect(pipe: Connection, deadline_s: float, what: str):
    if not pipe.poll(deadline_s):
        raise TimeoutError(f"a client process sent no {what} within {deadline_s:g} s")
    try:
        message = json.loads(pipe.recv_bytes())
    except EOFError as e:
        raise RuntimeError(f"a client process exited before it sent its {what}") from e
    if isinstance(message, dict) and "error" in message:
        raise RuntimeError(f"a client process failed: {message['error']}")
    return message


def _child(pipe: Connection, request_json: str) -> None:
    """A client process: its share of the run, from the start the parent names."""
    try:
        request = json.loads(request_json)
        settings = ClientSettings(**request["settings"])
        rate, cap = request["load"]
        scheduled = [(i, _conversation(c), offset) for i, c, offset in request["scheduled"]]
        pipe.send_bytes(b'"ready"')
        if not pipe.poll(2 * READY_DEADLINE_S):  # NOTE: the other processes' starts, at most
            raise TimeoutError("the run's start never came")
        start_wall = json.loads(pipe.recv_bytes())
        cpu = time.process_time()
        start = time.perf_counter() + (start_wall - time.time())

        async def go() -> list[RequestRecord]:
            client = BenchClient(settings)
            try:
                load = Load(rate, cap)
                return await run_scheduled(
                    client, scheduled, load, start, None, request["deadline_s"]
                )
            finally:
                await client.aclose()

        records = asyncio.run(go())
        result = {
            "records": [dataclasses.asdict(record) for record in records],
            "cpu_s": time.process_time() - cpu,
            "end_wall": time.time(),
        }
    except Exception as e:  # NOTE: said to the parent, which raises it
        result = {"error": f"{type(e).__name__}: {e}"}
    with contextlib.suppress(OSError):  # NOTE: the parent gave up on us
        pipe.send_bytes(json.dumps(result).encode())
    pipe.close()


def _conversation_json(conversation: Conversation) -> dict:
    turns = [
        [list(t.prompt) if isinstance(t.prompt, tuple) else t.prompt, t.max_tokens]
        for t in conversation.turns
    ]
    return {"system": conversation.system, "turns": turns}


def _conversation(data: dict) -> Conversation:
    turns = tuple(
        Turn(tuple(prompt) if isinstance(prompt, list) else prompt, max_tokens)
        for prompt, max_tokens in data["turns"]
    )
    return Conversation(turns, data["system"])
