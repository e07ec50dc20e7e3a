"""A soak of `pdserve launch`: many mixed requests (streamed or not, every endpoint, greedy and
sampled, some invalid, some abandoned by their client at a random moment), while one prefill
and one decode worker are killed (SIGKILL to the whole process group, as a crashed container)
and restarted by the launcher on the same address.

Meanwhile `/abort_room` posts with random rooms flood every worker (`soak_hostile`).

It passes when no request gets a 5xx other than 503 while a killed worker is down, no request
runs past its deadline, every invalid body gets 400, every abort post is taken, no engine
restarted but with its killed worker, every page is free on every worker at the end, and no
surviving process grew by more than `RSS_GROWTH_BOUND_MB` after warm-up.

    python3 -m tests.e2e.soak --requests 10000          # the full soak, prints a summary
    python3 -m pytest tests/e2e/test_soak.py            # a shorter one, in CI
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from pdserve.server.local_process import free_port
from tests.e2e.soak_hostile import AbortFlood, EngineWatch
from tests.waiting import wait_until

REQUEST_DEADLINE_S = 90.0
RSS_GROWTH_BOUND_MB = 150.0
# A killed worker's requests may fail from its death until this long after it is healthy
# again (peers time out its rooms, the router's health check puts it back).
DISRUPTION_GRACE_S = 15.0
ABORT_SHARE = 0.15
INVALID_SHARE = 0.05
INVALID_BODIES = (
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "temperature": -1},
    {"prompt": "", "max_tokens": 4},
    {"prompt": "hi", "top_p": 0},
)


@dataclass
class Outcome:
    kind: str  # ok | rejected | aborted | unavailable | failed
    started: float
    detail: str = ""


@dataclass
class Disruption:
    url: str
    killed_at: float
    healthy_at: float | None = None

    def covers(self, moment: float) -> bool:
        end = (self.healthy_at or float("inf")) + DISRUPTION_GRACE_S
        return self.killed_at - 1.0 <= moment <= end


@dataclass
class SoakReport:
    requests: int
    seconds: float
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    rss_mb: dict[str, tuple[float, float]] = field(default_factory=dict)
    restarts: int = 0
    abort_posts: Counter = field(default_factory=Counter)  # answers to the flood's posts
    engine_restarts: list[str] = field(default_factory=list)  # outside the planned kills

    @property
    def passed(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        lines = [
            f"{self.requests} requests in {self.seconds:.0f} s, {self.restarts} worker restarts",
            "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
            "abort_room flood: " + ", ".join(f"{k} {v}" for k, v in self.abort_posts.items()),
            f"engine restarts outside the planned kills: {len(self.engine_restarts)}",
        ]
        for name, (warm, end) in sorted(self.rss_mb.items()):
            lines.append(f"RSS {name}: {warm:.0f} MB after warm-up, {end:.0f} MB at the end")
        lines += [f"PROBLEM: {p}" for p in self.problems[:20]]
        lines.append("PASSED" if self.passed else f"FAILED ({len(self.problems)} problems)")
        return "\n".join(lines)


# ---- processes ------------------------------------------------------------------------


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").rstrip("\0").split("\0")
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            found.append(int(entry))
    return found


def server_pid(port: int) -> int | None:
    """The `pdserve ... --port PORT` process (a worker's or the router's front end)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            argv = _cmdline(int(entry))
            if "pdserve.cli" in argv and "--port" in argv and argv[-1] == str(port):
                return int(entry)
    return None


