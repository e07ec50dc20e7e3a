"""`pdserve` command line. Every subcommand's engine flags are defined and turned into an
`EngineConfig` here, in one place."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from pdserve.bench import command as bench_command
from pdserve.engine.config import ATTENTION_BACKENDS
from pdserve.protocol.spec_settings import SpeculativeConfigError

POLICY_CHOICES = ("round_robin", "random", "least_load")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model-path", default=None, help="HF model directory (default: the built-in tiny model)"
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="attention kernels: auto is Triton on CUDA and the torch reference on CPU",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=256,
        help="largest decode batch replayed from a captured CUDA graph (Triton attention)",
    )
    g.add_argument(
        "--disable-cuda-graph", action="store_true", help="run every decode step eagerly"
    )
    g.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="schedule each step after the previous one's tokens are back (no overlap)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="bytes of KV cache (default: sized from --gpu-memory-utilization)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="fraction of GPU memory for weights, activations and KV cache",
    )
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=8192,
        help="prefill tokens per step; longer prompts are split (<= 0: never split)",
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=16384,
        help="prefill tokens per step when chunking is off",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's max_position_embeddings)",
    )
    g.add_argument("--seed", type=int, default=0)
    add_speculative_args(parser)


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding (SGLang's flags)")
    g.add_argument(
        "--speculative-algorithm",
        default=None,
        help="EAGLE, EAGLE3, STANDALONE, NGRAM or a registered plugin (default: off)",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="the draft model (EAGLE/EAGLE3 head, or a small LLM for STANDALONE)",
    )
    g.add_argument(
        "--speculative-num-steps", type=int, default=None, help="draft steps (default 3)"
    )
    g.add_argument(
        "--speculative-eagle-topk",
        type=int,
        default=None,
        help="branches per draft step; 1 drafts a chain, more a tree (default 1)",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="tokens verified per step, the last committed one included (default: "
        "num-steps + 1 for a chain, min(num-steps x topk, tree size) + 1 for a tree)",
    )


def spec_settings_from_args(args: argparse.Namespace):
    """SpecSettings from the --speculative-* flags, None when speculation is off."""
    from pdserve.protocol.spec_settings import SpecSettings, SpeculativeConfigError

    algorithm = getattr(args, "speculative_algorithm", None)
    shape = {
        "num_steps": args.speculative_num_steps,
        "eagle_topk": args.speculative_eagle_topk,
        "num_draft_tokens": args.speculative_num_draft_tokens,
    }
    if algorithm is None:
        given = [k for k, v in shape.items() if v is not None]
        if given or args.speculative_draft_model_path:
            raise SpeculativeConfigError(
                "--speculative-* settings given without --speculative-algorithm"
            )
        return None
    from pdserve.speculative import registry

    # Built-in names in any case, as SGLang takes them; plugins by their exact name.
    if algorithm.upper() in registry.RESERVED:
        algorithm = algorithm.upper()
    given = {k: v for k, v in shape.items() if v is not None}
    settings = SpecSettings(algorithm, args.speculative_draft_model_path, **given)
    # NOTE: check the algorithm and its draft path here, before any worker process starts.
    try:
        registry.get(settings.algorithm)(settings)
    except registry.UnknownAlgorithm as e:
        raise SpeculativeConfigError(e.args[0]) from None
    return settings


def engine_config_from_args(args: argparse.Namespace):
    from pdserve.engine.config import EngineConfig

    model_path = args.model_path
    if model_path is None:
        from pdserve.engine.tiny_model import default_model_dir

        model_path = str(default_model_dir())
    return EngineConfig(
        model_path=model_path,
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        attention_backend=args.attention_backend,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        disable_cuda_graph=args.disable_cuda_graph,
        disable_overlap_schedule=args.disable_overlap_schedule,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        speculative=spec_settings_from_args(args),
    )


def _generate(args: argparse.Namespace) -> int:
    from pdserve.engine.errors import InvalidRequestError
    from pdserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
    from pdserve.llm import LLM

    try:
        params = SamplingParams(
            max_new_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            stop=tuple(args.stop or ()),
            ignore_eos=args.ignore_eos,
        )
    except InvalidSamplingParams as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = LLM.from_config(engine_config_from_args(args))
    try:
        outputs = llm.generate(list(args.prompt), params, use_tqdm=False)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for output in outputs:
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": output.prompt,
                        "text": output.text,
                        "token_ids": output.token_ids,
                        "finish_reason": output.finish_reason,
                    }
                )
            )
        else:
            print(f"{output.prompt!r} -> {output.text!r} ({output.finish_reason})")
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from pdserve.engine.tiny_model import make_tiny_model

    path = make_tiny_model(
        args.out_dir,
        args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        seed=args.seed,
    )
    print(path)
    return 0


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model name the API reports and accepts (default: the model path)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY; /health, "
        "/health_generate and /metrics stay open)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="waiting requests beyond this are refused with 429",
    )
    add_shutdown_timeout_arg(g)


def add_shutdown_timeout_arg(parser) -> None:
    """Workers and the router: how long SIGTERM waits for requests in flight."""
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests may take to finish after SIGTERM (new connections "
        "are refused at once); keep it under the pod's terminationGracePeriodSeconds",
    )


def check_shutdown_timeout(args: argparse.Namespace) -> None:
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")


def add_transfer_args(parser: argparse.ArgumentParser, role: str) -> None:
    g = parser.add_argument_group("KV transfer")
    g.add_argument(
        "--transfer-backend",
        default="tcp",
        choices=["tcp", "nccl", "gloo"],
        help="tcp (ZMQ, anywhere), nccl (GPU to GPU), gloo (CPU stand-in for nccl)",
    )
    if role == "prefill":
        g.add_argument(
            "--bootstrap-port",
            type=int,
            default=8998,
            help="where decode workers fetch KV from this worker (0: pick a free port)",
        )
    if role == "decode":
        g.add_argument(
            "--bootstrap-allow",
            default=None,
            help="comma-separated addresses/CIDRs of prefill workers this worker may contact "
            "(default: loopback and this host's attached networks)",
        )
    g.add_argument(
        "--bootstrap-host",
        default=None,
        help="address for transfer endpoints (default: --host); use this node's reachable "
        "address across nodes",
    )
    g.add_argument(
        "--transfer-timeout",
        type=float,
        default=30.0,
        help="seconds a room may make no progress before it fails",
    )
    g.add_argument(
        "--transfer-peer-timeout",
        type=float,
        default=5.0,
        help="seconds of silence after which a peer worker counts as dead",
    )
    g.add_argument(
        "--transfer-token",
        default=None,
        help="shared secret both workers present (default: $PDSERVE_TRANSFER_TOKEN)",
    )


def _split_list(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(t.strip() for t in text.split(",") if t.strip())


def worker_role_from_args(args: argparse.Namespace, kind: str):
    """The worker's role, with the factory that builds its engine and handoff: the one place
    that names the role packages (the server only hands the factory on)."""
    import functools
    import os

    from pdserve.server.role import WorkerRole

    if kind == "colocated":
        from pdserve.colocated.worker import build_worker

        return WorkerRole(kind, build_worker)
    from pdserve.transfer.config import TransferConfig

    if kind == "prefill":
        from pdserve.prefill.worker import build_worker
    else:
        from pdserve.decode.worker import build_worker
    transfer = TransferConfig(
        backend=args.transfer_backend,
        bootstrap_host=args.bootstrap_host or args.host,
        bootstrap_port=getattr(args, "bootstrap_port", 0),
        progress_timeout_s=args.transfer_timeout,
        peer_timeout_s=args.transfer_peer_timeout,
        heartbeat_interval_s=min(1.0, args.transfer_peer_timeout / 4),
        auth_token=args.transfer_token or os.environ.get("PDSERVE_TRANSFER_TOKEN", ""),
        bootstrap_allow=_split_list(getattr(args, "bootstrap_allow", None)),
    )
    return WorkerRole(kind, functools.partial(build_worker, transfer=transfer), transfer.backend)


def _serve(args: argparse.Namespace, kind: str = "colocated") -> int:
    import uvicorn

    from pdserve.server.app import build_app

    try:
        check_shutdown_timeout(args)
        config = engine_config_from_args(args)
        role = worker_role_from_args(args, kind)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hidden = ("func", "api_key", "transfer_token")
    server_args = {k: v for k, v in vars(args).items() if k not in hidden}
    server_args["model_path"] = config.model_path
    app = build_app(
        config,
        role,
        served_model_name=args.served_model_name,
        api_key=api_key_from(args),
        max_queued_requests=args.max_queued_requests,
        server_args=server_args,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    return 0


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker and, optionally, its bootstrap port (default: asked from the "
        "worker); repeat for several",
    )
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="repeat for several"
    )
    parser.add_argument(
        "--prefill-service",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="discover prefill workers: every address NAME resolves to (e.g. a Kubernetes "
        "headless Service) is a worker serving on PORT; re-resolved every health check",
    )
    parser.add_argument(
        "--decode-service",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="discover decode workers the same way",
    )
    parser.add_argument("--policy", default="round_robin", choices=POLICY_CHOICES)
    parser.add_argument("--prefill-policy", default=None, choices=POLICY_CHOICES)
    parser.add_argument("--decode-policy", default=None, choices=POLICY_CHOICES)
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds a request may take"
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to open a connection to a worker before it counts as unreachable",
    )
    parser.add_argument(
        "--dead-worker-timeout",
        type=float,
        default=15.0,
        help="seconds after which a connection to a worker that stopped answering (host or "
        "link down: no TCP keepalive replies, data unacknowledged) fails",
    )
    parser.add_argument("--health-check-interval", type=float, default=2.0)
    parser.add_argument(
        "--max-body-size",
        type=int,
        default=32 << 20,
        metavar="BYTES",
        help="request bodies over this are refused with 413 as they stream in (default: 32 MiB)",
    )
    parser.add_argument(
        "--max-requests-per-worker",
        type=int,
        default=0,
        help="requests this router keeps in flight on one worker at most; when every worker "
        "of a role is at it, new requests get 429 (default 0: no bound)",
    )
    parser.add_argument(
        "--max-rooms-per-request",
        type=int,
        default=256,
        help="a request with several prompts or n > 1 takes one prefill/decode room per "
        "(prompt, choice); requests asking for more get 400 (default 256)",
    )
    add_shutdown_timeout_arg(parser)
    parser.add_argument(
        "--health-check-timeout",
        type=float,
        default=2.0,
        help="seconds a worker's /health (and a DNS lookup) may take",
    )


def router_config_from_args(args: argparse.Namespace):
    from pdserve.router.config import RouterConfig
    from pdserve.router.discovery import ServiceName

    prefill = []
    for entry in args.prefill:
        if len(entry) > 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(entry)}")
        try:
            port = int(entry[1]) if len(entry) == 2 else None
        except ValueError:
            raise ValueError(
                f"--prefill bootstrap port must be a number, got {entry[1]!r}"
            ) from None
        prefill.append((entry[0], port))
    return RouterConfig(
        prefill=tuple(prefill),
        decode=tuple(args.decode),
        prefill_services=tuple(ServiceName.parse(s) for s in args.prefill_service),
        decode_services=tuple(ServiceName.parse(s) for s in args.decode_service),
        prefill_policy=args.prefill_policy or args.policy,
        decode_policy=args.decode_policy or args.policy,
        api_key=api_key_from(args),
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
        dead_worker_timeout_s=args.dead_worker_timeout,
        health_check_interval_s=args.health_check_interval,
        health_check_timeout_s=args.health_check_timeout,
        max_body_bytes=args.max_body_size,
        max_requests_per_worker=args.max_requests_per_worker,
        max_rooms_per_request=args.max_rooms_per_request,
    )


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key, else $PDSERVE_API_KEY (a Secret mounted as env stays off the command
    line, where `ps` would show it)."""
    import os

    return args.api_key or os.environ.get("PDSERVE_API_KEY") or None


