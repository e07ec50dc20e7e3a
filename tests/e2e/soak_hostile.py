"""What the soak (`soak.py`) runs beside its requests: a flood of `/abort_room` posts with
random rooms to every worker (what any client reaching a worker, or any holder of the API
key, can send; bounded in rate, to loopback only), and a watch on every worker's engine
process, which may restart only with its worker, when the soak kills it.

An engine that dies is restarted by its worker under the same front end and the same port,
so requests see only a short 503; the watch is what tells such a death from a planned kill."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx

from pdserve.server.local_process import engine_pid_of

ABORT_FLOOD_PER_S = 20.0  # NOTE: all workers together; the soak's own load is ~16 requests
MAX_ROOM = (1 << 63) - 1  # a room id the workers take (`bootstrap_room`)
WATCH_POLL_S = 0.5


class AbortFlood:
    """Posts `/abort_room` for a random room to each worker in turn, `rate_per_s` in all,
    until stopped; counts the answers (a status, or the transport error's name)."""

    def __init__(self, urls: list[str], rate_per_s: float = ABORT_FLOOD_PER_S, seed: int = 0):
        self.urls = list(urls)
        self.interval_s = 1.0 / rate_per_s
        self.answers: Counter = Counter()
        self._rng = random.Random(seed)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abort-room-flood", daemon=True)

    def start(self) -> AbortFlood:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.ident is not None:  # NOTE: started
            self._thread.join(30)

    def problems(self) -> list[str]:
        """A post a worker did not take: any status but 200 (found or not) and 503 (a worker
        whose engine is down, which the engine watch judges)."""
        found = [
            f"/abort_room answered {answer} {n} times"
            for answer, n in self.answers.items()
            if isinstance(answer, int) and answer not in (200, 503)
        ]
        if not self.answers[200]:
            found.append(f"no /abort_room post was taken: {dict(self.answers)}")
        return found

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            for i in itertools.count():
                if self._stopped.wait(self.interval_s):
                    return
                url = self.urls[i % len(self.urls)]
                body = {"bootstrap_room": self._rng.randrange(MAX_ROOM + 1), "reason": "soak"}
                try:
                    answer: int | str = client.post(url + "/abort_room", json=body).status_code
                except httpx.HTTPError as e:  # NOTE: a worker the soak killed, restarting
                    answer = type(e).__name__
                self.answers[answer] += 1


class EngineWatch:
    """Every worker's (front end, engine) processes, polled every WATCH_POLL_S: a new engine
    under the same front end is an engine restart, a new front end a worker restart; both
    are problems but for a front end the soak killed (`killed`)."""

    def __init__(self, workers: dict[str, str], front_pid: Callable[[str], int | None]):
        """workers: name -> URL; front_pid: the pid of the front end serving a URL."""
        self.workers = dict(workers)
        self.front_pid = front_pid
        self.restarts: list[str] = []
        self._killed: set[int] = set()
        self._started = time.monotonic()
        self._known = {name: self._pids(url) for name, url in self.workers.items()}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)

    def start(self) -> EngineWatch:
        self._thread.start()
        return self

    def killed(self, front_pid: int) -> None:
        """The soak is about to kill this worker (its whole process group)."""
        self._killed.add(front_pid)

    def stop(self) -> None:
        """Stop polling, after a last look (once: a second stop does nothing)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread.ident is not None:  # NOTE: started
            self._thread.join(30)
        self.check()

    def check(self) -> None:
        for name, url in self.workers.items():
            pids, known = self._pids(url), self._known.get(name)
            if pids is None or pids == known:
                continue  # NOTE: down (killed, starting) or unchanged
            self._known[name] = pids
            if known is None:
                continue
            at = f"+{time.monotonic() - self._started:.0f} s"
            if pids[0] != known[0] and known[0] not in self._killed:
                self.restarts.append(f"{name} restarted at {at}, not killed by the soak")
            elif pids[0] == known[0]:
                self.restarts.append(
                    f"{name}'s engine restarted at {at} (pid {known[1]} -> {pids[1]})"
                )

    def _run(self) -> None:
        while not self._stopped.wait(WATCH_POLL_S):
            self.check()

    def _pids(self, url: str) -> tuple[int, int] | None:
        front = self.front_pid(url)
        if front is None:
            return None
        try:
            return front, engine_pid_of(front)
        except (LookupError, OSError):  # NOTE: its engine not started yet, or exiting
            return None
