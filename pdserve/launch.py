"""`pdserve launch`: a whole disaggregated deployment on this machine.

Starts the prefill and decode workers, waits until they are healthy, starts the router in
front, prints its URL, the workers' and a ready-to-paste curl command, and stops everything
on Ctrl-C or SIGTERM. Every flag a worker or the router takes is handed on to it, rebuilt from
the settings it parsed to (`protocol.flags.to_argv`); secrets go through the environment.

Each child's output goes to its own log file and, prefixed with its name, to this process's
stderr; a child that fails to start is reported as one line naming it, its URL, the cause
(its last error line) and its log. A child that exits later is restarted on the same ports,
as a container supervisor would (`--max-restarts` within `RESTART_WINDOW_S`; past that
everything stops): the router's health checks take it out of rotation and put it back, and
decode workers re-register with a restarted prefill worker. Every child runs in its own
process group and exits by itself if this process dies (`PDSERVE_EXIT_WITH_PARENT`), so
nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import httpx

from pdserve.engine.core.config import EngineConfig
from pdserve.engine.runtime.cpu_threads import default_cpu_threads
from pdserve.protocol.flags import option, secret_env, to_argv
from pdserve.protocol.http_settings import WORKER_ONLY, HttpSettings
from pdserve.protocol.restart_budget import RestartBudget
from pdserve.router.config import RouterConfig
from pdserve.server.local_process import LocalServer, ServerStartError, free_port
from pdserve.transfer.backends import make_backend
from pdserve.transfer.config import TransferConfig

RESTART_WINDOW_S = 600.0
# A --gpus entry: an index (as CUDA_VISIBLE_DEVICES takes it) or a GPU/MIG UUID.
GPU_ID = re.compile(r"\d+|(GPU|MIG)-[0-9A-Za-z/-]+")


@dataclass(frozen=True)
class LaunchConfig:
    num_prefill: int = option(1, "prefill workers")
    num_decode: int = option(1, "decode workers")
    gpus: tuple[str, ...] | None = option(
        None,
        "comma-separated GPU ids; each worker (prefill first) takes the next run of as many "
        "as its TP size, wrapping around",
        separator=",",
    )
    prefill_tp_size: int | None = option(
        None, "tensor-parallel ranks of each prefill worker (default: --tp-size)"
    )
    decode_tp_size: int | None = option(
        None, "tensor-parallel ranks of each decode worker (default: --tp-size)"
    )
    start_timeout: float = option(600.0, "seconds to wait for healthy workers")
    max_restarts: int = option(
        3,
        "restart a worker or the router that exits, on the same ports, at most this many "
        "times in 10 minutes; past that, stop everything (0: stop at the first exit)",
    )
    check: bool = option(
        False, "send the example request through the router, print the answer, stop everything"
    )
    log_dir: str | None = option(
        None, "where each process's log file goes (default: a new temporary directory)"
    )

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("--num-prefill and --num-decode must be at least 1")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.start_timeout <= 0:
            raise ValueError(f"--start-timeout must be positive, got {self.start_timeout}")
        for name, size in (("prefill", self.prefill_tp_size), ("decode", self.decode_tp_size)):
            if size is not None and size < 1:
                raise ValueError(f"--{name}-tp-size must be >= 1, got {size}")
        if self.gpus is not None and not all(GPU_ID.fullmatch(gpu) for gpu in self.gpus or ("",)):
            raise ValueError(
                f"--gpus {','.join(self.gpus)!r}: each GPU id is an index (0,1) or a "
                "GPU-/MIG- UUID, as CUDA_VISIBLE_DEVICES takes them"
            )


@dataclass(frozen=True)
class LaunchPlan:
    """Everything launch starts, as settings: `http` is the router's (its port) and what the
    workers share with it (API key, shutdown timeout, model name, queue bound); `router`
    holds the router's flags (its workers are filled in at start)."""

    launch: LaunchConfig
    http: HttpSettings
    engine: EngineConfig
    transfer: TransferConfig
    router: dict
    log_level: str
    split_gpu_memory: bool = True

    def __post_init__(self) -> None:
        gpus, largest = self.launch.gpus, max(self.worker_tp_sizes)
        if gpus and largest > len(gpus):
            raise ValueError(
                f"a worker at TP {largest} needs {largest} GPUs; --gpus names {len(gpus)}"
            )
        if self.transfer.backend == "nccl":
            self._check_nccl_gpus()
        make_backend(self.transfer).check_tensor_parallel(largest, f"a worker at TP {largest}")

    def _check_nccl_gpus(self) -> None:
        """Over nccl each prefill rank is linked to decode ranks by an NCCL group of two,
        which cannot join two processes on one GPU: no prefill worker may share a GPU with a
        decode worker."""
        fix = "give --gpus enough GPUs for every worker's ranks, or --transfer-backend tcp"
        if not self.launch.gpus:
            raise ValueError(
                f"--transfer-backend nccl needs --gpus (else all workers share GPUs): {fix}"
            )
        num_prefill = self.launch.num_prefill
        for k in range(num_prefill):
            for j in range(num_prefill, len(self.worker_tp_sizes)):
                shared = sorted(set(self.worker_gpus(k)) & set(self.worker_gpus(j)))
                if shared:
                    raise ValueError(
                        f"--transfer-backend nccl cannot link two processes on one GPU: prefill "
                        f"worker {k} and decode worker {j - num_prefill} would share GPU "
                        f"{','.join(shared)}; {fix}"
                    )

    def tp_size(self, kind: str) -> int:
        """A prefill or decode worker's TP size: its role's flag, else --tp-size."""
        own = self.launch.prefill_tp_size if kind == "prefill" else self.launch.decode_tp_size
        return own or self.engine.tp_size

    @property
    def worker_tp_sizes(self) -> list[int]:
        """Every worker's TP size, prefill workers first."""
        launch = self.launch
        return [self.tp_size("prefill")] * launch.num_prefill + [
            self.tp_size("decode")
        ] * launch.num_decode

    def worker_gpus(self, k: int) -> tuple[str, ...]:
        """Worker k's GPUs (prefill workers first): the next run of as many `--gpus` ids as
        its TP size after the earlier workers' runs, wrapping around; () without `--gpus`."""
        gpus, sizes = self.launch.gpus or (), self.worker_tp_sizes
        start = sum(sizes[:k])
        return tuple(gpus[(start + i) % len(gpus)] for i in range(sizes[k])) if gpus else ()

    @property
    def cpu_threads(self) -> int:
        """Each engine process's torch threads on CPU: every worker's ranks share this
        machine's cores (less one for the front ends and the router, `engine.cpu_threads`)."""
        return default_cpu_threads(sum(self.worker_tp_sizes))

    def worker_argv(self, kind: str, sharing: int = 1) -> list[str]:
        """sharing: workers on this worker's GPU. Unless --gpu-memory-utilization was given,
        they split its share of the GPU's memory evenly, so `pdserve launch` works on one GPU."""
        skip = ("bootstrap_port",) if kind == "decode" else ("bootstrap_port", "bootstrap_allow")
        engine = dataclasses.replace(
            self.engine,
            tp_size=self.tp_size(kind),
            cpu_threads=self.engine.cpu_threads or self.cpu_threads,
        )
        if self.split_gpu_memory and sharing > 1:
            share = round(engine.gpu_memory_utilization / sharing, 4)
            engine = dataclasses.replace(engine, gpu_memory_utilization=share)
        argv = [kind, "--model-path", engine.model_path, *to_argv(engine)]
        if self.engine.speculative is not None:
            argv += to_argv(self.engine.speculative)
        argv += to_argv(self.http, skip=("host", "port"))
        return argv + to_argv(self.transfer, skip=skip)

    def router_argv(self, prefill: list[tuple[str, int]], decode: list[str]) -> list[str]:
        config = RouterConfig(prefill=tuple(prefill), decode=tuple(decode), **self.router)
        argv = ["router", *to_argv(self.http, skip=("host", "port", *WORKER_ONLY))]
        argv += ["--prefill-policy", config.prefill_policy]
        argv += ["--decode-policy", config.decode_policy, *to_argv(config)]
        for url, port in prefill:
            argv += ["--prefill", url, str(port)]
        for url in decode:
            argv += ["--decode", url]
        return argv

    @property
    def child_env(self) -> dict[str, str]:
        """The secrets, handed on through the environment (never on a command line)."""
        return {**secret_env(self.http), **secret_env(self.transfer)}