def _router(args: argparse.Namespace) -> int:
    import uvicorn

    from pdserve.router.app import build_router_app

    try:
        check_shutdown_timeout(args)
        config = router_config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(
        build_router_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    return 0


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port", type=int, default=8000, help="the router's port (0: pick a free one)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address everything binds")
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--transfer-backend", default="tcp", choices=["tcp", "nccl", "gloo"])
    parser.add_argument("--policy", default="round_robin", choices=POLICY_CHOICES)
    parser.add_argument(
        "--gpus",
        default=None,
        help="comma-separated GPU ids; worker k (prefill first) runs on gpus[k %% len]",
    )
    parser.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds to wait for healthy workers"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restart a worker or the router that exits, on the same ports, at most this many "
        "times in 10 minutes; past that, stop everything (0: stop at the first exit)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="send the example request through the router, print the answer, stop everything",
    )


def _launch(args: argparse.Namespace) -> int:
    from pdserve.launch import launch_from_args

    return launch_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="pdserve: prefill/decode-disaggregated LLM serving"
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation for one or more prompts")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="colocated worker: OpenAI + SGLang-native HTTP API")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=_serve)

    for kind, text in (
        ("prefill", "prefill worker: prefills and sends KV to decode workers"),
        ("decode", "decode worker: receives KV from prefill workers and decodes"),
    ):
        worker = sub.add_parser(kind, help=text)
        add_server_args(worker)
        add_engine_args(worker)
        add_transfer_args(worker, kind)
        worker.set_defaults(func=lambda args, kind=kind: _serve(args, kind))

    router = sub.add_parser("router", help="OpenAI front end over prefill and decode workers")
    add_router_args(router)
    router.set_defaults(func=_router)

    launch = sub.add_parser(
        "launch", help="router + prefill + decode workers on this machine, until Ctrl-C"
    )
    add_launch_args(launch)
    add_engine_args(launch)
    launch.set_defaults(func=_launch)

    tiny = sub.add_parser("make-tiny-model", help="write a small seeded random model directory")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--num-heads", type=int, default=4)
    tiny.add_argument("--num-kv-heads", type=int, default=2)
    tiny.add_argument("--intermediate-size", type=int, default=128)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    train = sub.add_parser(
        "train-eagle",
        help="train an EAGLE-3 draft head for a target on the target's own generations",
    )
    add_train_eagle_args(train)
    train.set_defaults(func=_train_eagle)

    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (any URL)")
    bench_command.add_arguments(bench)
    bench.set_defaults(func=bench_command.run)
    return parser


