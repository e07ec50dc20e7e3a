"""`pdserve make-tiny-model`: a small seeded random model directory (tests, examples)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable


def register(subparsers, formatter) -> None:
    parser = subparsers.add_parser(
        "make-tiny-model",
        help="write a small seeded random model directory",
        formatter_class=formatter,
    )
    parser.add_argument("out_dir", help="where to write it")
    parser.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(configure=configure)


def configure(args: argparse.Namespace) -> Callable[[], int]:
    sizes = {
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "intermediate_size": args.intermediate_size,
    }
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return functools.partial(_make, args.out_dir, args.arch, sizes, args.seed)


def _make(out_dir: str, arch: str, sizes: dict[str, int], seed: int) -> int:
    from pdserve.synthetic.tiny_model import make_tiny_model

    print(make_tiny_model(out_dir, arch, **sizes, seed=seed))
    return 0
