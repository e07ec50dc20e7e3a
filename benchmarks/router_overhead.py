"""What a router adds to a request and to each streamed token: `pdserve router` beside SGLang's
router (`pip install sglang-router`, a benchmark-only tool, not a pdserve dependency), both in
prefill/decode mode in front of the very same mock workers (`mock_worker.py`: a prefill that
answers at once, a decode that streams OpenAI chat.completion.chunk events), and the mock
decode worker asked directly as the baseline. One client for all three (plain asyncio, kept-
alive connections; see `Connection`).

Three phases, each at every `--concurrency`; one at a time the targets take turns request by
request, at higher concurrency each has the machine to itself in turn (rounds turn the order):
- ttft: streams of `--ttft-tokens` tokens sent as fast as possible; time from sending the
  request to the first token's event. Added per request = through the router - direct.
- paced: streams of `--paced-tokens` tokens, one every `--pace-ms`; each token's delivery
  time, from the mock writing it (its timestamp travels in the event) to the client reading
  it. Added per token = through the router - direct.
- burst: streams of `--burst-tokens` tokens written as fast as the socket takes them; the
  stream's whole time divided by its tokens. Added per token = through the router - direct.
Medians and P99s over every sample of every round; "added" compares a router's statistic
with the direct one's (P99 with P99).

ACKs: on a kept-alive connection Linux delays a client's ACKs (up to 40 ms) to ride on its
next request. A server that writes small pieces without TCP_NODELAY then waits for that ACK
before sending its next piece (Nagle's algorithm): a stream's next event can stall ~40 ms.
sglang-router 0.3.2 does that (its first token through a kept-alive connection comes ~43 ms
late); pdserve's router and the mock set TCP_NODELAY (asyncio does). By default the client
acknowledges at once (TCP_QUICKACK after every read), so that what is measured is each
router's own work; `--delayed-acks` measures what a client with default ACKs sees.

    python benchmarks/router_overhead.py --output router_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from pdserve.server.local_process import free_port

HERE = Path(__file__).resolve().parent
TIMESTAMP = re.compile(rb'"content":"t([0-9.]+)"')
PHASES = ("ttft", "paced", "burst")


# ---- the processes ----------------------------------------------------------------------------


def start_mock(role: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_dir / f"mock_{role}.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(
        [sys.executable, str(HERE / "mock_worker.py"), "--role", role, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, f"mock {role}")
    return process, url


def start_pdserve_router(
    prefill: str, decode: str, log_dir: Path, processes: int = 1
) -> tuple[subprocess.Popen, str]:
    """Its output (an access line per request) goes to a file, as sglang-router's does: not
    through a thread of this process (LocalServer's log copier), which would take the
    client's GIL turns once per request, for pdserve alone."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "--log-level", "info", "router"]
    command += ["--prefill", prefill, str(free_port()), "--decode", decode]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--router-processes", str(processes)]
    log = open(log_dir / "pdserve_router.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, "pdserve router")
    return process, url


def start_sglang_router(prefill: str, decode: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    command += ["--prefill", prefill, str(free_port()), "--decode", decode, "--policy"]
    command += ["round_robin", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    log = open(log_dir / "sglang_router.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, "sglang-router")
    return process, url


def wait_healthy(url: str, process: subprocess.Popen, name: str, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} not healthy after {deadline_s} s")


# ---- the client -------------------------------------------------------------------------------


def chat_body(tokens: int) -> bytes:
    body = {
        "model": "mock",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "stream": True,
    }
    return json.dumps(body).encode()


class Connection:
    """A kept-alive HTTP/1.1 connection of the benchmark's client, on plain asyncio streams:
    the client shares the machine with the routers, so it must cost little CPU (httpx costs
    more per request than a router), and it costs the same whichever target it talks to."""

    def __init__(self, url: str, quick_acks: bool):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.quick_acks = quick_acks and hasattr(socket, "TCP_QUICKACK")
        self.reader: asyncio.StreamReader | None = None

    async def stream(self, tokens: int) -> dict:
        """One streamed chat completion: seconds to the first token, to the end, and each
        token's delivery time (read here - written by the mock)."""
        if self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.socket = self.writer.get_extra_info("socket")
        body = chat_body(tokens)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sent = time.monotonic()
        self.writer.write(head.encode() + body)
        answer_head = await self.reader.readuntil(b"\r\n\r\n")
        self._ack()
        if answer_head[9:12] != b"200" or b"chunked" not in answer_head.lower():
            raise RuntimeError(f"{self.host}:{self.port} answered {answer_head[:200]!r}")
        delivery, first = [], None
        buffer, pending, done = b"", b"", False
        while not done:
            data = await self.reader.read(1 << 16)
            now = time.monotonic()
            self._ack()
            if not data:
                raise RuntimeError(f"{self.host}:{self.port} closed the stream")
            decoded, buffer, done = _dechunk(buffer + data)
            complete, _, pending = (pending + decoded).rpartition(b"\n\n")
            stamps = TIMESTAMP.findall(complete)
            if stamps and first is None:
                first = now - sent
            delivery += [now - float(stamp) for stamp in stamps]
        if len(delivery) != tokens:
            raise RuntimeError(f"{self.host}:{self.port} streamed {len(delivery)} tokens")
        return {"ttft": first, "total": time.monotonic() - sent, "delivery": delivery}

    def _ack(self) -> None:
        if self.quick_acks:
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def close(self) -> None:
        if self.reader is not None:
            self.writer.close()


def _dechunk(buffer: bytes) -> tuple[bytes, bytes, bool]:
    """The data of the whole chunks at the start of `buffer`, the rest, and whether the last
    chunk came."""
    pieces, at = [], 0
    while (line_end := buffer.find(b"\r\n", at)) >= 0:
        size = int(buffer[at:line_end].split(b";")[0], 16)
        if size == 0:
            if buffer.find(b"\r\n\r\n", line_end) < 0:
                break
            return b"".join(pieces), b"", True
        if len(buffer) < line_end + 4 + size:
            break
        pieces.append(buffer[line_end + 2 : line_end + 2 + size])
        at = line_end + 4 + size
    return b"".join(pieces), buffer[at:], False


async def run_phase(
    pools: dict[str, list[Connection]],
    urls: dict[str, str],
    tokens: int,
    concurrency: int,
    requests: int,
    quick_acks: bool,
) -> dict[str, list[dict]]:
    """`requests` streams to each of `urls` (name: URL), `concurrency` at a time, the targets
    taking turns request by request; connections are kept alive in `pools`."""
    queue = [name for _ in range(requests) for name in urls][::-1]
    results: dict[str, list[dict]] = {name: [] for name in urls}

    async def user() -> None:
        while queue:
            name = queue.pop()
            pool = pools.setdefault(name, [])
            connection = pool.pop() if pool else Connection(urls[name], quick_acks)
            results[name].append(await connection.stream(tokens))
            pool.append(connection)

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return results


def samples(phase: str, results: list[dict], tokens: int) -> list[float]:
    """A phase's samples in seconds: one per request, or one per token (paced)."""
    if phase == "ttft":
        return [r["ttft"] for r in results]
    if phase == "paced":
        return [d for r in results for d in r["delivery"]]
    return [r["total"] / tokens for r in results]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ---- the benchmark ----------------------------------------------------------------------------


async def measure(args, targets: dict[str, str], decode_url: str) -> dict:
    plan = {
        "ttft": (args.ttft_tokens, 0.0, lambda c: max(args.ttft_requests, 10 * c)),
        "paced": (args.paced_tokens, args.pace_ms / 1000, lambda c: max(3, c)),
        "burst": (args.burst_tokens, 0.0, lambda c: max(5, c)),
    }
    found: dict = {}
    names = list(targets)
    for concurrency in args.concurrency:
        pools: dict[str, list[Connection]] = {}
        for name in names:  # NOTE: warm-up: connections, first-request paths
            urls = {name: targets[name]}
            await run_phase(pools, urls, 8, concurrency, 4 * concurrency, args.quick_acks)
        for round_ in range(args.rounds):
            # NOTE: one at a time, the targets take turns request by request; at higher
            # concurrency each has the machine to itself, in an order the rounds turn.
            turn = names[round_ % len(names) :] + names[: round_ % len(names)]
            groups = [names] if concurrency == 1 else [[name] for name in turn]
            for phase in PHASES:
                tokens, pace_s, requests = plan[phase]
                httpx.post(decode_url + "/mock/pace", json={"interval_s": pace_s}, timeout=10)
                key = f"{phase} c={concurrency}"
                for group in groups:
                    urls = {name: targets[name] for name in group}
                    n = requests(concurrency)
                    results = await run_phase(pools, urls, tokens, concurrency, n, args.quick_acks)
                    for name, done in results.items():
                        found.setdefault(key, {}).setdefault(name, []).extend(
                            samples(phase, done, tokens)
                        )
                    print(f"round {round_} {key} {'+'.join(group)}: {n} streams each")
        for connection in (c for pool in pools.values() for c in pool):
            connection.close()
    return found


def summarize(found: dict) -> list[dict]:
    rows = []
    for key, by_target in found.items():
        stats = {
            name: {"median": statistics.median(v), "p99": percentile(v, 99), "n": len(v)}
            for name, v in by_target.items()
        }
        row = {"case": key, "direct": stats["direct"]}
        for router in ("pdserve", "sglang"):
            if router in stats:
                row[router] = stats[router]
                row[f"{router}_added"] = {
                    q: stats[router][q] - stats["direct"][q] for q in ("median", "p99")
                }
        if "pdserve" in stats and "sglang" in stats:
            row["added_ratio"] = {
                q: row["pdserve_added"][q] / row["sglang_added"][q]
                if row["sglang_added"][q] > 0
                else None
                for q in ("median", "p99")
            }
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def us(seconds: float) -> str:
        return f"{seconds * 1e6:,.0f}"

    lines = [
        "| case | direct median / P99 (µs) | pdserve added median / P99 (µs) "
        "| sglang added median / P99 (µs) | pdserve / sglang added (median, P99) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        d = row["direct"]
        cells = [row["case"], f"{us(d['median'])} / {us(d['p99'])}"]
        for router in ("pdserve", "sglang"):
            added = row.get(f"{router}_added")
            cells.append(f"{us(added['median'])} / {us(added['p99'])}" if added else "-")
        ratio = row.get("added_ratio")
        cells.append(
            ", ".join("-" if r is None else f"{r:.2f}x" for r in ratio.values()) if ratio else "-"
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-tokens", type=int, default=4)
    parser.add_argument("--ttft-requests", type=int, default=200, help="per round at c=1")
    parser.add_argument("--paced-tokens", type=int, default=50)
    parser.add_argument("--pace-ms", type=float, default=20.0)
    parser.add_argument("--burst-tokens", type=int, default=1000)
    parser.add_argument(
        "--routers", nargs="+", default=["pdserve", "sglang"], choices=("pdserve", "sglang")
    )
    parser.add_argument(
        "--router-processes", type=int, default=1, help="pdserve router's --router-processes"
    )
    parser.add_argument(
        "--delayed-acks",
        dest="quick_acks",
        action="store_false",
        help="let the client's kernel delay its ACKs as usual on a kept-alive connection "
        "(default: TCP_QUICKACK after every read, see the module docstring)",
    )
    parser.add_argument("--output", default="router_overhead.json")
    args = parser.parse_args()

    processes = []
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as scratch:
        log_dir = Path(scratch)
        try:
            prefill, prefill_url = start_mock("prefill", log_dir)
            decode, decode_url = start_mock("decode", log_dir)
            processes += [prefill, decode]
            targets = {"direct": decode_url}
            if "pdserve" in args.routers:
                server, targets["pdserve"] = start_pdserve_router(
                    prefill_url, decode_url, log_dir, args.router_processes
                )
                processes.append(server)
            if "sglang" in args.routers:
                router, targets["sglang"] = start_sglang_router(prefill_url, decode_url, log_dir)
                processes.append(router)
            found = asyncio.run(measure(args, targets, decode_url))
        finally:
            for process in reversed(processes):
                process.terminate()
                process.wait(timeout=30)
    rows = summarize(found)
    print(table(rows))
    machine = f"{_cpu_model()}, {os.cpu_count()} CPUs"
    result = {"machine": machine, "python": platform.python_version(), "args": vars(args)}
    Path(args.output).write_text(json.dumps({**result, "rows": rows}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
