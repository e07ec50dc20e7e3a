"""The two deployments pd_goodput.py compares, each on the same two devices, as context
managers that stop every process they started (router first, then the workers), whatever
happens inside them.

- disaggregated: `pdserve prefill` on devices[0], `pdserve decode` on devices[1], KV over the
  given transfer backend, `pdserve router` (PD mode) in front;
- colocated: `pdserve serve` on devices[0] and on devices[1], `pdserve router --worker-urls
  A B --policy round_robin` in front.

Every child writes its own log under `log_dir`; a child that fails to start raises
`ServerStartError` naming its last error line and log.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.server.local_process import LocalServer, free_port

DEPLOYMENTS = ("disaggregated", "colocated")
ROUTER_START_S = 120.0
CPU_KV_CACHE_BYTES = 1 << 28  # a CPU worker's KV pool; on a GPU, its memory share sizes it
STOP_S = 60.0
# /server_info counters that are 0 on a worker with nothing to do.
BUSY_COUNTERS = (
    "num_running",
    "num_waiting",
    "kv_pages_used",
    "num_bootstrapping",
    "num_prealloc",
    "num_transferring",
    "num_prefilling",
)


@dataclass(frozen=True)
class DeploymentSpec:
    model_path: str
    devices: tuple[str, str]
    transfer_backend: str
    engine_args: tuple[str, ...]  # every worker's, after the model and device
    log_dir: Path
    start_timeout_s: float
    # Without a router that has --worker-urls, a single `serve` stands in for the colocated
    # pair (CPU smoke runs only: the comparison is then not the fair one).
    single_colocated_replica: bool = False


@dataclass
class Deployment:
    name: str
    url: str  # where requests go: the router, or the single replica
    workers: list[LocalServer]
    description: str
    notes: list[str] = field(default_factory=list)

    def worker_info(self) -> list[dict]:
        """Each worker's role, device, dtype and KV capacity, from its /server_info."""
        found = []
        for worker in self.workers:
            info = httpx.get(worker.url + "/server_info", timeout=10).json()
            keep = ("role", "device", "dtype", "max_total_num_tokens", "max_model_len")
            found.append({key: info.get(key) for key in keep} | {"url": worker.url})
        return found

    def wait_idle(self, deadline_s: float) -> str | None:
        """Wait until no worker has anything running, queued, in transfer or any KV page
        held (cut-off requests are being aborted); None once idle, else what was still busy
        at the deadline."""
        deadline = time.monotonic() + deadline_s
        while True:
            busy = {}
            for worker in self.workers:
                state = httpx.get(worker.url + "/server_info", timeout=10).json()
                counters = state["internal_states"][0]
                held = {key: counters[key] for key in BUSY_COUNTERS if counters.get(key)}
                if held:
                    busy[worker.url] = held
            if not busy:
                return None
            if time.monotonic() > deadline:
                return f"still busy after {deadline_s:.0f} s: {busy}"
            time.sleep(0.2)


def router_has_worker_urls() -> bool:
    """Whether this pdserve's router takes --worker-urls (colocated mode)."""
    command = [sys.executable, "-m", "pdserve.cli", "router", "--help"]
    text = subprocess.run(command, capture_output=True, text=True, timeout=120).stdout
    return "--worker-urls" in text


@contextlib.contextmanager
def deploy(name: str, spec: DeploymentSpec) -> Iterator[Deployment]:
    """Start deployment `name` (DEPLOYMENTS), wait until it is healthy, yield it, stop it."""
    if name not in DEPLOYMENTS:
        raise ValueError(f"unknown deployment {name!r}; choose from {', '.join(DEPLOYMENTS)}")
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:

        def start(label: str, role_args: Sequence[str]) -> LocalServer:
            log = spec.log_dir / f"{name}-{label}.log"
            server = LocalServer(list(role_args), log_path=str(log))
            stack.callback(server.stop, timeout_s=STOP_S)
            return server

        if name == "disaggregated":
            yield _disaggregated(spec, start)
        else:
            yield _colocated(spec, start)


def _worker_args(spec: DeploymentSpec, role: str, device: str) -> list[str]:
    # NOTE: each worker has a GPU to itself, so the default --gpu-memory-utilization holds.
    cpu = ["--kv-cache-memory", str(CPU_KV_CACHE_BYTES)] if device == "cpu" else []
    return [role, "--model-path", spec.model_path, "--device", device, *cpu, *spec.engine_args]


def _disaggregated(spec: DeploymentSpec, start) -> Deployment:
    bootstrap = free_port()
    transfer = ["--transfer-backend", spec.transfer_backend]
    prefill_device, decode_device = spec.devices
    prefill_args = [*_worker_args(spec, "prefill", prefill_device), *transfer]
    prefill = start("prefill", [*prefill_args, "--bootstrap-port", str(bootstrap)])
    decode = start("decode", [*_worker_args(spec, "decode", decode_device), *transfer])
    for worker in (prefill, decode):  # started together, so they load at the same time
        worker.wait_healthy(deadline_s=spec.start_timeout_s)
    route = ["router", "--prefill", prefill.url, str(bootstrap), "--decode", decode.url]
    router = start("router", route)
    router.wait_healthy(deadline_s=ROUTER_START_S)
    description = (
        f"pdserve prefill on {prefill_device} + pdserve decode on {decode_device} "
        f"({spec.transfer_backend} KV transfer) behind pdserve router"
    )
    return Deployment("disaggregated", router.url, [prefill, decode], description)


def _colocated(spec: DeploymentSpec, start) -> Deployment:
    if spec.single_colocated_replica:
        device = spec.devices[0]
        replica = start("serve0", _worker_args(spec, "serve", device))
        replica.wait_healthy(deadline_s=spec.start_timeout_s)
        note = (
            "one pdserve serve replica, no router: this pdserve's router has no "
            "--worker-urls (smoke run only; not the fair two-replica baseline)"
        )
        return Deployment("colocated", replica.url, [replica], f"pdserve serve on {device}", [note])
    replicas = [
        start(f"serve{index}", _worker_args(spec, "serve", device))
        for index, device in enumerate(spec.devices)
    ]
    for replica in replicas:
        replica.wait_healthy(deadline_s=spec.start_timeout_s)
    urls = [replica.url for replica in replicas]
    router = start("router", ["router", "--worker-urls", *urls, "--policy", "round_robin"])
    router.wait_healthy(deadline_s=ROUTER_START_S)
    devices = " and ".join(spec.devices)
    description = f"pdserve serve on {devices} behind pdserve router (round robin)"
    return Deployment("colocated", router.url, replicas, description)
