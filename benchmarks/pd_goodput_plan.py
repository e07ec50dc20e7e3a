"""What pd_goodput.py runs: the request classes and workloads (lengths, SLOs, rates), the
plan built from its flags, and each run's requests and deadline. Torch-free."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pd_goodput_deploy import DEPLOYMENTS

from pdserve.bench.goodput import ATTAINMENT_TARGET, slo_horizon_s
from pdserve.bench.metrics import SLO
from pdserve.bench.workloads import Conversation, LengthRange, WorkloadSpec, build_workload

CLASSES = ("prefill-heavy", "decode-heavy")
WORKLOADS = {"prefill-heavy": CLASSES[:1], "decode-heavy": CLASSES[1:], "mix": CLASSES}
# (input, output) lengths in tokens: the benchmark's, and the smoke run's (tiny model, CPU).
LENGTHS = {"prefill-heavy": ("2048:8192", "64:256"), "decode-heavy": ("100:500", "500:1500")}
SMOKE_LENGTHS = {"prefill-heavy": ("256:512", "4:8"), "decode-heavy": ("8:32", "24:48")}
# Flag defaults, (benchmark, smoke): the benchmark's are sized for the 8B model on two H200s
# (pd_goodput.py's docstring says how long they take).
DEFAULTS = {
    "prefill_heavy_rates": ((2.0, 4.0, 6.0, 8.0), (2.0, 4.0)),
    "decode_heavy_rates": ((8.0, 16.0, 32.0), (2.0, 4.0)),
    "mix_rates": ((4.0, 8.0, 12.0), (2.0, 4.0)),
    "duration": (8.0, 3.0),
    "min_prompts": (16, 4),
    "tpot_slos_ms": ((10.0, 15.0, 20.0, 30.0, 50.0), (20.0, 50.0, 200.0)),
    "prefill_heavy_ttft_slo_ms": (2000.0, 2000.0),
    "prefill_heavy_tpot_slo_ms": (50.0, 200.0),
    "decode_heavy_ttft_slo_ms": (1000.0, 2000.0),
    "decode_heavy_tpot_slo_ms": (50.0, 200.0),
    "devices": (("cuda:0", "cuda:1"), ("cpu", "cpu")),
    "transfer_backend": ("nccl", "tcp"),
    "client_processes": (4, 2),
}
# A cut-off run's deadline leaves this much beyond the SLO horizon: client-side lag.
DEADLINE_SLACK_S, DEADLINE_SLACK_FRACTION = 2.0, 0.05


@dataclass(frozen=True)
class RequestClass:
    name: str
    input_len: LengthRange
    output_len: LengthRange
    ttft_slo_ms: float
    tpot_slo_ms: float

    def slo(self, tpot_ms: float | None = None) -> SLO:
        """Its SLO, at its own TPOT SLO or at `tpot_ms`."""
        return SLO(ttft_ms=self.ttft_slo_ms, tpot_ms=tpot_ms or self.tpot_slo_ms)


@dataclass(frozen=True)
class Workload:
    name: str
    classes: tuple[RequestClass, ...]  # requests split evenly among them
    rates: tuple[float, ...]  # ascending


@dataclass(frozen=True)
class Plan:
    workloads: tuple[Workload, ...]
    tpot_slos_ms: tuple[float, ...]  # ascending
    duration_s: float
    num_prompts: int | None
    min_prompts: int
    target: float
    full_sweep: bool
    seed: int
    client_processes: int

    def prompts_at(self, rate: float) -> int:
        if self.num_prompts is not None:
            return self.num_prompts
        return max(self.min_prompts, math.ceil(rate * self.duration_s))

    def loosest_tpot_ms(self, request_class: RequestClass) -> float:
        return max((*self.tpot_slos_ms, request_class.tpot_slo_ms))


@dataclass(frozen=True)
class Batch:
    """One run's requests and the class each is judged as."""

    conversations: list[Conversation]
    kinds: list[RequestClass]

    def judge(self, tpot_ms: float | None = None):
        """Whether a record is within its class's SLO (at `tpot_ms` instead, if given)."""
        return lambda record: self.kinds[record.conversation].slo(tpot_ms).met(record)


def build_batch(workload: Workload, count: int, vocab: int, seed: int) -> Batch:
    rng = random.Random(seed)
    kinds = [workload.classes[i % len(workload.classes)] for i in range(count)]
    rng.shuffle(kinds)
    pools = {}
    for kind in workload.classes:
        spec = WorkloadSpec("random", False, kind.input_len, kind.output_len, 0, vocab)
        pools[kind.name] = iter(build_workload(spec, kinds.count(kind), rng.randrange(2**32)))
    return Batch([next(pools[kind.name]) for kind in kinds], kinds)


def run_deadline_s(plan: Plan, batch: Batch, offsets: list[float]) -> float:
    """When to cut the run off: after its last arrival, the longest a request can still end
    within the loosest SLO its class is judged by (pd_goodput.py's docstring)."""
    horizon = max(
        slo_horizon_s(kind.slo(plan.loosest_tpot_ms(kind)), kind.output_len.high)
        for kind in set(batch.kinds)
    )
    return offsets[-1] + horizon * (1 + DEADLINE_SLACK_FRACTION) + DEADLINE_SLACK_S