def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its direct children (the worker's engine process)."""
    total_kb = 0
    for member in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{member}/status") as f:
                match = re.search(r"VmRSS:\s+(\d+)", f.read())
        except OSError:
            continue
        total_kb += int(match.group(1)) if match else 0
    return total_kb / 1024


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def rss_of(url: str) -> float:
    pid = server_pid(port_of(url))
    return tree_rss_mb(pid) if pid is not None else 0.0


# ---- the launch -----------------------------------------------------------------------


class Launched:
    def __init__(self, model_path: str, num_prefill: int, num_decode: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "pdserve.cli", "--log-level", "warning", "launch"]
        command += ["--model-path", model_path, "--device", "cpu", "--port", str(self.port)]
        command += ["--num-prefill", str(num_prefill), "--num-decode", str(num_decode)]
        command += ["--max-model-len", "512", "--max-restarts", "3"]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(240):
            self.close()
            raise RuntimeError("pdserve launch did not get ready in 240 s")

    def _read(self) -> None:
        for line in self.process.stdout:
            if "pdserve is ready at" in line:
                self._ready.set()

    def workers(self) -> dict[str, list[dict]]:
        return httpx.get(self.url + "/workers", timeout=10).json()

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._reader.join(10)  # EOF once the launcher (the pipe's only writer) is gone
        self.process.stdout.close()


def worker_state(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]


def idle(url: str) -> bool:
    try:
        state = worker_state(url)
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    busy = ("kv_pages_used", "num_running", "num_waiting", "num_bootstrapping")
    busy += ("num_prealloc", "num_transferring", "num_prefilling")
    return all(state.get(key, 0) == 0 for key in busy)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# ---- one request ----------------------------------------------------------------------


def make_request(i: int) -> tuple[str, dict, bool, float | None]:
    """(path, body, valid, abort_after_s) for request i, reproducible from i."""
    rng = random.Random(i)
    if rng.random() < INVALID_SHARE:
        return "/v1/completions", dict(rng.choice(INVALID_BODIES)), False, None
    prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, 200))]
    sampling: dict = {"max_tokens": rng.randint(1, 24)}
    if rng.random() < 0.5:
        sampling["temperature"] = 0
    else:
        sampling.update(temperature=rng.uniform(0.3, 1.5), top_p=rng.uniform(0.5, 1.0))
        sampling.update(top_k=rng.choice([-1, 5, 50]), seed=rng.randrange(2**31))
    if rng.random() < 0.2:
        sampling["logprobs"] = rng.randint(0, 3)
    kind = rng.randrange(3)
    if kind == 0:
        params = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in sampling.items()}
        params.pop("logprobs", None)
        body = {"input_ids": prompt, "sampling_params": params}
        path = "/generate"
    elif kind == 1:
        body, path = {"prompt": prompt, **sampling}, "/v1/completions"
    else:
        sampling.pop("logprobs", None)
        content = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randint(1, 80)))
        body = {"messages": [{"role": "user", "content": content}], **sampling}
        path = "/v1/chat/completions"
    body["stream"] = rng.random() < 0.5
    abort_after = rng.uniform(0.0, 0.5) if rng.random() < ABORT_SHARE else None
    return path, body, True, abort_after


def send(client: httpx.Client, base: str, i: int) -> Outcome:
    path, body, valid, abort_after = make_request(i)
    started = time.monotonic()
    read_timeout = abort_after if abort_after is not None else REQUEST_DEADLINE_S
    timeout = httpx.Timeout(REQUEST_DEADLINE_S, read=read_timeout)
    try:
        with client.stream("POST", base + path, json=body, timeout=timeout) as response:
            status = response.status_code
            events = []
            chunks = []
            for line in response.iter_lines():
                if time.monotonic() - started > REQUEST_DEADLINE_S:
                    return Outcome("failed", started, f"request {i} ran past its deadline")
                if abort_after is not None and time.monotonic() - started > abort_after:
                    return Outcome("aborted", started)
                chunks.append(line)
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.ReadTimeout:
        if abort_after is not None:
            return Outcome("aborted", started)
        return Outcome("failed", started, f"request {i} got no byte for {read_timeout:.0f} s")
    except httpx.TransportError as e:
        return Outcome("unavailable", started, f"request {i}: {type(e).__name__}")
    if not valid:
        kind = "rejected" if status == 400 else "failed"
        return Outcome(kind, started, f"invalid body {body} got {status}")
    if status in (429, 503):
        return Outcome("unavailable", started, f"request {i}: {status}")
    if status != 200:
        return Outcome("failed", started, f"request {i} got {status}: {''.join(chunks)[:200]}")
    if body.get("stream"):
        if events[-1:] != ["[DONE]"] or any('"error"' in e for e in events):
            return Outcome("unavailable", started, f"request {i}: stream ended with an error")
    elif "error" in json.loads("".join(chunks)):
        return Outcome("failed", started, f"request {i}: 200 with an error body")
    return Outcome("ok", started)


