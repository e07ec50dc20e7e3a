"""A disaggregated deployment on loopback for tests: prefill and decode workers (real
`pdserve prefill|decode` processes) and a `pdserve router` in front, started concurrently."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from pdserve.engine_process.hold_point import ENV as HOLD_ENV
from pdserve.server.local_process import LocalServer, free_port
from tests.e2e.conftest import START_DEADLINE_S, Server
from tests.waiting import wait_until

# Short transfer deadlines so failure tests end in seconds, not the 30 s default.
# Failures found within seconds, yet with room for a busy 2-core CI machine: heartbeats go
# every second, and a peer timeout of 2 s (two missed beats) once failed live rooms there.
FAST_FAILURE = ("--transfer-timeout", "10", "--transfer-peer-timeout", "4")


@dataclass
class Cluster:
    model_path: str
    prefill: list[Server] = field(default_factory=list)
    decode: list[Server] = field(default_factory=list)
    router: Server | None = None
    bootstrap_ports: list[int] = field(default_factory=list)

    @property
    def workers(self) -> list[Server]:
        return [*self.prefill, *self.decode]

    def stop(self) -> None:
        for server in [self.router, *self.workers]:
            if server is not None:
                server.local.stop()

    def state(self, worker: Server) -> dict:
        """The worker's engine counters (pages in use, queue sizes) from /server_info."""
        return worker.get("/server_info").json()["internal_states"][0]

    def states(self) -> dict[str, object]:
        """Every worker's engine counters by role and URL (a `describe` for wait_until); a
        worker that does not answer shows why instead."""
        found: dict[str, object] = {}
        for role, servers in (("prefill", self.prefill), ("decode", self.decode)):
            for worker in servers:
                try:
                    found[f"{role} {worker.url}"] = self.state(worker)
                except Exception as e:
                    exited = worker.process.poll()
                    found[f"{role} {worker.url}"] = f"{type(e).__name__}: {e} (exit {exited})"
        return found

    def wait_all_free(self, deadline_s: float = 20.0) -> None:
        """Every live worker: no KV page in use, nothing queued, running or in transfer."""
        for worker in self.workers:
            if worker.process.poll() is not None:
                continue

            def idle(worker=worker) -> bool:
                s = self.state(worker)
                busy = ("kv_pages_used", "num_running", "num_waiting", "num_bootstrapping")
                busy += ("num_prealloc", "num_transferring", "num_prefilling", "num_held_back")
                return all(s.get(key, 0) == 0 for key in busy)

            wait_until(idle, f"{worker.url} to free every page", deadline_s, describe=self.states)


@dataclass
class PendingCluster:
    """Processes started, not yet healthy: start several clusters, then wait for each."""

    cluster: Cluster
    prefill: list[LocalServer]
    decode: list[LocalServer]
    router_args: tuple[str, ...]
    logs: _Logs = field(default_factory=lambda: _Logs(None))

    def ready(self) -> Cluster:
        cluster = self.cluster
        try:
            cluster.prefill = [_healthy(s, cluster.model_path) for s in self.prefill]
            cluster.decode = [_healthy(s, cluster.model_path) for s in self.decode]
            route = ["router", "--health-check-interval", "0.5", *self.router_args]
            for server, port in zip(cluster.prefill, cluster.bootstrap_ports, strict=True):
                route += ["--prefill", server.url, str(port)]
            for server in cluster.decode:
                route += ["--decode", server.url]
            router = LocalServer(route, **self.logs.of("router"))
            cluster.router = _healthy(router, cluster.model_path)
        except BaseException:
            for local in [*self.prefill, *self.decode]:
                local.stop()
            raise
        return cluster


def _healthy(local: LocalServer, model_path: str) -> Server:
    return Server(local.wait_healthy(START_DEADLINE_S), model_path)


def begin_cluster(
    model_path: str,
    *,
    backend: str = "tcp",
    num_prefill: int = 1,
    num_decode: int = 1,
    worker_args: tuple[str, ...] = (),
    prefill_args: tuple[str, ...] = (),
    decode_args: tuple[str, ...] = (),
    router_args: tuple[str, ...] = (),
    log_dir: str | None = None,
    prefill_env: dict[str, str] | None = None,
) -> PendingCluster:
    """log_dir: every process logs at debug level to `log_dir/<name>.log` (prefill-0,
    decode-0, router) instead of to this process's output. prefill_env: extra environment
    for the prefill workers (a test hold point: pdserve/engine_process/hold_point.py)."""
    cluster = Cluster(model_path)
    logs = _Logs(log_dir)
    common = ["--model-path", model_path, "--device", "cpu", "--transfer-backend", backend]
    prefill, decode = [], []
    for i in range(num_prefill):
        port = free_port()
        cluster.bootstrap_ports.append(port)
        args = ["prefill", *common, "--bootstrap-port", str(port), *worker_args, *prefill_args]
        prefill.append(LocalServer(args, env=prefill_env, **logs.of(f"prefill-{i}")))
    for i in range(num_decode):
        args = ["decode", *common, *worker_args, *decode_args]
        decode.append(LocalServer(args, **logs.of(f"decode-{i}")))
    return PendingCluster(cluster, prefill, decode, router_args, logs)


@dataclass
class _Logs:
    log_dir: str | None

    def of(self, name: str) -> dict:
        """LocalServer's logging arguments for the process called `name`."""
        if self.log_dir is None:
            return {}
        return {"log_level": "debug", "log_path": f"{self.log_dir}/{name}.log"}


def start_cluster(model_path: str, **options) -> Cluster:
    return begin_cluster(model_path, **options).ready()


@dataclass
class PrefillHold:
    """A prefill worker's hold point (pdserve/engine_process/hold_point.py): once armed, its
    engine stops after the first step that computed part of a prompt, until released, so a
    test acts exactly mid-prefill (prefill with a chunk smaller than the prompt)."""

    directory: pathlib.Path

    @property
    def env(self) -> dict[str, str]:
        return {HOLD_ENV: f"prefill-started:{self.directory}"}

    def arm(self) -> None:
        (self.directory / "armed").touch()

    def wait(self, cluster: Cluster) -> None:
        """Until the prefill worker holds, and its decode worker waits for the KV."""
        wait_until((self.directory / "held").exists, "the prefill worker to hold mid-prefill")
        decode = cluster.decode[0]
        wait_until(lambda: cluster.state(decode)["num_transferring"] == 1, "decode to wait for KV")

    def release(self) -> None:
        (self.directory / "release").touch()
