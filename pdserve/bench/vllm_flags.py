"""`vllm bench serve`'s common flags, for people who come with its command lines.

Each is translated once, here, into bench's own settings, and refused when it would clash
with the bench flag it stands for (giving both is ambiguous) or apply to nothing:

- `--dataset-name random|sharegpt|multi-turn`: `--workload` (an alias of it).
- `--dataset-path FILE`: a ShareGPT JSON file for `--dataset-name sharegpt` (real prompts and
  answer lengths instead of imitated ones, `workloads.load_sharegpt`).
- `--random-input-len N --random-output-len N --random-range-ratio R`: the lengths uniform in
  [N x (1 - R), N x (1 + R)], as vLLM samples them (R in [0, 1), default 0: exactly N).
- `--host H --port P`: `--base-url http://H:P` (vLLM's defaults: 127.0.0.1 and 8000).
- `--save-result [--result-dir D] [--result-filename F]`: `--result-json`, at vLLM's path:
  D (default: here) / F (default: pdserve-bench-{rate}qps-{model}-{date}.json).
- `--goodput ttft:MS tpot:MS e2el:MS`: `--slo-ttft-ms`, `--slo-tpot-ms`, `--slo-e2e-ms`.
"""

from __future__ import annotations

import argparse
import datetime
import math
from pathlib import Path

from pdserve.bench.workloads import LengthRange

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
GOODPUT_KEYS = {"ttft": "slo_ttft_ms", "tpot": "slo_tpot_ms", "e2el": "slo_e2e_ms"}


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    v = parser.add_argument_group("vllm bench serve's flags (each stands for a flag above)")
    v.add_argument("--dataset-path", help="--dataset-name sharegpt: a ShareGPT JSON file")
    v.add_argument("--random-input-len", type=int, help="random: input tokens (--input-len)")
    v.add_argument("--random-output-len", type=int, help="random: output tokens (--output-len)")
    v.add_argument(
        "--random-range-ratio",
        type=float,
        help="random lengths uniform in [N*(1-R), N*(1+R)], 0 <= R < 1 (default 0)",
    )
    v.add_argument("--host", help=f"the server's host (--base-url; default {DEFAULT_HOST})")
    v.add_argument(
        "--port", type=int, help=f"the server's port (--base-url; default {DEFAULT_PORT})"
    )
    v.add_argument("--save-result", action="store_true", help="write --result-json at vLLM's path")
    v.add_argument("--result-dir", type=Path, help="--save-result: the directory (default: .)")
    v.add_argument("--result-filename", help="--save-result: the file name")
    v.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="SLOs as ttft:MS tpot:MS e2el:MS (the --slo-*-ms flags)",
    )


def base_url_from(args: argparse.Namespace) -> str:
    """--base-url, else http://--host:--port."""
    if args.base_url is not None:
        if args.host is not None or args.port is not None:
            raise ValueError("give --base-url or --host/--port, not both")
        return args.base_url
    host = args.host or DEFAULT_HOST
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # NOTE: an IPv6 address
    return f"http://{host}:{args.port or DEFAULT_PORT}"


def lengths_from(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(--input-len, --output-len) as bench takes them, from the --random-* flags if given."""
    ratio = args.random_range_ratio
    given = [n for n in ("random_input_len", "random_output_len") if getattr(args, n) is not None]
    if (given or ratio is not None) and args.workload != "random":
        raise ValueError(f"--random-* flags are for --dataset-name random, not {args.workload}")
    if ratio is not None and not given:
        raise ValueError("--random-range-ratio needs --random-input-len or --random-output-len")
    if ratio is not None and not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio {ratio}: must be in [0, 1)")
    input_len = _vllm_range(args.input_len, args.random_input_len, ratio, "input")
    output_len = _vllm_range(args.output_len, args.random_output_len, ratio, "output")
    return input_len, output_len


def _vllm_range(ours: str | None, length: int | None, ratio: float | None, what: str) -> str | None:
    if length is None:
        return ours
    if ours is not None:
        raise ValueError(f"give --{what}-len or --random-{what}-len, not both")
    if length < 1:
        raise ValueError(f"--random-{what}-len {length}: must be >= 1")
    ratio = ratio or 0.0
    return str(LengthRange(max(1, int(length * (1 - ratio))), int(length * (1 + ratio))))


def slo_from(args: argparse.Namespace) -> dict[str, float | None]:
    """The SLOs (milliseconds, by `SLO` field) from --slo-*-ms or --goodput, not both."""
    slo = {flag: getattr(args, flag) for flag in GOODPUT_KEYS.values()}
    if not args.goodput:
        return slo
    if any(value is not None for value in slo.values()):
        raise ValueError("give --goodput or --slo-*-ms, not both")
    for item in args.goodput:
        key, colon, value = item.partition(":")
        if key not in GOODPUT_KEYS or not colon:
            raise ValueError(
                f"--goodput {item!r}: expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}"
            )
        try:
            slo[GOODPUT_KEYS[key]] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
    return slo


def check_result_flags(args: argparse.Namespace) -> None:
    if args.save_result and args.result_json is not None:
        raise ValueError("give --result-json or --save-result, not both")
    if not args.save_result and (args.result_dir is not None or args.result_filename):
        raise ValueError("--result-dir and --result-filename go with --save-result")


def result_path(args: argparse.Namespace, model: str) -> Path | None:
    """Where the JSON report goes: --result-json, or vLLM's path with --save-result."""
    if not args.save_result:
        return args.result_json
    name = args.result_filename
    if not name:
        rates = args.rate_sweep.replace(",", "_") if args.rate_sweep else _rate(args)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"pdserve-bench-{rates}qps-{model.rstrip('/').split('/')[-1]}-{stamp}.json"
    return (args.result_dir or Path(".")) / name


def _rate(args: argparse.Namespace) -> str:
    if args.concurrency is not None or args.request_rate is None:
        return "inf"
    return "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"


def vllm_metrics(summary: dict) -> dict:
    """A run's summary under the flat names `vllm bench serve --save-result` writes (means,
    medians, P90 and P99 in ms; `e2el` is end-to-end latency), for scripts that read them."""
    flat = {
        "completed": summary["completed"],
        "failed": summary["failed"],
        "duration": summary["duration_s"],
        "total_input_tokens": summary["input_tokens"],
        "total_output_tokens": summary["output_tokens"],
        "request_throughput": summary["request_throughput"],
        "request_goodput": summary["goodput"],
        "output_throughput": summary["output_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
    }
    for ours, theirs in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("itl_ms", "itl")):
        for stat, value in summary[ours].items():
            flat[f"{stat}_{theirs}_ms"] = value
    for stat, value in summary["e2e_ms"].items():
        flat[f"{stat}_e2el_ms"] = value
    return flat