# ---- the soak -------------------------------------------------------------------------


def run_soak(
    model_path: str,
    num_requests: int,
    *,
    concurrency: int = 16,
    num_prefill: int = 2,
    num_decode: int = 2,
    kills: tuple[str, ...] = ("prefill", "decode"),
) -> SoakReport:
    launched = Launched(model_path, num_prefill, num_decode)
    report = SoakReport(num_requests, 0.0)
    disruptions: list[Disruption] = []
    flood = watch = None
    try:
        pools = launched.workers()
        urls = {f"{role} {k}": w["url"] for role in pools for k, w in enumerate(pools[role])}
        watch = EngineWatch(dict(urls), lambda url: server_pid(port_of(url))).start()
        flood = AbortFlood(list(urls.values())).start()
        urls["router"] = launched.url
        warm_up = max(1, num_requests // 10)
        # NOTE: kill k at (2 + 2k)/8 of the requests; the killed worker must be back in
        # rotation 1/8 later (a gate); from a gate to the next kill nothing may need a retry.
        kill_at = {num_requests * (2 + 2 * k) // 8: role for k, role in enumerate(kills)}
        rejoin_gates = {at + num_requests // 8 for at in kill_at}
        rss_warm: dict[str, float] = {}
        retries_since_rejoin: float | None = None
        started = time.monotonic()
        slots = threading.BoundedSemaphore(concurrency * 2)  # bounds the backlog
        with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
            futures = []
            for i in range(num_requests):
                if i == warm_up:
                    rss_warm = {name: rss_of(url) for name, url in urls.items()}
                if i in rejoin_gates:
                    _wait_rejoined(launched, disruptions, report)
                    for future in futures:  # requests sent while a worker was down
                        future.result()
                    retries_since_rejoin = router_retries(launched.url)
                if i in kill_at:
                    _check_no_retries(launched.url, retries_since_rejoin, report)
                    if kill_at[i] == "prefill":
                        # NOTE: killed while no room is in flight, so its decode peers see no
                        # silence and must notice the restart by the new process's identity.
                        for future in futures:
                            future.result()
                    disruptions.append(_kill(urls[f"{kill_at[i]} 0"], report, watch))
                slots.acquire()
                future = pool.submit(send, client, launched.url, i)
                future.add_done_callback(lambda _: slots.release())
                futures.append(future)
            outcomes = [f.result() for f in futures]
        _stop_hostile(flood, watch, report)
        _check_no_retries(launched.url, retries_since_rejoin, report)
        report.seconds = time.monotonic() - started
        _judge(outcomes, disruptions, report)
        _check_end_state(urls, rss_warm, report)
        for role in kills:
            _check_rejoined(urls[f"{role} 0"], num_requests * 3 // 8 // len(pools[role]), report)
    finally:
        for hostile in (flood, watch):
            if hostile is not None:
                hostile.stop()  # NOTE: once stopped (`_stop_hostile`), nothing more is done
        launched.close()
    return report


def _stop_hostile(flood: AbortFlood, watch: EngineWatch, report: SoakReport) -> None:
    """End the abort flood and the engine watch; what they found goes to the report."""
    flood.stop()
    watch.stop()
    report.abort_posts = flood.answers
    report.engine_restarts = watch.restarts
    report.problems += flood.problems() + watch.restarts


def _kill(url: str, report: SoakReport, watch: EngineWatch) -> Disruption:
    pid = server_pid(port_of(url))
    if pid is None:
        report.problems.append(f"no process found for {url}")
        return Disruption(url, time.monotonic(), time.monotonic())
    watch.killed(pid)
    os.killpg(pid, signal.SIGKILL)
    report.restarts += 1
    disruption = Disruption(url, time.monotonic())
    threading.Thread(target=_mark_healthy, args=(url, pid, disruption), daemon=True).start()
    return disruption


def _mark_healthy(url: str, killed_pid: int, disruption: Disruption) -> None:
    """Stamp when the restarted process (a new pid on the same port) answers healthy."""

    def restarted() -> bool:
        return server_pid(port_of(url)) not in (None, killed_pid) and healthy(url)

    try:
        wait_until(restarted, f"{url} to restart", 180, poll_s=0.2)
    except AssertionError:
        return  # NOTE: left unstamped: _wait_rejoined reports it
    disruption.healthy_at = time.monotonic()


def _wait_rejoined(launched: Launched, disruptions: list[Disruption], report) -> None:
    """Every killed worker restarted, healthy, and back in the router's rotation."""

    def in_rotation(url: str) -> bool:
        pools = launched.workers()
        return any(w["url"] == url and w["healthy"] for pool in pools.values() for w in pool)

    for d in disruptions:
        try:
            wait_until(lambda d=d: d.healthy_at is not None, f"{d.url} to restart", 180, poll_s=0.2)
            wait_until(lambda d=d: in_rotation(d.url), f"{d.url} back in rotation", 30, poll_s=0.2)
        except AssertionError as e:
            report.problems.append(str(e))


def router_retries(router_url: str) -> float:
    metrics = httpx.get(router_url + "/metrics", timeout=10).text
    return _counter(metrics, "pdserve_router:retries_total")


def _check_no_retries(router_url: str, since: float | None, report: SoakReport) -> None:
    """Once every killed worker is back, no request needs a retry: a retry hides a failure
    (a decode worker that cannot talk to a restarted prefill worker, say) from the client."""
    if since is None:
        return
    retries = router_retries(router_url) - since
    if retries:
        report.problems.append(f"{retries:.0f} router retries with every worker in rotation")


def _check_rejoined(url: str, fair_share: int, report: SoakReport) -> None:
    """A restarted worker took part after its restart: it completed at least a quarter of its
    share of the last 3/8 of the requests (its counters start at zero with the new process)."""
    try:
        done = _counter(httpx.get(url + "/metrics", timeout=10).text, "pdserve:kv_transfers_total")
    except httpx.HTTPError as e:
        report.problems.append(f"{url} unreachable at the end: {e}")
        return
    if done < fair_share / 4:
        report.problems.append(
            f"{url} completed {done:.0f} transfers after its restart; its share of the last "
            f"3/8 of the requests was {fair_share}"
        )


def _counter(metrics: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def _judge(outcomes: list[Outcome], disruptions: list[Disruption], report: SoakReport) -> None:
    for outcome in outcomes:
        report.outcomes[outcome.kind] += 1
        if outcome.kind == "failed":
            report.problems.append(outcome.detail)
        elif outcome.kind == "unavailable" and not any(
            d.covers(outcome.started) for d in disruptions
        ):
            report.problems.append(f"outside any restart: {outcome.detail}")


def _check_end_state(urls, rss_warm, report: SoakReport) -> None:
    for name, url in urls.items():
        if name == "router":
            continue
        try:
            wait_until(lambda url=url: idle(url), f"{name} to free every page", 60, poll_s=0.2)
        except AssertionError as e:
            report.problems.append(f"{e}: {worker_state(url) if healthy(url) else 'down'}")
    for name, url in urls.items():
        end = rss_of(url)
        report.rss_mb[name] = (rss_warm.get(name, 0.0), end)
        if name.endswith(" 0") and name != "router":
            continue  # restarted: its warm-up figure is of the process that was killed
        if end - rss_warm.get(name, end) > RSS_GROWTH_BOUND_MB:
            report.problems.append(
                f"{name} grew from {rss_warm[name]:.0f} MB to {end:.0f} MB "
                f"(bound {RSS_GROWTH_BOUND_MB:.0f} MB)"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in tiny model")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    model_path = args.model_path
    if model_path is None:
        from pdserve.synthetic.tiny_model import default_model_dir

        model_path = str(default_model_dir())
    report = run_soak(model_path, args.requests, concurrency=args.concurrency)
    print(report.summary(), flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
