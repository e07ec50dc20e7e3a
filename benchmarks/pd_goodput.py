"""Goodput of prefill/decode disaggregation against the colocated pair on the same two GPUs.

Deployments, same model, same two devices, one after the other (pd_goodput_deploy.py):
- disaggregated: `pdserve prefill` on GPU 0 + `pdserve decode` on GPU 1 (KV over
  --transfer-backend) behind `pdserve router`;
- colocated: two `pdserve serve` replicas, GPU 0 and GPU 1, behind `pdserve router
  --worker-urls A B --policy round_robin`. The fair baseline: as much hardware as the split.

Workloads, through `pdserve bench`'s client (random token prompts, EOS ignored, streamed
completions with logprobs so that every token is a chunk):
- prefill-heavy: input U[2048, 8192] tokens, output U[64, 256];
- decode-heavy: input U[100, 500], output U[500, 1500];
- mix: each request prefill-heavy or decode-heavy, half each, in seeded random order.
Each runs at every swept rate with Poisson arrivals (rate x --duration requests, at least
--min-prompts; or --num-prompts), the same prompts and arrival times on both deployments.
The requests are spread over --client-processes client processes keeping one schedule
(`pdserve.bench.processes`): one process reads ~10k streamed tokens/s at most, and a client
that falls behind shows as TTFT. Each run records the busiest one's CPU share
(`client_cpu_fraction`): near 1, the client, not the server, set the pace.

SLOs (flags): prefill-heavy TTFT <= 2000 ms and TPOT <= 50 ms; decode-heavy TTFT <= 1000 ms
and TPOT <= 50 ms; a mix request is judged by its own class's SLOs.

Definitions (pdserve.bench.goodput):
- TTFT: from sending a request to its first token; TPOT: (end - TTFT) / (output tokens - 1).
- A request is within SLO when it succeeded and met both its TTFT and its TPOT SLO.
- A rate meets the SLOs when >= 90% (--attainment) of the requests sent at it are within
  SLO; failed requests count against it.
- The goodput of a deployment is the highest swept rate that meets the SLOs, every lower
  swept rate meeting them too (req/s; none when the lowest rate misses). Per rate we also
  report the fraction within SLO and the requests within SLO per second (count / run time).
- The same for each TPOT SLO of --tpot-slos-ms (TTFT SLOs unchanged): the strictest TPOT SLO
  at which the colocated pair has a goodput, and both deployments' goodput there, is the
  comparison to read.

What keeps a sweep short without changing any goodput:
- A run is cut off once no request still running can end within the loosest SLOs it is
  judged by (last arrival + pdserve.bench.goodput.slo_horizon_s, plus slack); cut-off
  requests fail. Latency percentiles are over completed requests, so they understate at a
  rate that was cut off (the table says how many were).
- A deployment's sweep of a workload stops at the first rate that misses even the loosest
  SLOs (unless --full-sweep): a higher rate is no faster.
- Before each run the workers get up to 2 minutes to become idle (nothing running, queued or
  in transfer: cut-off requests are aborted); a run that found them busy says so
  (`not_idle_before`).

How long: a run takes its arrivals (--duration) plus what its last requests need (decode-heavy:
up to 1500 tokens x TPOT), longer at a rate that misses (up to its cut-off). The defaults are
sized for the 8B model on two H200s: about 8-10 minutes in all (writing the model ~1 minute
unless --model-cache holds it, each deployment's start ~1 minute, ~3-4 minutes of runs each);
result.json records each deployment's `startup_s` and `elapsed_s`. Runs are short (8 s of
arrivals): at the higher decode-heavy rates the running batch is still filling when arrivals
stop, so those runs show a load ramping up, not a steady state (--duration 30 for that).

Output in --output-dir: result.json (everything, every request; rewritten after every run),
results.md (the definitions and tables, for RESULTS.md), goodput_WORKLOAD.png, logs/ (each
process's log). `python benchmarks/pd_goodput_report.py result.json` redraws tables and plots.

    NCCL_NVLS_ENABLE=0 python benchmarks/pd_goodput.py --preset llama-3.1-8b \\
        --output-dir pd_goodput_8b
    NCCL_NVLS_ENABLE=0 python benchmarks/pd_goodput.py --preset llama-3.2-1b \\
        --prefill-heavy-rates 4 8 16 32 --decode-heavy-rates 8 16 32 --mix-rates 8 16 32 \\
        --output-dir pd_goodput_1b
    python benchmarks/pd_goodput.py --smoke   # built-in tiny model on CPU, tcp transfer, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from pd_goodput_deploy import (
    Deployment,
    DeploymentSpec,
    deploy,
    router_has_worker_urls,
)
from pd_goodput_plan import (
    WORKLOADS,
    Batch,
    Plan,
    Workload,
    build_batch,
    parse_args,
    plan_from_args,
    run_deadline_s,
)
from pd_goodput_report import finish_report, print_report, write_outputs

from pdserve.bench.client import BenchClient, ClientSettings, RequestRecord, served_models
from pdserve.bench.goodput import attainment, meets
from pdserve.bench.metrics import SLO, summarize
from pdserve.bench.processes import run_load_in_processes
from pdserve.bench.runner import Load, arrival_offsets, warm_up
from pdserve.bench.workloads import Conversation, Turn

WARMUP_TOKENS = 4
IDLE_DEADLINE_S = 120.0


def run_rate(
    deployment: Deployment,
    settings: ClientSettings,
    plan: Plan,
    batch: Batch,
    rate: float,
    seed: int,
) -> dict:
    """One run at `rate`: its throughput, latency percentiles and SLO attainment."""
    waited = time.monotonic()
    not_idle = deployment.wait_idle(IDLE_DEADLINE_S)
    waited = time.monotonic() - waited
    offsets = arrival_offsets(len(batch.conversations), rate, seed)
    deadline = run_deadline_s(plan, batch, offsets)
    spread = run_load_in_processes(
        settings, batch.conversations, Load(rate), plan.client_processes, seed, deadline
    )
    result = spread.run
    # NOTE: the busiest client process's share of the run: near 1, the client set the pace.
    client_cpu = max(spread.cpu_s, default=0.0) / max(result.duration_s, 1e-9)
    records = result.records
    summary = summarize(records, result.duration_s, SLO())
    within = sum(map(batch.judge(), records))
    loosest = attainment(records, lambda r: _within_loosest(plan, batch, r))
    return {
        "rate": rate,
        "requests": len(records),
        "completed": summary["completed"],
        "failed": summary["failed"],
        "cut_off": sum("run's deadline" in (r.error or "") for r in records),
        "wrong_lengths": sum(r.success and r.output_tokens != r.max_tokens for r in records),
        "duration_s": result.duration_s,
        "deadline_s": deadline,
        "request_throughput": summary["request_throughput"],
        "output_throughput": summary["output_throughput"],
        "ttft_ms": _median_p99(summary["ttft_ms"]),
        "tpot_ms": _median_p99(summary["tpot_ms"]),
        "itl_ms": _median_p99(summary["itl_ms"]),
        "slo_attainment": within / len(records),
        "within_slo_per_s": within / result.duration_s,
        "meets": meets(within / len(records), plan.target),
        "loosest_slo_attainment": loosest,
        "attainment_by_tpot_slo": {
            _key(tpot): attainment(records, batch.judge(tpot)) for tpot in plan.tpot_slos_ms
        },
        "client_cpu_fraction": client_cpu,
        "not_idle_before": not_idle,
        "idle_wait_s": waited,
        "errors": summary["errors"],
        "request_records": [_record_json(r, batch) for r in records],
    }


def _within_loosest(plan: Plan, batch: Batch, record: RequestRecord) -> bool:
    kind = batch.kinds[record.conversation]
    return kind.slo(plan.loosest_tpot_ms(kind)).met(record)


def sweep(
    deployment: Deployment,
    settings: ClientSettings,
    plan: Plan,
    workload: Workload,
    vocab: int,
    runs: list[dict],
    save,
) -> None:
    """Every rate of `workload` in ascending order, until one misses the loosest SLOs; each
    run goes into `runs` and is saved as soon as it ends."""
    base = plan.seed + 1000 * list(WORKLOADS).index(workload.name)
    for index, rate in enumerate(workload.rates):
        # NOTE: the same prompts and arrivals for both deployments: seeded by (workload, rate).
        batch = build_batch(workload, plan.prompts_at(rate), vocab, base + index)
        run = run_rate(deployment, settings, plan, batch, rate, base + index)
        runs.append(run)
        save()
        print(_progress_line(deployment.name, workload.name, run), flush=True)
        if not plan.full_sweep and not meets(run["loosest_slo_attainment"], plan.target):
            skipped = workload.rates[index + 1 :]
            if skipped:
                print(f"  (higher rates {list(skipped)} skipped: this one misses)", flush=True)
            break


def warm_up_deployment(deployment: Deployment, settings: ClientSettings, plan: Plan, vocab: int):
    """A few short requests, each class's longest prompt twice (so that each replica behind a
    round-robin router sees one), untimed."""
    rng = random.Random(plan.seed - 1)
    kinds = {kind.name: kind for workload in plan.workloads for kind in workload.classes}
    conversations = []
    for kind in kinds.values():
        prompt = tuple(rng.randrange(vocab) for _ in range(kind.input_len.high))
        conversations += [Conversation((Turn(prompt, WARMUP_TOKENS),))] * 2

    async def go():
        client = BenchClient(settings)
        try:
            return await warm_up(client, conversations)
        finally:
            await client.aclose()

    for record in asyncio.run(go()):
        if not record.success:
            raise RuntimeError(f"a warm-up request to {deployment.url} failed: {record.error}")


def _median_p99(stats: dict) -> dict:
    return {"median": stats["median"], "p99": stats["p99"]}


def _key(tpot_ms: float) -> str:
    return f"{tpot_ms:g}"


def _record_json(record: RequestRecord, batch: Batch) -> dict:
    """A request without its per-chunk gaps (thousands per request), with its class."""
    data = record.to_json()
    del data["itl_s"]
    return {"class": batch.kinds[record.conversation].name, **data}


def _progress_line(deployment: str, workload: str, run: dict) -> str:
    tpot = run["tpot_ms"]["p99"]
    shown = "-" if tpot is None else f"{tpot:.1f} ms"
    verdict = "meets" if run["meets"] else "misses"
    cut = f", {run['cut_off']} cut off" if run["cut_off"] else ""
    return (
        f"{deployment:>13} {workload:<13} rate {run['rate']:g}/s: {run['requests']} requests"
        f"{cut}, {run['slo_attainment']:.0%} within SLO ({verdict}), P99 TPOT {shown}, "
        f"{run['duration_s']:.0f} s"
    )


def model_directory(args: argparse.Namespace, scratch: str) -> str:
    """--model-path; the built-in tiny model for a smoke run; else --preset with random
    weights, written under --model-cache (reused from an earlier run) or `scratch`."""
    if args.model_path is not None:
        return args.model_path
    if args.preset is None:
        from pdserve.synthetic.tiny_model import default_model_dir

        return str(default_model_dir())
    from pdserve.synthetic.random_model import make_random_model

    directory = Path(args.model_cache or scratch) / args.preset
    complete = directory / ".pd_goodput_complete"  # NOTE: written last: no partial model
    if complete.exists():
        print(f"using {directory}", flush=True)
        return str(directory)
    print(f"writing {args.preset} with random weights to {directory} ...", flush=True)
    make_random_model(directory, args.preset)
    complete.touch()
    return str(directory)


def engine_args(args: argparse.Namespace, plan: Plan) -> tuple[str, ...]:
    """Every worker's flags: a context for the longest request of any workload run."""
    longest = max(k.input_len.high + k.output_len.high for w in plan.workloads for k in w.classes)
    extra = ["--max-running-requests", str(args.max_running_requests)]
    return (
        "--max-model-len",
        str(longest),
        *(extra if args.max_running_requests else []),
        *shlex.split(args.engine_args),
    )


