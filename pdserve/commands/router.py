"""`pdserve router`: the OpenAI front end over prefill and decode workers, or over colocated
`pdserve serve` workers (`--worker-urls`). Torch-free."""

from __future__ import annotations

import argparse
import functools
import gc
from collections.abc import Callable

from pdserve.commands.common import (
    add_http_flags,
    check_port_free,
    http_settings_from_args,
    serve_http,
)
from pdserve.protocol.flags import add_flags, given, named_by_flag
from pdserve.protocol.http_settings import WORKER_ONLY
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import ServiceName
from pdserve.router.policies import POLICIES

ROUTER_PORT = 8000


def add_policy_flags(parser) -> None:
    choices = tuple(POLICIES)
    parser.add_argument(
        "--policy",
        default="round_robin",
        choices=choices,
        help="how workers are picked (colocated workers, or both roles)",
    )
    parser.add_argument("--prefill-policy", choices=choices, help="for prefill (default: --policy)")
    parser.add_argument("--decode-policy", choices=choices, help="for decode (default: --policy)")


def policies_from(args: argparse.Namespace) -> dict[str, str]:
    return {
        "prefill_policy": args.prefill_policy or args.policy,
        "decode_policy": args.decode_policy or args.policy,
        "policy": args.policy,
    }


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    """The router's flags less its workers (what `launch` also takes)."""
    group = parser.add_argument_group("router")
    add_policy_flags(group)
    add_flags(group, RouterConfig)


def register(subparsers, formatter) -> None:
    parser = subparsers.add_parser(
        "router",
        help="OpenAI front end over prefill and decode workers (or colocated ones)",
        description="OpenAI front end over prefill and decode workers (--prefill, --decode, "
        "or --prefill-service, --decode-service), each request on a pair; or over colocated "
        "`pdserve serve` workers (--worker-urls), each request on one of them.",
        formatter_class=formatter,
    )
    add_http_flags(parser, port=ROUTER_PORT, skip=WORKER_ONLY)
    workers = parser.add_argument_group("workers")
    workers.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker and, optionally, its bootstrap port (default: asked from the "
        "worker); repeat for several",
    )
    workers.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="repeat for several"
    )
    workers.add_argument(
        "--worker-urls",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="colocated `pdserve serve` workers instead of prefill and decode ones: each "
        "request goes, whole, to one of them (--policy)",
    )
    workers.add_argument(
        "--prefill-service",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="discover prefill workers: every address NAME resolves to (e.g. a Kubernetes "
        "headless Service) is a worker serving on PORT; re-resolved every health check",
    )
    workers.add_argument(
        "--decode-service",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="discover decode workers the same way",
    )
    add_router_flags(parser)
    parser.set_defaults(configure=configure)


def router_config_from_args(args: argparse.Namespace, api_key: str | None = None) -> RouterConfig:
    prefill = []
    for entry in args.prefill:
        if len(entry) > 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(entry)}")
        try:
            port = int(entry[1]) if len(entry) == 2 else None
        except ValueError:
            raise ValueError(
                f"--prefill bootstrap port must be a number, got {entry[1]!r}"
            ) from None
        prefill.append((entry[0], port))
    with named_by_flag(RouterConfig):
        return RouterConfig(
            prefill=tuple(prefill),
            decode=tuple(args.decode),
            worker_urls=tuple(args.worker_urls),
            prefill_services=tuple(ServiceName.parse(s) for s in args.prefill_service),
            decode_services=tuple(ServiceName.parse(s) for s in args.decode_service),
            api_key=api_key,
            **policies_from(args),
            **given(RouterConfig, args),
        )


def configure(args: argparse.Namespace) -> Callable[[], int]:
    http = http_settings_from_args(args, port=ROUTER_PORT)
    config = router_config_from_args(args, http.api_key)
    check_port_free(http.host, http.port, "--port")
    if config.router_processes > 1:
        from pdserve.router.processes import bind_sockets

        try:
            sockets = bind_sockets(http.host, http.port, config.router_processes)
        except OSError as e:
            raise ValueError(f"--port {http.port} on {http.host}: {e.strerror}") from None
        return functools.partial(_serve_processes, config, http, args.log_level, sockets)
    app = _built(config)
    return functools.partial(serve_http, app, http, args.log_level)


def _built(config: RouterConfig):
    from pdserve.router.app import build_router_app

    app = build_router_app(config)
    # NOTE: what start-up made (modules, the app, its schemas) leaves the collector's view, so
    # that a full collection no longer pauses every stream in flight for tens of ms (P99
    # time to first token at 32 streams: 40 -> 11 ms, benchmarks/RESULTS.md).
    gc.freeze()
    return app


def _serve_processes(config: RouterConfig, http, log_level: str, sockets) -> int:
    """A router process on each of `sockets` (one port), summing their metrics in a
    directory of their own (removed at the end)."""
    from pdserve.router.metrics import summed_across_processes
    from pdserve.router.processes import Supervisor

    one = config.per_process()
    with summed_across_processes() as process_ended:

        def serve(sock) -> int:
            return serve_http(_built(one), http, log_level, sockets=[sock])

        return Supervisor(sockets, serve, http.shutdown_timeout, process_ended).run()
