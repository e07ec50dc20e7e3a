"""`pdserve bench`: load any OpenAI-compatible server (pdserve, vLLM, SGLang) with a seeded
workload and report latency, throughput and goodput.

`add_arguments` defines the flags (`vllm bench serve`'s common ones too, `vllm_flags`),
`plan_from_args` turns them into validated settings (bad ones: a one-line `error:` and exit
status 2), `run` runs one benchmark per rate.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve.bench.client import (
    BenchClient,
    ClientSettings,
    NoModelList,
    RequestRecord,
    ServerUnreachable,
    api_url,
    served_models,
)
from pdserve.bench.metrics import SLO, format_summary, summarize
from pdserve.bench.runner import Load, RunResult, run_load, warm_up
from pdserve.bench.vllm_flags import (
    add_vllm_arguments,
    base_url_from,
    check_result_flags,
    lengths_from,
    result_path,
    slo_from,
    vllm_metrics,
)
from pdserve.bench.workloads import (
    WORKLOADS,
    LengthRange,
    WorkloadSpec,
    build_workload,
    load_sharegpt,
)

# Per workload: (endpoint, input length, output length) when not given.
DEFAULTS = {
    "random": ("completions", "64:512", "32:128"),
    "sharegpt": ("chat", None, None),
    "multi-turn": ("chat", "16:64", "16:64"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", help="the server, e.g. http://127.0.0.1:8000 (default: --host, --port)"
    )
    parser.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        help="default: completions for random (token-id prompts), chat for the others",
    )
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", "--dataset-name", choices=WORKLOADS, default="random")
    w.add_argument(
        "--num-prompts", type=int, default=100, help="requests (conversations for multi-turn)"
    )
    w.add_argument(
        "--input-len",
        help="MIN[:MAX] uniform, inclusive; tokens for token-id prompts, words for text "
        "(random: 64:512; multi-turn: 16:64 words per user turn)",
    )
    w.add_argument(
        "--output-len", help="MIN[:MAX] max_tokens, uniform (random: 32:128; multi-turn: 16:64)"
    )
    w.add_argument("--token-id-min", type=int, default=3, help="random prompt ids, inclusive")
    w.add_argument("--token-id-max", type=int, default=250, help="random prompt ids, exclusive")
    w.add_argument("--max-input-len", type=int, default=1024, help="sharegpt: clip (words)")
    w.add_argument("--max-output-len", type=int, default=512, help="sharegpt: clip (tokens)")
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns a conversation")
    w.add_argument("--system-prompt-len", type=int, default=32, help="multi-turn: words, own")
    w.add_argument(
        "--shared-prefix-len", type=int, default=0, help="multi-turn: words all conversations share"
    )
    w.add_argument("--seed", type=int, default=0, help="workload and arrival times")
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second; inf sends all at once (the default)",
    )
    load.add_argument("--rate-sweep", help="comma-separated rates, one benchmark each: 1,2,4,8")
    load.add_argument(
        "--concurrency", type=int, help="keep N requests in flight (rate inf, max concurrency N)"
    )
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument(
        "--warmup-requests", type=int, default=1, help="sent first, one at a time, not counted"
    )
    r = parser.add_argument_group("requests")
    r.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly max_tokens (vLLM/SGLang extension)",
    )
    r.add_argument(
        "--logprobs",
        type=int,
        help="ask for logprobs: servers that send no chunk for a token without text (yet) then "
        "send one per token, so ITL is per token",
    )
    s = parser.add_argument_group("SLOs (goodput counts requests meeting all given)")
    s.add_argument("--slo-ttft-ms", type=float)
    s.add_argument("--slo-tpot-ms", type=float)
    s.add_argument("--slo-e2e-ms", type=float)
    o = parser.add_argument_group("output")
    o.add_argument("--result-json", type=Path, help="config, summaries and every request")
    o.add_argument("--plot-dir", type=Path, help="latency CDFs (and a sweep plot) as PNG")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_vllm_arguments(parser)


def _resolve_model(settings: ClientSettings, given: str | None) -> str:
    """`given`, else the first model /v1/models lists; either way, the server must answer."""
    url = api_url(settings.base_url, "/v1/models")
    try:
        models = served_models(settings.base_url, settings.api_key)
    except NoModelList as e:
        if given:
            return given  # a server without /v1/models: fine when told the model
        raise NoModelList(f"{e}; pass --model") from None
    if given or models:
        return given or models[0]
    raise NoModelList(f"{url} lists no model; pass --model")


class WarmupFailed(Exception):
    """A warm-up request failed: the settings do not suit the server."""


@dataclass(frozen=True)
class BenchPlan:
    workload: WorkloadSpec
    client: ClientSettings  # model "" until resolved
    loads: tuple[Load, ...]
    slo: SLO
    num_prompts: int
    warmup_requests: int
    seed: int


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    """Validated settings; ValueError naming the flag for anything wrong."""
    if args.num_prompts < 1 or args.warmup_requests < 0:
        raise ValueError("--num-prompts must be >= 1 and --warmup-requests >= 0")
    _, input_len, output_len = DEFAULTS[args.workload]
    chat = _endpoint(args) == "chat"
    given_input_len, given_output_len = lengths_from(args)
    check_result_flags(args)
    if args.dataset_path is not None and args.workload != "sharegpt":
        raise ValueError(f"--dataset-path is read by --dataset-name sharegpt, not {args.workload}")
    workload = WorkloadSpec(
        name=args.workload,
        chat=chat,
        input_len=LengthRange.parse(given_input_len or input_len or "1"),
        output_len=LengthRange.parse(given_output_len or output_len or "1"),
        token_id_min=args.token_id_min,
        token_id_max=args.token_id_max,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        num_turns=args.num_turns,
        system_prompt_len=args.system_prompt_len,
        shared_prefix_len=args.shared_prefix_len,
        dataset=()
        if args.dataset_path is None
        else load_sharegpt(args.dataset_path, args.max_input_len, args.max_output_len),
    )
    client = ClientSettings(
        base_url=base_url_from(args),
        model=args.model or "",
        endpoint="chat" if chat else "completions",
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        timeout_s=args.request_timeout,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    slo = SLO(**{name.removeprefix("slo_"): value for name, value in slo_from(args).items()})
    return BenchPlan(
        workload, client, _loads(args), slo, args.num_prompts, args.warmup_requests, args.seed
    )


def _loads(args: argparse.Namespace) -> tuple[Load, ...]:
    if args.concurrency is not None:
        if args.request_rate is not None or args.rate_sweep or args.max_concurrency is not None:
            raise ValueError(
                "--concurrency N is rate inf with --max-concurrency N: "
                "give it alone, or --request-rate/--rate-sweep with --max-concurrency"
            )
        return (Load(math.inf, args.concurrency),)
    if args.rate_sweep:
        if args.request_rate is not None:
            raise ValueError("give --request-rate or --rate-sweep, not both")
        try:
            rates = [float(rate) for rate in args.rate_sweep.split(",")]
        except ValueError:
            message = f"--rate-sweep {args.rate_sweep!r}: expected rates like 1,2,4,8"
            raise ValueError(message) from None
        return tuple(Load(rate, args.max_concurrency) for rate in rates)
    rate = math.inf if args.request_rate is None else args.request_rate
    return (Load(rate, args.max_concurrency),)


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
        model = _resolve_model(plan.client, args.model)
    except (ValueError, ServerUnreachable, NoModelList) as e:
        return _error(str(e))
    plan = replace(plan, client=replace(plan.client, model=model))
    try:
        outcome = asyncio.run(_run(plan, progress=not args.disable_tqdm))
    except WarmupFailed as e:
        return _error(str(e))
    report_path = result_path(args, model)
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report = result_report(args, model, outcome)
        report_path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
        print(f"results: {report_path}")
    if args.plot_dir is not None:
        from pdserve.bench.plots import PlotTitle, write_plots  # matplotlib only when asked

        title = PlotTitle(plan.client.base_url, model, describe_workload(plan, args))
        for path in write_plots(args.plot_dir, outcome.results, outcome.summaries, title):
            print(f"plot: {path}")
    return 0


@dataclass
class BenchOutcome:
    warmup: list[RequestRecord] = field(default_factory=list)
    results: list[RunResult] = field(default_factory=list)  # one per load
    summaries: list[dict[str, Any]] = field(default_factory=list)


async def _run(plan: BenchPlan, progress: bool) -> BenchOutcome:
    caps = [load.max_concurrency for load in plan.loads]
    client = BenchClient(plan.client, max_connections=None if None in caps else max(caps))
    outcome = BenchOutcome()
    try:
        for index, load in enumerate(plan.loads):
            # NOTE: each run of a sweep gets its own prompts (seed + index), so that a
            # server's prefix cache does not flatter the later runs; warm-up prompts are
            # never measured ones.
            workload = build_workload(
                plan.workload, plan.warmup_requests + plan.num_prompts, plan.seed + index
            )
            if index == 0:
                outcome.warmup = await _warm_up(client, workload[: plan.warmup_requests])
            conversations = workload[plan.warmup_requests :]
            total = sum(len(c.turns) for c in conversations)
            show = progress and sys.stderr.isatty()
            with tqdm(total=total, desc=load.label, unit="req", disable=not show) as bar:
                result = await run_load(
                    client, conversations, load, plan.seed + index, lambda _: bar.update()
                )
            summary = summarize(result.records, result.duration_s, plan.slo)
            print(format_summary(summary, f"{plan.workload.name}, {load.label}"), flush=True)
            outcome.results.append(result)
            outcome.summaries.append(summary)
    finally:
        await client.aclose()
    return outcome


async def _warm_up(client: BenchClient, conversations) -> list[RequestRecord]:
    records = await warm_up(client, conversations)
    for record in records:
        if not record.success:
            raise WarmupFailed(
                f"the warm-up request to {client.url} failed ({record.error}); "
                "check --model, the lengths and the endpoint against the server"
            )
    return records


def result_report(args: argparse.Namespace, model: str, outcome: BenchOutcome) -> dict[str, Any]:
    """The flags (not the API key), the model, what the numbers mean, the warm-up requests
    (not in any summary) and, per run, its load, summary and every request."""
    config = {
        key: _json_safe(value)
        for key, value in vars(args).items()
        if key not in ("api_key", "func") and not callable(value)
    }
    config["model"] = model
    report = {
        "config": config,
        "definitions": {
            "percentiles": "linear interpolation between closest ranks",
            "itl": "gaps between consecutive output-carrying stream chunks",
            "tpot": "(e2e - ttft) / (output_tokens - 1), requests with >= 2 tokens",
            "goodput": "successful requests/s meeting every given SLO; null with no SLO",
        },
        "warmup_requests": [record.to_json() for record in outcome.warmup],
        "runs": [
            {
                "request_rate": _json_safe(result.load.request_rate),
                "max_concurrency": result.load.max_concurrency,
                "summary": summary,
                "vllm_metrics": vllm_metrics(summary),
                "requests": [record.to_json() for record in result.records],
            }
            for result, summary in zip(outcome.results, outcome.summaries, strict=True)
        ],
    }
    if len(outcome.results) == 1:
        # NOTE: a single run's file also reads as `vllm bench serve --save-result`'s does.
        load = outcome.results[0].load
        report = {
            "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai-chat" if _endpoint(args) == "chat" else "openai",
            "model_id": model,
            "num_prompts": args.num_prompts,
            "request_rate": _json_safe(load.request_rate),
            "max_concurrency": load.max_concurrency,
            **vllm_metrics(outcome.summaries[0]),
            **report,
        }
    return report


def describe_workload(plan: BenchPlan, args: argparse.Namespace) -> str:
    """The workload in a few words, for plot titles."""
    spec = plan.workload
    if spec.name == "sharegpt":
        source = Path(args.dataset_path).name if args.dataset_path else "imitated lengths"
        what = f"sharegpt ({source})"
    else:
        unit = "words" if spec.chat else "tokens"
        what = f"{spec.name}: input {spec.input_len} {unit}, output {spec.output_len} tokens"
    return f"{what}, {plan.num_prompts} prompts, {plan.client.endpoint}"


def _endpoint(args: argparse.Namespace) -> str:
    return args.endpoint or DEFAULTS[args.workload][0]


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, Path):
        return str(value)
    return value


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
