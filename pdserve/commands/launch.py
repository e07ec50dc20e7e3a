"""`pdserve launch`: router + prefill + decode workers on this machine. It takes every flag
a worker or the router takes (less those it decides itself: each process's port, the
bootstrap ports, the router's worker lists) and hands them on (`pdserve.launch`)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import secrets
from collections.abc import Callable

from pdserve.commands.common import (
    add_engine_flags,
    add_http_flags,
    check_cuda_visible,
    check_port_free,
    engine_config_from_args,
    http_settings_from_args,
    model_path_from,
)
from pdserve.commands.router import ROUTER_PORT, add_router_flags, policies_from
from pdserve.commands.serve import add_transfer_flags, transfer_config_from_args
from pdserve.protocol.flags import add_flags, given, named_by_flag, settings_from_args
from pdserve.router.config import RouterConfig
from pdserve.transfer.config import TransferConfig

# What launch decides itself, for every worker: the bootstrap port of each prefill worker.
LAUNCH_DECIDES = ("bootstrap_port",)


def register(subparsers, formatter) -> None:
    from pdserve.launch import LaunchConfig

    parser = subparsers.add_parser(
        "launch",
        help="router + prefill + decode workers on this machine, until Ctrl-C",
        formatter_class=formatter,
    )
    add_flags(parser.add_argument_group("launch"), LaunchConfig)
    add_http_flags(parser, port=ROUTER_PORT)
    add_engine_flags(parser)
    add_transfer_flags(parser, LAUNCH_DECIDES)
    add_router_flags(parser)
    _say_launch_makes_a_transfer_token(parser)
    parser.set_defaults(configure=configure)


def _say_launch_makes_a_transfer_token(parser: argparse.ArgumentParser) -> None:
    """--transfer-token's help ends "(default: $PDSERVE_TRANSFER_TOKEN)"; under launch,
    without either, the workers get a random one (`with_transfer_token`): say so."""
    for action in parser._actions:
        if "--transfer-token" in action.option_strings and action.help.endswith(")"):
            action.help = action.help[:-1] + ", else a random one for launch's workers)"


def with_transfer_token(transfer: TransferConfig) -> TransferConfig:
    """Secure by default: without --transfer-token, a new random one for this launch's
    workers (handed to them through the environment, as a given one is), so that no other
    host reaching a bootstrap port can register with them."""
    if transfer.auth_token:
        return transfer
    return dataclasses.replace(transfer, auth_token=secrets.token_urlsafe(32))


def configure(args: argparse.Namespace) -> Callable[[], int]:
    from pdserve.launch import LaunchConfig, LaunchPlan, launch, replace_served_name

    config = settings_from_args(LaunchConfig, args)
    http = http_settings_from_args(args, port=ROUTER_PORT)
    model_path, served_name = model_path_from(args)
    if http.port == 0:
        from pdserve.server.local_process import free_port

        http = dataclasses.replace(http, port=free_port(http.host))
    plan = LaunchPlan(
        launch=config,
        http=replace_served_name(http, served_name),
        engine=engine_config_from_args(args, model_path),
        transfer=with_transfer_token(transfer_config_from_args(args, "decode", http.host)),
        router={**given(RouterConfig, args), **policies_from(args)},
        log_level=args.log_level,
        split_gpu_memory=args.gpu_memory_utilization is None,
    )
    with named_by_flag(RouterConfig):
        plan.router_argv([("http://127.0.0.1:1", 1)], ["http://127.0.0.1:2"])  # NOTE: checks it
    check_cuda_visible(plan.engine.device, config.gpus)
    check_port_free(http.host, http.port, "--port")
    return functools.partial(launch, plan)