def _shown(name: str) -> str:
    """A flag's defaults for its help: `benchmark; smoke: smoke run`."""
    full, smoke = DEFAULTS[name]
    return f"{_text(full)}; smoke: {_text(smoke)}"


def _text(value) -> str:
    values = value if isinstance(value, tuple) else (value,)
    return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with their defaults (benchmark or smoke) filled in; bad ones exit 2."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model-path", help="a model directory")
    source.add_argument("--preset", help="a real config with random weights: llama-3.1-8b, ...")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the built-in tiny model on CPU, short requests, rates 2 and 4, 3 s each",
    )
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--deployments", nargs="+", choices=DEPLOYMENTS, default=list(DEPLOYMENTS))
    load = parser.add_argument_group("load (defaults: benchmark; smoke)")
    load.add_argument(
        "--rates", type=float, nargs="+", metavar="RATE", help="req/s, for every workload"
    )
    for name in WORKLOADS:
        flag = f"{name.replace('-', '_')}_rates"
        load.add_argument(
            f"--{name}-rates", type=float, nargs="+", metavar="RATE", help=_shown(flag)
        )
    load.add_argument(
        "--duration", type=float, help=f"seconds of arrivals a rate ({_shown('duration')})"
    )
    load.add_argument(
        "--min-prompts", type=int, help=f"requests a rate at least ({_shown('min_prompts')})"
    )
    load.add_argument("--num-prompts", type=int, help="requests a rate, whatever the rate")
    load.add_argument("--full-sweep", action="store_true", help="run the rates past a miss too")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--client-processes",
        type=int,
        help="processes the benchmark client's requests are spread over: one reads about "
        f"10k streamed tokens/s at most ({_shown('client_processes')})",
    )
    slos = parser.add_argument_group("SLOs (defaults: benchmark; smoke)")
    for kind in CLASSES:
        for metric in ("ttft", "tpot"):
            flag = f"{kind.replace('-', '_')}_{metric}_slo_ms"
            slos.add_argument(
                f"--{kind}-{metric}-slo-ms", type=float, metavar="MS", help=_shown(flag)
            )
    slos.add_argument(
        "--tpot-slos-ms",
        type=float,
        nargs="+",
        metavar="MS",
        help=f"goodput at each ({_shown('tpot_slos_ms')})",
    )
    slos.add_argument(
        "--attainment",
        type=float,
        default=ATTAINMENT_TARGET,
        help="fraction within SLO a rate needs to meet the SLOs (%(default)s)",
    )
    servers = parser.add_argument_group("servers")
    servers.add_argument(
        "--devices", nargs=2, metavar="DEVICE", help=f"GPU 0 and GPU 1 ({_shown('devices')})"
    )
    servers.add_argument(
        "--transfer-backend",
        choices=["nccl", "tcp", "gloo", "ipc"],
        help=_shown("transfer_backend"),
    )
    servers.add_argument("--max-running-requests", type=int, help="every worker's")
    servers.add_argument("--engine-args", default="", help="more flags for every worker, quoted")
    servers.add_argument("--start-timeout", type=float, default=900.0, help="seconds a worker")
    parser.add_argument("--output-dir", type=Path, default=Path("pd_goodput_out"))
    parser.add_argument(
        "--model-cache",
        help="keep the --preset model here and reuse it next time (default: a temporary one)",
    )
    args = parser.parse_args(argv)
    for name in args.workloads:  # --rates stands in for a workload's own rates
        flag = f"{name.replace('-', '_')}_rates"
        if getattr(args, flag) is None and args.rates is not None:
            setattr(args, flag, args.rates)
    for name, (full, smoke) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if not args.smoke and args.model_path is None and args.preset is None:
        parser.error("give --model-path or --preset (or --smoke)")
    for name in ("duration", "attainment"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be > 0")
    if args.min_prompts < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        parser.error("--min-prompts and --num-prompts must be >= 1")
    if args.client_processes < 1:
        parser.error("--client-processes must be >= 1")
    return args


def plan_from_args(args: argparse.Namespace) -> Plan:
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    kinds = {}
    for name in CLASSES:
        flag = name.replace("-", "_")
        input_len, output_len = (LengthRange.parse(text) for text in lengths[name])
        ttft, tpot = (getattr(args, f"{flag}_{metric}_slo_ms") for metric in ("ttft", "tpot"))
        kinds[name] = RequestClass(name, input_len, output_len, ttft, tpot)
    workloads = []
    for name in args.workloads:
        rates = getattr(args, f"{name.replace('-', '_')}_rates")
        if any(not rate > 0 or math.isinf(rate) for rate in rates):
            raise ValueError(f"{name} rates {rates}: each must be a finite rate > 0")
        classes = tuple(kinds[kind] for kind in WORKLOADS[name])
        workloads.append(Workload(name, classes, tuple(sorted(set(rates)))))
    return Plan(
        workloads=tuple(workloads),
        tpot_slos_ms=tuple(sorted(set(args.tpot_slos_ms))),
        duration_s=args.duration,
        num_prompts=args.num_prompts,
        min_prompts=args.min_prompts,
        target=args.attainment,
        full_sweep=args.full_sweep,
        seed=args.seed,
        client_processes=args.client_processes,
    )
