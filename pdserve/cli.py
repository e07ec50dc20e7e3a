"""`pdserve` command line: the parser of every subcommand (`pdserve.commands`, one module
each) and `main`, which turns a bad flag or setting into one `error:` line and exit code 2
before anything slow starts."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import pdserve
from pdserve.commands import bench, generate, launch, make_tiny_model, router, serve, train_eagle
from pdserve.commands.common import CommandParser, HelpFormatter, add_log_level, unknown_flags


class Parser(argparse.ArgumentParser):
    """argparse's parser, with "did you mean" for a flag it does not know: a user coming
    from vLLM or SGLang types their names (`--max-model-length`, `--tp`)."""

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            commands = self._subparsers._group_actions[0].choices if self._subparsers else {}
            command = commands.get(getattr(parsed, "command", None), self)
            command.error(unknown_flags(unknown, command))
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pdserve",
        description="pdserve: prefill/decode-disaggregated LLM serving",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pdserve {pdserve.__version__}")
    add_log_level(parser, default="info")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    launch.register(sub, HelpFormatter)
    for kind in ("serve", "prefill", "decode"):
        serve.register(sub, kind, HelpFormatter)
    router.register(sub, HelpFormatter)
    generate.register(sub, HelpFormatter)
    bench.register(sub, HelpFormatter)
    make_tiny_model.register(sub, HelpFormatter)
    train_eagle.register(sub, HelpFormatter)
    for subparser in sub.choices.values():
        add_log_level(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pdserve.launch import watch_parent

    watch_parent()
    _configure_logging(args.log_level)
    try:
        run = args.configure(args)
    except ValueError as e:  # NOTE: bad settings (SpeculativeConfigError is one too)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run()


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # NOTE: processes this one starts (the engine process) log at the same level.
    os.environ["PDSERVE_LOG_LEVEL"] = level
    # NOTE: httpx and httpcore log every request (the router and launcher make many).
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


if __name__ == "__main__":
    sys.exit(main())
