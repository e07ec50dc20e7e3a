"""`pdserve bench`: a benchmark client for any OpenAI-compatible URL (`pdserve.bench`)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable


def register(subparsers, formatter) -> None:
    from pdserve.bench.command import add_arguments

    parser = subparsers.add_parser(
        "bench",
        help="benchmark a running OpenAI-compatible server (ours, vLLM, SGLang)",
        formatter_class=formatter,
    )
    add_arguments(parser)
    parser.set_defaults(configure=configure)


def configure(args: argparse.Namespace) -> Callable[[], int]:
    from pdserve.bench.command import run

    return functools.partial(run, args)
