"""`pdserve generate`: offline generation for one or more prompts, through `LLM`."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

from pdserve.commands.common import add_engine_flags, engine_config_from_args, model_path_from


def register(subparsers, formatter) -> None:
    parser = subparsers.add_parser(
        "generate", help="offline generation for one or more prompts", formatter_class=formatter
    )
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--prompt", action="append", required=True, help="repeat for several")
    sampling.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=-1, help="-1: all tokens")
    sampling.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    sampling.add_argument("--stop", action="append", help="a stop string; repeat for several")
    sampling.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_flags(parser)
    parser.set_defaults(configure=configure)


def configure(args: argparse.Namespace) -> Callable[[], int]:
    from pdserve.engine.core.sampling_params import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    config = engine_config_from_args(args, model_path_from(args)[0])
    return functools.partial(_generate, config, list(args.prompt), params, args.json)


def _generate(config, prompts: list[str], params, as_json: bool) -> int:
    from pdserve.engine.core.errors import InvalidRequestError
    from pdserve.llm import LLM

    llm = LLM.from_config(config)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for output in outputs:
        if as_json:
            record = {
                "prompt": output.prompt,
                "text": output.text,
                "token_ids": output.token_ids,
                "finish_reason": output.finish_reason,
            }
            print(json.dumps(record))
        else:
            print(f"{output.prompt!r} -> {output.text!r} ({output.finish_reason})")
    return 0