def add_train_eagle_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="the target model directory")
    parser.add_argument("--out", required=True, help="where to write the draft directory")
    parser.add_argument("--num-sequences", type=int, default=256, help="generated sequences")
    parser.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens")
    parser.add_argument("--gen-len", type=int, default=112, help="tokens generated per prompt")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--ttt-steps", type=int, default=4, help="training-time-test unroll (draft steps)"
    )
    parser.add_argument(
        "--aux-layers",
        type=int,
        nargs="+",
        default=None,
        help="target layers the head reads (default [2, L // 2, L - 3])",
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=4096,
        help="the head predicts the most frequent target tokens only (d2t maps them)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)


def _train_eagle(args: argparse.Namespace) -> int:
    from pdserve.speculative.train_eagle import TrainConfig, train_eagle

    try:
        config = TrainConfig(
            model_path=args.model_path,
            out_dir=args.out,
            num_sequences=args.num_sequences,
            prompt_len=args.prompt_len,
            gen_len=args.gen_len,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            ttt_steps=args.ttt_steps,
            aux_layer_ids=tuple(args.aux_layers) if args.aux_layers else None,
            draft_vocab_size=args.draft_vocab_size,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = train_eagle(config)
    print(
        json.dumps(
            {
                "draft": str(report.out_dir),
                "train_seconds": round(report.train_seconds, 1),
                "final_loss": round(report.final_loss, 4),
                "held_out_accuracy_per_step": [round(a, 4) for a in report.eval_accuracy],
                "serve_with": f"--speculative-algorithm EAGLE3 --speculative-draft-model-path "
                f"{report.out_dir}",
            }
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pdserve.launch import watch_parent

    watch_parent()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # NOTE: httpx logs every request at INFO: the router and launcher make many.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return args.func(args)
    except SpeculativeConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
