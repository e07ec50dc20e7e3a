"""`python -m pdserve.bench ...`: the same as `pdserve bench ...`, without importing the
server (or torch)."""

from __future__ import annotations

import argparse
import sys

from pdserve.bench.command import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench", description="benchmark an OpenAI-compatible server"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
