"""`pdserve launch` run by tests: the whole deployment as one process group, ready once it
prints its URL, always killed afterwards."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx

from pdserve.server.local_process import free_port
from tests.waiting import wait_until

START_DEADLINE_S = 180.0


class Launch:
    def __init__(self, model_path: str, *extra: str):
        self.port = free_port()
        command = [sys.executable, "-m", "pdserve.cli", "--log-level", "warning", "launch"]
        command += ["--model-path", model_path, "--device", "cpu", "--port", str(self.port)]
        self.process = subprocess.Popen(
            [*command, *extra],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = self._wait_ready()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def _wait_ready(self) -> str:
        while True:
            try:
                line = self.lines.get(timeout=START_DEADLINE_S)
            except queue.Empty:
                self.kill()
                raise AssertionError("pdserve launch printed nothing ready in time") from None
            match = re.search(r"pdserve is ready at (\S+)", line)
            if match:
                return match.group(1)

    def worker_urls(self) -> list[str]:
        metrics = httpx.get(self.url + "/metrics", timeout=10).text
        return sorted(set(re.findall(r'worker_healthy\{role="\w+",url="([^"]+)"', metrics)))

    def wait_workers_idle(self, workers: list[str] | None = None) -> None:
        """Every worker: no KV page in use and no transfer under way."""
        for url in workers if workers is not None else self.worker_urls():

            def idle(url=url) -> bool:
                state = httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]
                return state["kv_pages_used"] == 0 and state["num_transferring"] == 0

            wait_until(idle, f"{url} to free every page")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        self._reader.join(10)  # EOF once the launcher (the pipe's only writer) is gone
        self.process.stdout.close()
