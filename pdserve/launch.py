"""`pdserve launch`: a whole disaggregated deployment on this machine.

Starts the prefill and decode workers, waits until they are healthy, starts the router in
front, prints its URL and a ready-to-paste curl command, and stops everything on Ctrl-C or
SIGTERM. A child that exits is restarted on the same ports, as a container supervisor would
(`--max-restarts` within `RESTART_WINDOW_S`; past that everything stops): the router's health
checks take it out of rotation and put it back, and decode workers re-register with a restarted
prefill worker. Every child runs in its own process group and exits by itself if this process
dies (`PDSERVE_EXIT_WITH_PARENT`), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import httpx

from pdserve.server.local_process import LocalServer, ServerStartError, free_port
from pdserve.server.restart_budget import RestartBudget

ENGINE_FLAGS = (
    "dtype",
    "device",
    "page_size",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "max_running_requests",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "max_model_len",
    "seed",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
)


def engine_argv(args: argparse.Namespace, model_path: str) -> list[str]:
    argv = ["--model-path", model_path]
    for name in ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


RESTART_WINDOW_S = 600.0


class Deployment:
    """The children of one launch: workers first, the router last; stopped in reverse."""

    def __init__(self, max_restarts: int = 0) -> None:
        self.children: list[tuple[str, LocalServer]] = []
        self.max_restarts = max_restarts
        self._budgets: dict[str, RestartBudget] = {}

    def start(self, name: str, role_args: list[str], *, port: int | None, host: str, env=None):
        server = LocalServer(role_args, port=port, host=host, log_level="warning", env=env)
        self.children.append((name, server))
        return server

    def wait_healthy(self, deadline_s: float) -> None:
        for name, server in self.children:
            try:
                server.wait_healthy(deadline_s)
            except ServerStartError as e:
                raise ServerStartError(f"{name}: {e}") from None

    def supervise(self) -> str | None:
        """Restart every child that exited; return why the deployment must stop instead (a
        child that exited more often than its restart budget allows), else None."""
        for name, server in self.children:
            code = server.process.poll()
            if code is None:
                continue
            if name not in self._budgets:
                self._budgets[name] = RestartBudget(self.max_restarts, RESTART_WINDOW_S)
            budget = self._budgets[name]
            if not budget.take(time.monotonic()):
                return (
                    f"{name} exited with code {code} (restarted {self.max_restarts} times "
                    f"within {RESTART_WINDOW_S:.0f} s already)"
                )
            print(f"{name} exited with code {code}; restarting it", file=sys.stderr, flush=True)
            server.restart()
        return None

    def stop(self) -> None:
        for _, server in reversed(self.children):
            server.stop()


def launch_from_args(args: argparse.Namespace) -> int:
    if args.num_prefill < 1 or args.num_decode < 1:
        print("error: --num-prefill and --num-decode must be at least 1", file=sys.stderr)
        return 2
    if args.max_restarts < 0:
        print(f"error: --max-restarts must be >= 0, got {args.max_restarts}", file=sys.stderr)
        return 2
    model_path = args.model_path
    if model_path is None:
        from pdserve.engine.tiny_model import default_model_dir

        model_path = str(default_model_dir())
    gpus = [g for g in (args.gpus or "").split(",") if g.strip()]
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    deployment = Deployment(args.max_restarts)
    try:
        router_args = _start_workers(deployment, args, model_path, gpus)
        print(f"starting {args.num_prefill} prefill + {args.num_decode} decode workers ...")
        deployment.wait_healthy(args.start_timeout)
        router = deployment.start("router", router_args, port=args.port, host=args.host)
        router.wait_healthy(60)
        _print_ready(router.url, args.num_prefill, args.num_decode)
        if args.check:
            return _check(router.url)
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


def _start_workers(deployment: Deployment, args, model_path: str, gpus: list[str]) -> list[str]:
    """Start every worker; return the router's arguments naming them."""
    router_args = ["router", "--policy", args.policy]
    engine = engine_argv(args, model_path)
    transfer = ["--transfer-backend", args.transfer_backend]
    for k in range(args.num_prefill + args.num_decode):
        kind = "prefill" if k < args.num_prefill else "decode"
        index = k if kind == "prefill" else k - args.num_prefill
        role_args = [kind, *engine, *transfer]
        env = {"CUDA_VISIBLE_DEVICES": gpus[k % len(gpus)]} if gpus else None
        if kind == "prefill":
            bootstrap_port = free_port(args.host)
            role_args += ["--bootstrap-port", str(bootstrap_port)]
        server = deployment.start(
            f"{kind} worker {index}", role_args, port=free_port(args.host), host=args.host, env=env
        )
        if kind == "prefill":
            router_args += ["--prefill", server.url, str(bootstrap_port)]
        else:
            router_args += ["--decode", server.url]
    return router_args


EXAMPLE = {"prompt": "Hello, my name is", "max_tokens": 32, "temperature": 0}


def _print_ready(url: str, num_prefill: int, num_decode: int) -> None:
    print(
        f"\npdserve is ready at {url} ({num_prefill} prefill + {num_decode} decode workers)\n"
        "try:\n"
        f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{json.dumps(EXAMPLE)}'\n"
        "Ctrl-C stops everything.\n",
        flush=True,
    )


def _check(url: str) -> int:
    """--check: send the example request through the router, print the answer, stop."""
    response = httpx.post(url + "/v1/completions", json=EXAMPLE, timeout=120)
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
