"""What several subcommands share: the model argument, the engine flags, `--log-level`, port
checks, and running an HTTP app so that a start-up failure is one line."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import socket
import sys

from pdserve.edge.http_guard import (
    ConnectionLimits,
    connection_cap,
    protocol_factory,
    raise_open_file_limit,
)
from pdserve.engine.checkpoint.model_files import refuse_remote_code, resolve_model_dir
from pdserve.engine.core.config import EngineConfig
from pdserve.protocol.flags import add_flags, given, settings_from_args
from pdserve.protocol.http_settings import HttpSettings
from pdserve.protocol.spec_settings import SpecSettings, SpeculativeConfigError

logger = logging.getLogger("pdserve")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
BUILT_IN_MODEL_NAME = "tiny-llama"


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default, except where the help already says it (flags declared on
    settings dataclasses do) or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS, [], ())
        if shown and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser that refuses flags it does not know itself, with its own usage
    (`pdserve bench`'s for a bench flag), not the top-level parser's (which names none)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(unknown_flags(extras, self))
        return namespace, extras


def unknown_flags(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """What argparse says of flags it does not know, with "did you mean" for each close to a
    known one: a user coming from vLLM or SGLang types their names (`--max-model-length`)."""
    known = [o for action in parser._actions for o in action.option_strings]
    lines = [f"unrecognized arguments: {' '.join(unknown)}"]
    for word in unknown:
        if not word.startswith("--"):
            continue
        close = difflib.get_close_matches(word.split("=", 1)[0], known, n=2, cutoff=0.6)
        if close:
            lines.append(f"{word}: did you mean {' or '.join(close)}?")
    return "; ".join(lines)


def add_log_level(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """`--log-level`, on the top-level parser (default) and on each subcommand (given there,
    it wins)."""
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=default if default is not None else argparse.SUPPRESS,
        help="how much to log" + (" (default: %(default)s)" if default else ""),
    )


# --- the model and the engine ----------------------------------------------------------------


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model as a positional argument (as `vllm serve MODEL`) or `--model-path`, with
    the hub revision, and `--trust-remote-code` (accepted only to be refused clearly)."""
    parser.add_argument("model", nargs="?", default=None, help="the model (same as --model-path)")
    parser.add_argument(
        "--model-path",
        default=None,
        help="a model directory, a .gguf file or a Hugging Face hub id "
        "(default: the built-in tiny model)",
    )
    parser.add_argument(
        "--revision", default=None, help="branch, tag or commit of a hub model id (default: main)"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="refused: pdserve never runs code shipped with a checkpoint",
    )


def model_path_from(args: argparse.Namespace) -> tuple[str, str]:
    """(the model's local directory, the name it is served as by default): a hub id is
    downloaded or a GGUF file converted here, once, before any worker starts; the built-in
    tiny model when none is given. Checks that the directory holds a model pdserve can run."""
    if args.trust_remote_code:
        refuse_remote_code()
    if args.model and args.model_path and args.model != args.model_path:
        raise ValueError(
            f"the model is given twice: {args.model!r} and --model-path {args.model_path!r}"
        )
    given = args.model or args.model_path
    if given is None:
        if args.revision is not None:
            raise ValueError("--revision needs a hub model id (--model-path ORG/NAME)")
        from pdserve.synthetic.tiny_model import default_model_dir

        return str(default_model_dir()), BUILT_IN_MODEL_NAME
    model_dir = resolve_model_dir(given, args.revision)
    check_model_dir(model_dir, given)
    return str(model_dir), given


def check_model_dir(model_dir: str | os.PathLike, name: str) -> None:
    """A model directory pdserve can load: it has a config.json naming a supported
    architecture (read from config.json alone, before any process starts)."""
    from pdserve.engine.checkpoint.model_config import ModelConfig

    try:
        ModelConfig.from_pretrained(model_dir)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ValueError(f"cannot serve {name!r}: {e}") from None


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_flags(parser.add_argument_group("engine"), EngineConfig, skip=("model_path",))
    add_flags(parser.add_argument_group("speculative decoding (SGLang's flags)"), SpecSettings)


def engine_config_from_args(args: argparse.Namespace, model_path: str) -> EngineConfig:
    return settings_from_args(
        EngineConfig, args, model_path=model_path, speculative=spec_settings_from_args(args)
    )