def new_report(args: argparse.Namespace, plan: Plan, model_path: str) -> dict:
    return {
        "benchmark": "pd_goodput",
        "model": args.preset or model_path,
        "smoke": args.smoke,
        "command": shlex.join([sys.executable, *sys.argv]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "definitions": definitions(plan),
        "tpot_slos_ms": list(plan.tpot_slos_ms),
        "attainment_target": plan.target,
        "deployments": {},
        "workloads": {
            w.name: {
                "classes": [
                    {
                        "name": k.name,
                        "input_len": str(k.input_len),
                        "output_len": str(k.output_len),
                        "ttft_slo_ms": k.ttft_slo_ms,
                        "tpot_slo_ms": k.tpot_slo_ms,
                    }
                    for k in w.classes
                ],
                "rates": list(w.rates),
                "results": {},
            }
            for w in plan.workloads
        },
    }


def definitions(plan: Plan) -> dict[str, str]:
    target = f"{plan.target:.0%}"
    return {
        "ttft": "seconds from sending a request to its first token (a chunk per token)",
        "tpot": "(end - ttft) / (output tokens - 1)",
        "within_slo": "succeeded, TTFT <= its class's TTFT SLO and TPOT <= the TPOT SLO",
        "meets": f"a rate meets the SLOs when >= {target} of the requests sent are within SLO",
        "goodput": "highest swept rate meeting the SLOs with every lower swept rate meeting "
        "them too (req/s); null when the lowest rate misses",
        "within_slo_per_s": "requests within SLO / the run's duration",
        "percentiles": "over completed requests; linear interpolation between closest ranks",
        "cut_off": "requests still running when no request could still end within the "
        "loosest SLO; they count as failed",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    try:
        plan = plan_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for workload in plan.workloads:
        counts = ", ".join(f"{rate:g}/s x {plan.prompts_at(rate)}" for rate in workload.rates)
        print(f"{workload.name}: {counts} requests", flush=True)
    single_replica = False
    if "colocated" in args.deployments and not router_has_worker_urls():
        if not args.smoke:
            print(
                "error: this pdserve's router has no --worker-urls (colocated mode), which the "
                "colocated pair needs; use a pdserve that has it",
                file=sys.stderr,
            )
            return 2
        print("warning: router without --worker-urls: colocated = one `serve`", file=sys.stderr)
        single_replica = True
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        model_path = model_directory(args, scratch)
        vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
        spec = DeploymentSpec(
            model_path=model_path,
            devices=tuple(args.devices),
            transfer_backend=args.transfer_backend,
            engine_args=engine_args(args, plan),
            log_dir=out / "logs",
            start_timeout_s=args.start_timeout,
            single_colocated_replica=single_replica,
        )
        report = new_report(args, plan, model_path)

        def save() -> None:
            finish_report(report)
            (out / "result.json").write_text(json.dumps(report, indent=1) + "\n")

        try:
            for name in args.deployments:
                run_deployment(name, spec, plan, vocab, report, save)
        finally:
            save()
    print_report(report)
    for path in write_outputs(report, out):
        print(f"wrote {path}")
    return 0


def run_deployment(name: str, spec: DeploymentSpec, plan: Plan, vocab: int, report, save):
    """Start deployment `name`, warm it up, sweep every workload, stop it."""
    started = time.monotonic()
    print(f"starting {name} ...", flush=True)
    with deploy(name, spec) as deployment:
        startup = time.monotonic() - started
        print(f"{name} up in {startup:.0f} s: {deployment.url}", flush=True)
        model = served_models(deployment.url, None)[0]
        settings = ClientSettings(deployment.url, model, logprobs=0)
        entry = report["deployments"][name] = {
            "description": deployment.description,
            "workers": deployment.worker_info(),
            "notes": deployment.notes,
            "startup_s": startup,
        }
        warm_up_deployment(deployment, settings, plan, vocab)
        for workload in plan.workloads:
            runs: list[dict] = []
            report["workloads"][workload.name]["results"][name] = {"runs": runs}
            sweep(deployment, settings, plan, workload, vocab, runs, save)
        entry["elapsed_s"] = time.monotonic() - started
    save()


if __name__ == "__main__":
    sys.exit(main())