class Deployment:
    """The children of one launch: workers first, the router last; stopped in reverse."""

    def __init__(self, plan: LaunchPlan, log_dir: str) -> None:
        self.plan = plan
        self.log_dir = log_dir
        self.children: list[tuple[str, LocalServer]] = []
        self._budgets: dict[str, RestartBudget] = {}
        self._echo_lock = threading.Lock()

    def start(self, name: str, argv: list[str], port: int, env: dict[str, str]) -> LocalServer:
        server = LocalServer(
            argv,
            port=port,
            host=self.plan.http.host,
            log_level=self.plan.log_level,
            env={**self.plan.child_env, **env},
            log_path=os.path.join(self.log_dir, name.replace(" ", "-") + ".log"),
            echo=lambda line, name=name: self._echo(name, line),
        )
        self.children.append((name, server))
        return server

    def _echo(self, name: str, line: str) -> None:
        with self._echo_lock:
            sys.stderr.write(f"[{name}] {line}")
            sys.stderr.flush()

    def wait_healthy(self, deadline_s: float) -> None:
        for name, server in self.children:
            try:
                server.wait_healthy(deadline_s)
            except ServerStartError as e:
                raise ServerStartError(f"{name} ({server.url}) {e}") from None

    def supervise(self) -> str | None:
        """Restart every child that exited; return why the deployment must stop instead (a
        child that exited more often than its restart budget allows), else None."""
        max_restarts = self.plan.launch.max_restarts
        for name, server in self.children:
            code = server.process.poll()
            if code is None:
                continue
            if name not in self._budgets:
                self._budgets[name] = RestartBudget(max_restarts, RESTART_WINDOW_S)
            if not self._budgets[name].take(time.monotonic()):
                return (
                    f"{name} exited with code {code} (restarted {max_restarts} times within "
                    f"{RESTART_WINDOW_S:.0f} s already; log: {server.log_path})"
                )
            print(f"{name} exited with code {code}; restarting it", file=sys.stderr, flush=True)
            server.restart()
        return None

    def stop(self) -> None:
        for _, server in reversed(self.children):
            server.stop()


