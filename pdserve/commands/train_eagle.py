"""`pdserve train-eagle`: train an EAGLE-3 draft head on a target's own generations."""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

from pdserve.protocol.flags import add_flags, settings_from_args
from pdserve.speculative.training.train_config import TrainConfig


def register(subparsers, formatter) -> None:
    parser = subparsers.add_parser(
        "train-eagle",
        help="train an EAGLE-3 draft head for a target on the target's own generations",
        formatter_class=formatter,
    )
    add_flags(parser, TrainConfig)
    parser.set_defaults(configure=configure)


def configure(args: argparse.Namespace) -> Callable[[], int]:
    return functools.partial(_train, settings_from_args(TrainConfig, args))


def _train(config: TrainConfig) -> int:
    from pdserve.speculative.training.train_eagle import train_eagle

    report = train_eagle(config)
    if config.steps == 0:
        print(json.dumps({"sequences": str(report.out_dir)}))
        return 0
    summary = {
        "draft": str(report.out_dir),
        "train_seconds": round(report.train_seconds, 1),
        "final_loss": round(report.final_loss, 4),
        "held_out_accuracy_per_step": [round(a, 4) for a in report.eval_accuracy],
        "serve_with": f"--speculative-algorithm EAGLE3 --speculative-draft-model-path "
        f"{report.out_dir}",
    }
    print(json.dumps(summary))
    return 0
