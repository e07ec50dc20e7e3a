"""`pdserve serve | prefill | decode`: one worker (engine process + HTTP front end).

serve is colocated (prefill and decode in one engine); prefill and decode are the two halves
of a disaggregated pair and add the KV transfer flags (`TransferConfig`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

from pdserve.commands.common import (
    add_engine_flags,
    add_http_flags,
    check_cuda_visible,
    check_port_free,
    engine_config_from_args,
    http_settings_from_args,
    model_path_from,
    serve_http,
)
from pdserve.engine.text.chat_template import load_chat_template
from pdserve.protocol.flags import add_flags, declared, settings_from_args
from pdserve.protocol.spec_settings import SpecSettings
from pdserve.transfer.backends import make_backend
from pdserve.transfer.config import TransferConfig

WORKER_PORT = 30000
HELP = {
    "serve": "colocated worker: OpenAI + SGLang-native HTTP API",
    "prefill": "prefill worker: prefills and sends KV to decode workers",
    "decode": "decode worker: receives KV from prefill workers and decodes",
}
# The transfer flags a role has no use for.
TRANSFER_SKIP = {"prefill": ("bootstrap_allow",), "decode": ("bootstrap_port",)}


def add_transfer_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...]) -> None:
    add_flags(parser.add_argument_group("KV transfer"), TransferConfig, skip=skip)


def transfer_config_from_args(args: argparse.Namespace, kind: str, host: str) -> TransferConfig:
    """The transfer settings; the bootstrap host defaults to --host (a decode worker binds no
    bootstrap port)."""
    defaults: dict = {"bootstrap_host": host}
    if kind == "decode":
        defaults["bootstrap_port"] = 0
    return settings_from_args(TransferConfig, args, skip=TRANSFER_SKIP[kind], defaults=defaults)


def register(subparsers, kind: str, formatter) -> None:
    parser = subparsers.add_parser(kind, help=HELP[kind], formatter_class=formatter)
    add_http_flags(parser, port=WORKER_PORT)
    add_engine_flags(parser)
    if kind != "serve":
        add_transfer_flags(parser, TRANSFER_SKIP[kind])
    parser.set_defaults(configure=functools.partial(configure, kind=kind))


def configure(args: argparse.Namespace, kind: str) -> Callable[[], int]:
    """Check everything (flags, model, ports) before anything slow starts; return the run."""
    from pdserve.server.app import build_app

    http = http_settings_from_args(args, port=WORKER_PORT)
    model_path, served_name = model_path_from(args)
    engine = engine_config_from_args(args, model_path)
    transfer = None if kind == "serve" else transfer_config_from_args(args, kind, http.host)
    if transfer is not None:
        make_backend(transfer).check_tensor_parallel(engine.tp_size, f"--tp-size {engine.tp_size}")
    if engine.node_rank > 0:
        # NOTE: another node of a worker that spans nodes: it runs ranks, node 0 serves (and,
        # in a prefill or decode worker, moves the KV).
        from pdserve.engine.ranks.node_ranks import run_node_ranks

        return functools.partial(run_node_ranks, engine)
    check_cuda_visible(engine.device)
    chat_template = load_chat_template(http.chat_template) if http.chat_template else None
    check_port_free(http.host, http.port, "--port")
    if transfer is not None and transfer.bootstrap_port:
        check_port_free(transfer.bootstrap_host, transfer.bootstrap_port, "--bootstrap-port")
    app = build_app(
        engine,
        worker_role(kind, transfer),
        served_model_name=http.served_model_name or served_name,
        api_key=http.api_key,
        max_queued_requests=http.max_queued_requests,
        chat_template=chat_template,
        server_args=_server_args(http, engine, transfer),
    )
    return functools.partial(serve_http, app, http, args.log_level)


def _server_args(http, engine, transfer) -> dict:
    """The settings /server_info reports (as SGLang's does), secrets left out."""
    settings = {**dataclasses.asdict(http), **dataclasses.asdict(engine)}
    # NOTE: flat, under the flags' names, as SGLang reports them (speculative_algorithm, ...).
    spec = settings.pop("speculative")
    for d in declared(SpecSettings):
        settings[d.dest] = None if spec is None else spec[d.field]
    if transfer is not None:
        settings.update(dataclasses.asdict(transfer), transfer_backend=transfer.backend)
    for secret in ("api_key", "auth_token"):
        settings.pop(secret, None)
    return settings


def worker_role(kind: str, transfer: TransferConfig | None):
    """The worker's role with the factory that builds its engine and handoff: the one place
    that names the role packages (the server only hands the factory on)."""
    from pdserve.server.role import WorkerRole

    if kind == "serve":
        from pdserve.colocated.worker import build_worker

        return WorkerRole("colocated", build_worker)
    if kind == "prefill":
        from pdserve.prefill.worker import build_worker
    else:
        from pdserve.decode.worker import build_worker
    return WorkerRole(kind, functools.partial(build_worker, transfer=transfer), transfer.backend)