def launch(plan: LaunchPlan) -> int:
    config = plan.launch
    log_dir = config.log_dir or tempfile.mkdtemp(prefix="pdserve-launch-")
    os.makedirs(log_dir, exist_ok=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    deployment = Deployment(plan, log_dir)
    try:
        print(
            f"starting {config.num_prefill} prefill + {config.num_decode} decode workers "
            f"(logs in {log_dir}) ...",
            flush=True,
        )
        router_argv = _start_workers(deployment)
        deployment.wait_healthy(config.start_timeout)
        router = deployment.start("router", router_argv, plan.http.port, {})
        router.wait_healthy(60)
        _print_ready(deployment, router.url)
        if config.check:
            return _check(router.url, plan.http.api_key)
        while not stop.is_set():
            failure = deployment.supervise()
            if failure is not None:
                print(f"error: {failure}; stopping everything", file=sys.stderr)
                return 1
            stop.wait(0.5)
        print("stopping ...")
        return 0
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        deployment.stop()


def _start_workers(deployment: Deployment) -> list[str]:
    """Start every worker; return the router's arguments naming them."""
    plan, config = deployment.plan, deployment.plan.launch
    host = plan.http.host
    prefill, decode = [], []
    total = config.num_prefill + config.num_decode
    for k in range(total):
        kind = "prefill" if k < config.num_prefill else "decode"
        index = k if kind == "prefill" else k - config.num_prefill
        # NOTE: without --gpus every worker takes the first GPUs (all of them share them).
        mine = set(plan.worker_gpus(k))
        sharing = sum(bool(mine & set(plan.worker_gpus(j))) or not mine for j in range(total))
        argv = plan.worker_argv(kind, sharing)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(plan.worker_gpus(k))} if config.gpus else {}
        if kind == "prefill":
            bootstrap_port = free_port(host)
            argv += ["--bootstrap-port", str(bootstrap_port)]
        server = deployment.start(f"{kind} {index}", argv, free_port(host), env)
        if kind == "prefill":
            prefill.append((server.url, bootstrap_port))
        else:
            decode.append(server.url)
    return plan.router_argv(prefill, decode)


EXAMPLE = {"prompt": "Hello, my name is", "max_tokens": 32, "temperature": 0}


def _print_ready(deployment: Deployment, url: str) -> None:
    lines = [f"\npdserve is ready at {url}"]
    for name, server in deployment.children:
        lines.append(f"  {name:<10} {server.url}  log: {server.log_path}")
    key = deployment.plan.http.api_key
    auth = ""
    if key:
        shown = "$PDSERVE_API_KEY" if os.environ.get("PDSERVE_API_KEY") == key else "<--api-key>"
        auth = f' -H "Authorization: Bearer {shown}"'
    lines += [
        "try:",
        f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} \\",
        f"    -d '{json.dumps(EXAMPLE)}'",
        "Ctrl-C stops everything.\n",
    ]
    print("\n".join(lines), flush=True)


def _check(url: str, api_key: str | None) -> int:
    """--check: send the example request through the router, print the answer, stop."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.post(url + "/v1/completions", json=EXAMPLE, headers=headers, timeout=120)
    print(f"check: HTTP {response.status_code}: {response.text}", flush=True)
    return 0 if response.status_code == 200 else 1


def watch_parent() -> None:
    """Exit (SIGTERM to ourselves) when the launching process is gone, if asked to."""
    expected = os.environ.get("PDSERVE_EXIT_WITH_PARENT")
    if not expected:
        return

    def watch() -> None:
        while os.getppid() == int(expected):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def replace_served_name(http: HttpSettings, name: str) -> HttpSettings:
    """The model name every worker serves: --served-model-name, else `name`."""
    return dataclasses.replace(http, served_model_name=http.served_model_name or name)