def check_cuda_visible(device: str, gpus: tuple[str, ...] | None = None) -> None:
    """Refuse `--device cuda[:N]` (or `--gpus`) on a machine where torch sees no CUDA GPU, in
    one line before any process starts: else the engine fails in its own process, later."""
    if gpus and device == "cpu":
        raise ValueError(f"--gpus {','.join(gpus)} picks GPUs, but --device cpu uses none")
    if not (device.startswith("cuda") or gpus):
        return
    import torch

    if torch.cuda.device_count() > 0:
        return
    asked = f"--gpus {','.join(gpus)}" if gpus else f"--device {device}"
    fix = "leave --gpus out" if gpus else "use --device cpu"
    why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
    raise ValueError(f"{asked}: CUDA is not available on this machine ({why}); {fix}")


def spec_settings_from_args(args: argparse.Namespace) -> SpecSettings | None:
    """SpecSettings from the --speculative-* flags, None when speculation is off. The
    algorithm is looked up (and its draft checked) here, before any worker process starts."""
    values = given(SpecSettings, args)
    algorithm = values.pop("algorithm", None)
    if algorithm is None:
        if values:
            raise SpeculativeConfigError(
                "--speculative-* settings given without --speculative-algorithm"
            )
        return None
    from pdserve.speculative import registry

    # NOTE: built-in names in any case, as SGLang takes them; plugins by their exact name.
    if algorithm.upper() in registry.RESERVED:
        algorithm = algorithm.upper()
    settings = SpecSettings(algorithm, **values)
    try:
        registry.get(settings.algorithm)(settings)
    except registry.UnknownAlgorithm as e:
        raise SpeculativeConfigError(e.args[0]) from None
    return settings


# --- HTTP processes --------------------------------------------------------------------------


def add_http_flags(
    parser: argparse.ArgumentParser, *, port: int, skip: tuple[str, ...] = ()
) -> None:
    add_flags(parser.add_argument_group("server"), HttpSettings, skip=skip, defaults={"port": port})


def http_settings_from_args(args: argparse.Namespace, *, port: int) -> HttpSettings:
    return settings_from_args(HttpSettings, args, defaults={"port": port})


def check_port_free(host: str, port: int, flag: str) -> None:
    """Refuse a port something else holds, before anything slow (a model load) starts."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"{flag} {port} on {host} is not free: {e.strerror}") from None


class StartupFailed(RuntimeError):
    """The app could not start (its engine did not come up); the message says why."""


def uvicorn_config(app, settings: HttpSettings, log_level: str):
    """How every pdserve HTTP process serves: uvicorn with httptools (a dependency of
    pdserve's, so never h11) through `http_guard`'s protocol, which bounds the header time,
    size and count, the body time and the connections (the open-file limit raised to its
    hard limit first, so that the cap can be generous). No uvicorn access lines: the router
    and the workers write their own, naming the request's id."""
    import uvicorn

    limits = ConnectionLimits(
        header_timeout_s=settings.header_timeout,
        body_timeout_s=settings.body_timeout,
        max_header_bytes=settings.max_header_bytes,
        max_header_count=settings.max_header_count,
        max_connections=connection_cap(settings.max_connections, raise_open_file_limit()),
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol_factory(limits),
        log_level=log_level,
        access_log=False,
        lifespan="off",  # NOTE: run below, so that its failure is ours to report
        timeout_graceful_shutdown=settings.shutdown_timeout,
    )


def serve_http(
    app,
    settings: HttpSettings,
    log_level: str,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Serve `app` until SIGTERM/SIGINT, then stop as `http_shutdown` says. Its start-up (the
    engine process) runs before the socket is bound, and a failure there is one `error:`
    line (the traceback at debug level), exit code 1. sockets: listening sockets to serve on
    instead of binding `settings`' host and port."""

    from pdserve.commands.http_shutdown import DrainingServer, exit_as_signalled, signals_held

    config = uvicorn_config(app, settings, log_level)

    async def run() -> list[int]:
        try:
            lifespan = app.router.lifespan_context(app)
            await lifespan.__aenter__()
        except Exception as e:
            logger.debug("start-up failed", exc_info=True)
            raise StartupFailed(str(e)) from None
        server = DrainingServer(
            config, settings.shutdown_timeout, lambda: getattr(app.state, "end_requests", None)
        )
        # NOTE: the app shuts down (a worker stops its engine) before the signal acts.
        with signals_held(server) as held:
            try:
                await server.serve(sockets=sockets)
            finally:
                await lifespan.__aexit__(None, None, None)
        return held

    # NOTE: uvicorn's own loop (uvloop when installed), as uvicorn.run would pick it.
    loop_factory = config.get_loop_factory() if hasattr(config, "get_loop_factory") else None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            held = runner.run(run())
    except StartupFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return exit_as_signalled(held)
