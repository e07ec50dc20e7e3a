"""Flags declared once, on the settings dataclasses: every flag parses to its field, turns back
into the argv that parses to the same settings, and `pdserve launch` takes every flag a worker
or the router takes and hands it on unchanged."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pdserve.cli import build_parser, main
from pdserve.engine.core.config import EngineConfig
from pdserve.launch import LaunchConfig
from pdserve.protocol.flags import add_flags, declared, option, settings_from_args, to_argv
from pdserve.protocol.http_settings import HttpSettings
from pdserve.protocol.spec_settings import SpecSettings
from pdserve.router.config import RouterConfig
from pdserve.speculative.training.train_config import TrainConfig
from pdserve.transfer.config import TransferConfig

WORKERS = {"prefill": (("http://p:1", 7000),), "decode": ("http://d:2",)}

# A value other than the default for every flag of every settings class, and what the class
# needs besides. A flag added without a row here fails `test_every_flag_has_a_sample`.
SAMPLES = {
    EngineConfig: (
        {"model_path": "m"},
        {
            "dtype": "bfloat16",
            "device": "cuda:1",
            "page_size": 32,
            "kv_cache_memory": 1 << 30,
            "gpu_memory_utilization": 0.5,
            "max_running_requests": 8,
            "chunked_prefill_size": 512,
            "max_prefill_tokens": 1024,
            "max_model_len": 4096,
            "seed": 7,
            "attention_backend": "torch",
            "cuda_graph_max_bs": 16,
            "disable_cuda_graph": True,
            "disable_overlap_schedule": True,
            "disable_prefix_caching": True,
            "tp_size": 2,
            "nnodes": 2,
            "node_rank": 1,
            "dist_init_addr": "10.0.0.1:29500",
            "disable_custom_all_reduce": True,
            "enable_two_batch_overlap": True,
            "stream_interval": 4,
            "cpu_threads": 3,
        },
    ),
    SpecSettings: (
        {},
        {
            "algorithm": "EAGLE",
            "draft_model_path": "/d",
            "num_steps": 4,
            "eagle_topk": 2,
            "num_draft_tokens": 6,
        },
    ),
    TransferConfig: (
        {},
        {
            "backend": "gloo",
            "bootstrap_host": "10.0.0.5",
            "bootstrap_port": 9000,
            "progress_timeout_s": 12.5,
            "peer_timeout_s": 3.0,
            "auth_token": "secret",
            "piece_bytes": 0,
            "bootstrap_allow": ("10.0.0.0/8", "127.0.0.1"),
        },
    ),
    RouterConfig: (
        WORKERS,
        {
            "request_timeout_s": 60.0,
            "connect_timeout_s": 1.5,
            "dead_worker_timeout_s": 9.0,
            "health_check_interval_s": 0.5,
            "health_check_timeout_s": 0.75,
            "max_body_bytes": 4096,
            "max_requests_per_worker": 4,
            "max_rooms_per_request": 8,
            "router_processes": 2,
            "cache_threshold": 0.7,
            "balance_abs_threshold": 8,
            "balance_rel_threshold": 1.5,
        },
    ),
    HttpSettings: (
        {},
        {
            "host": "0.0.0.0",
            "port": 1234,
            "api_key": "key",
            "shutdown_timeout": 1.0,
            "header_timeout": 3.0,
            "body_timeout": 4.0,
            "max_header_bytes": 1000,
            "max_header_count": 10,
            "max_connections": 50,
            "served_model_name": "name",
            "max_queued_requests": 5,
            "chat_template": "{{ messages }}",
        },
    ),
    TrainConfig: (
        {"model_path": "t", "out_dir": "o"},
        {
            "prompts_file": "p.jsonl",
            "num_sequences": 8,
            "answers_per_prompt": 3,
            "sequences_file": "s.safetensors",
            "prompt_len": 4,
            "gen_len": 8,
            "steps": 3,
            "batch_size": 2,
            "lr": 0.01,
            "ttt_steps": 2,
            "aux_layer_ids": (0, 1, 3),
            "draft_vocab_size": 64,
            "device": "cpu",
            "dtype": "float32",
            "seed": 3,
        },
    ),
    LaunchConfig: (
        {},
        {
            "num_prefill": 2,
            "num_decode": 3,
            "gpus": ("0", "1"),
            "prefill_tp_size": 2,
            "decode_tp_size": 4,
            "start_timeout": 30.0,
            "max_restarts": 0,
            "check": True,
            "log_dir": "/tmp/logs",
        },
    ),
}
SECRETS = {"api_key": "PDSERVE_API_KEY", "auth_token": "PDSERVE_TRANSFER_TOKEN"}


def _sample(settings: type):
    required, changed = SAMPLES[settings]
    return settings(**required, **changed)


@pytest.mark.parametrize("settings", list(SAMPLES), ids=lambda s: s.__name__)
def test_every_flag_has_a_sample(settings):
    required, changed = SAMPLES[settings]
    flags = {d.field: d.default for d in declared(settings)}
    assert set(flags) == set(changed) | (set(flags) & set(required))
    for field, value in changed.items():
        assert value != flags[field], f"{settings.__name__}.{field}: the sample is the default"


@pytest.mark.parametrize("settings", list(SAMPLES), ids=lambda s: s.__name__)
def test_settings_turn_into_argv_that_parses_back_to_them(settings, monkeypatch):
    for variable in SECRETS.values():
        monkeypatch.delenv(variable, raising=False)
    required, _ = SAMPLES[settings]
    original = _sample(settings)
    parser = argparse.ArgumentParser()
    add_flags(parser, settings)
    argv = to_argv(original)
    assert not {"secret", "key"} & set(argv), "a secret went onto the argv"
    flagged = {d.field for d in declared(settings)}
    fields = {f: v for f, v in required.items() if f not in flagged}
    fields |= {f: getattr(original, f) for f in SECRETS if hasattr(original, f)}
    parsed = settings_from_args(settings, parser.parse_args(argv), **fields)
    assert parsed == original


def test_flags_not_given_leave_the_dataclass_defaults():
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    assert settings_from_args(EngineConfig, parser.parse_args([]), model_path="m") == (
        EngineConfig("m")
    )
    assert to_argv(EngineConfig("m")) == []


def test_a_secret_comes_from_its_environment_variable(monkeypatch):
    parser = argparse.ArgumentParser()
    add_flags(parser, HttpSettings)
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert settings_from_args(HttpSettings, parser.parse_args([])).api_key == "from-env"
    given = parser.parse_args(["--api-key", "from-flag"])
    assert settings_from_args(HttpSettings, given).api_key == "from-flag"


def test_a_field_of_another_type_cannot_be_a_flag():
    @dataclasses.dataclass(frozen=True)
    class Odd:
        mapping: dict = option(None, "not a flag type")  # noqa: RUF009

    with pytest.raises(TypeError, match="must be int, float, str, bool or a tuple"):
        add_flags(argparse.ArgumentParser(), Odd)


def test_help_shows_each_default():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "(default: 16)" in text  # --page-size, from EngineConfig
    assert "(default: 30000)" in text  # --port, a worker's
    assert "(default: $PDSERVE_API_KEY)" in text


def test_launch_help_says_it_makes_a_transfer_token_when_none_is_given():
    text = build_parser()._subparsers._group_actions[0].choices["launch"].format_help()
    words = " ".join(text.split())
    assert "(default: $PDSERVE_TRANSFER_TOKEN, else a random one for launch's workers)" in words


def test_vllm_flag_names_are_aliases_shown_in_help():
    vllm = ["--tensor-parallel-size", "2", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"]
    parsed = build_parser().parse_args(["serve", *vllm, "--no-enable-prefix-caching"])
    engine = settings_from_args(EngineConfig, parsed, model_path="m")
    assert (engine.tp_size, engine.max_running_requests, engine.chunked_prefill_size) == (2, 8, 512)
    assert engine.disable_prefix_caching
    on = build_parser().parse_args(["serve", "--enable-prefix-caching"])
    assert not settings_from_args(EngineConfig, on, model_path="m").disable_prefix_caching
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for alias in ("--tensor-parallel-size", "--max-num-seqs", "--max-num-batched-tokens"):
        assert alias in text
    assert "--enable-prefix-caching" in text and "--no-enable-prefix-caching" in text


def test_an_unknown_flag_gets_a_did_you_mean(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(
            ["serve", "--max-model-length", "9", "--gpu-memory-utilisation", "1"]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--max-model-length: did you mean --max-model-len" in err, err
    assert "--gpu-memory-utilisation: did you mean --gpu-memory-utilization" in err, err


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    from pdserve.engine.text.chat_template import ChatTemplateError, load_chat_template

    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    file = tmp_path / "t.jinja"
    file.write_text(inline)
    assert load_chat_template(inline) == inline
    assert load_chat_template(str(file)) == inline
    with pytest.raises(ChatTemplateError, match="no such file, and not a Jinja template"):
        load_chat_template(str(tmp_path / "absent.jinja"))
    with pytest.raises(ChatTemplateError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")


# --- launch hands every flag on -------------------------------------------------------------


def _options(command: str) -> set[str]:
    parser = build_parser()._subparsers._group_actions[0].choices[command]
    return {o for action in parser._actions for o in action.option_strings}


# What launch decides itself: each worker's port and bootstrap port, the router's workers.
LAUNCH_DECIDES = {"--bootstrap-port", "--prefill", "--decode", "--prefill-service"}
LAUNCH_DECIDES |= {"--decode-service", "--worker-urls"}


@pytest.mark.parametrize("role", ["serve", "prefill", "decode", "router"])
def test_launch_takes_every_flag_a_worker_or_the_router_takes(role):
    assert _options(role) - _options("launch") - LAUNCH_DECIDES == set()


def _launch_plan(argv: list[str], monkeypatch):
    import pdserve.commands.launch as launch_command

    monkeypatch.setattr(launch_command, "check_port_free", lambda *a: None)
    monkeypatch.setattr(launch_command, "check_cuda_visible", lambda *a: None)
    monkeypatch.setattr(launch_command, "model_path_from", lambda args: ("/m", "/m"))
    args = build_parser().parse_args(["launch", *argv])
    return launch_command.configure(args).args[0]


def _non_default_argv(*settings: type, skip: tuple[str, ...] = ()) -> list[str]:
    argv = []
    for cls in settings:
        argv += to_argv(_sample(cls), skip=skip)
    return argv


def test_launch_hands_every_worker_and_router_flag_on(monkeypatch):
    for variable in SECRETS.values():
        monkeypatch.delenv(variable, raising=False)
    engine = _non_default_argv(EngineConfig, SpecSettings)
    http = _non_default_argv(HttpSettings, skip=("host", "port"))
    transfer = _non_default_argv(TransferConfig, skip=("bootstrap_port",))
    router = [*_non_default_argv(RouterConfig), "--prefill-policy", "random"]
    secrets = ["--api-key", "k", "--transfer-token", "t"]
    plan = _launch_plan([*engine, *http, *transfer, *router, *secrets], monkeypatch)

    parser = build_parser()
    for kind in ("prefill", "decode"):
        worker = parser.parse_args([*plan.worker_argv(kind), "--port", "1"])
        assert dataclasses.replace(
            settings_from_args(EngineConfig, worker, model_path="/m"),
            speculative=settings_from_args(SpecSettings, worker),
        ) == dataclasses.replace(
            _sample(EngineConfig), model_path="/m", speculative=_sample(SpecSettings)
        )
        for field in (
            "served_model_name",
            "max_queued_requests",
            "shutdown_timeout",
            "header_timeout",
            "body_timeout",
            "max_connections",
        ):
            assert getattr(worker, field) == getattr(_sample(HttpSettings), field)
        sent = settings_from_args(TransferConfig, worker, skip=("bootstrap_port",))
        expected = _sample(TransferConfig)
        for field in ("backend", "bootstrap_host", "progress_timeout_s", "peer_timeout_s"):
            assert getattr(sent, field) == getattr(expected, field)
        if kind == "decode":
            assert sent.bootstrap_allow == expected.bootstrap_allow
    router_args = parser.parse_args(plan.router_argv([("http://p:1", 7000)], ["http://d:2"]))
    from pdserve.commands.router import router_config_from_args

    got = router_config_from_args(router_args)
    assert got == dataclasses.replace(_sample(RouterConfig), prefill_policy="random")
    # NOTE: secrets travel in the environment, never on a command line.
    assert plan.child_env == {"PDSERVE_API_KEY": "k", "PDSERVE_TRANSFER_TOKEN": "t"}
    everything = plan.worker_argv("prefill") + plan.router_argv([("http://p:1", 7)], ["http://d:2"])
    assert "k" not in everything and "t" not in everything


def test_launch_without_a_transfer_token_makes_one_for_its_workers(monkeypatch):
    monkeypatch.delenv("PDSERVE_TRANSFER_TOKEN", raising=False)
    plans = [_launch_plan([], monkeypatch) for _ in range(2)]
    tokens = [plan.transfer.auth_token for plan in plans]
    assert all(len(token) >= 32 for token in tokens) and tokens[0] != tokens[1]
    plan = plans[0]
    assert plan.child_env["PDSERVE_TRANSFER_TOKEN"] == tokens[0]
    argv = plan.worker_argv("prefill") + plan.worker_argv("decode")
    assert not any(tokens[0] in arg for arg in argv)  # NOTE: never on a command line
    monkeypatch.setenv("PDSERVE_TRANSFER_TOKEN", "given")
    assert _launch_plan([], monkeypatch).transfer.auth_token == "given"


# --- main: one error line, exit 2 -----------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--page-size", "0"], "--page-size must be >= 1"),
        (["serve", "--max-num-seqs", "0"], "--max-running-requests must be >= 1, got 0"),
        (["serve", "/no/such/model"], "model '/no/such/model' does not exist"),
        (["serve", "--trust-remote-code"], "--trust-remote-code is refused"),
        (["serve", "absent.gguf"], "GGUF file 'absent.gguf' does not exist"),
        (["serve", ".", "--revision", "v1"], "--revision 'v1' applies to Hugging Face hub ids"),
        (["serve", "--revision", "v1"], "--revision needs a hub model id"),
        (["serve", "a", "--model-path", "b"], "the model is given twice"),
        (["prefill", "--bootstrap-host", "0.0.0.0"], "--bootstrap-host"),
        (["serve", "--speculative-num-steps", "2"], "without --speculative-algorithm"),
        (["launch", "--num-prefill", "0"], "--num-prefill and --num-decode"),
        (["launch", "--request-timeout", "0"], "--request-timeout must be positive"),
        (["router", "--decode", "http://d:2"], "--prefill-service"),
        (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
        (["serve", "--chat-template", "absent.jinja"], "--chat-template 'absent.jinja': no such"),
    ],
)
def test_bad_settings_are_one_error_line_and_exit_2(argv, message, capsys):
    assert main(["--log-level", "error", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_a_busy_port_is_refused_before_the_model_loads(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["router", "--prefill", "http://p:1", "--decode", "http://d:2",
                     "--port", str(port)]) == 2  # fmt: skip
    assert f"--port {port} on 127.0.0.1 is not free" in capsys.readouterr().err


def test_log_level_is_taken_on_every_subcommand_and_checked():
    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "DEBUG"]).log_level == "debug"
    assert parser.parse_args(["--log-level", "warning", "serve"]).log_level == "warning"
    assert parser.parse_args(["serve"]).log_level == "info"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["serve", "--log-level", "loud"])
    assert exit_.value.code == 2


def test_version(capsys):
    import pdserve

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"pdserve {pdserve.__version__}"


def test_the_model_may_be_positional(tiny_model_dirs):
    from pdserve.commands.common import model_path_from

    model = tiny_model_dirs("llama")
    parser = build_parser()
    assert model_path_from(parser.parse_args(["serve", model]))[0] == model
    assert model_path_from(parser.parse_args(["serve", "--model-path", model]))[0] == model


def test_workers_sharing_a_gpu_split_its_memory_unless_told_otherwise(monkeypatch):
    def utilization(argv: list[str], sharing: int) -> float:
        worker = _launch_plan(argv, monkeypatch).worker_argv("decode", sharing)
        parsed = build_parser().parse_args([*worker, "--port", "1"])
        return settings_from_args(EngineConfig, parsed, model_path="/m").gpu_memory_utilization

    default = EngineConfig("m").gpu_memory_utilization
    assert utilization([], 1) == default
    assert utilization([], 2) == pytest.approx(default / 2, abs=1e-4)
    assert utilization(["--gpu-memory-utilization", "0.4"], 2) == 0.4


def test_launch_splits_the_cores_less_one_between_every_workers_ranks(monkeypatch):
    import os

    def cpu_threads(argv: list[str], kind: str) -> int:
        worker = _launch_plan(argv, monkeypatch).worker_argv(kind)
        parsed = build_parser().parse_args([*worker, "--port", "1"])
        return settings_from_args(EngineConfig, parsed, model_path="/m").cpu_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)), raising=False)
    assert cpu_threads([], "prefill") == 4  # (9 - 1) cores // 2 engine processes
    three_workers_four_ranks = ["--num-prefill", "2", "--decode-tp-size", "2"]
    assert cpu_threads(three_workers_four_ranks, "decode") == 2
    assert cpu_threads(["--cpu-threads", "3"], "decode") == 3


def test_launch_gives_each_tensor_parallel_worker_its_own_run_of_gpus(monkeypatch):
    plan = _launch_plan(["--gpus", "0,1,2,3", "--tp-size", "2", "--num-decode", "2"], monkeypatch)
    assert [plan.worker_gpus(k) for k in range(3)] == [("0", "1"), ("2", "3"), ("0", "1")]
    one_each = _launch_plan(["--gpus", "4,5", "--num-prefill", "2"], monkeypatch)
    assert [one_each.worker_gpus(k) for k in range(3)] == [("4",), ("5",), ("4",)]
    assert _launch_plan([], monkeypatch).worker_gpus(0) == ()
    with pytest.raises(ValueError, match="a worker at TP 4 needs 4 GPUs; --gpus names 2"):
        _launch_plan(["--gpus", "0,1", "--tp-size", "4"], monkeypatch)


def test_launch_over_nccl_refuses_prefill_and_decode_on_one_gpu(monkeypatch):
    nccl = ["--transfer-backend", "nccl"]
    plan = _launch_plan([*nccl, "--gpus", "0,1,2", "--prefill-tp-size", "2"], monkeypatch)
    assert [plan.worker_gpus(k) for k in range(2)] == [("0", "1"), ("2",)]
    with pytest.raises(ValueError, match="prefill worker 0 and decode worker 0 would share GPU 0"):
        _launch_plan([*nccl, "--gpus", "0,1", "--prefill-tp-size", "2"], monkeypatch)
    with pytest.raises(ValueError, match="nccl needs --gpus"):
        _launch_plan(nccl, monkeypatch)
    four = _launch_plan(
        [*nccl, "--gpus", "0,1,2,3", "--num-prefill", "2", "--num-decode", "2"], monkeypatch
    )
    assert [four.worker_gpus(k) for k in range(4)] == [("0",), ("1",), ("2",), ("3",)]
    with pytest.raises(ValueError, match="prefill worker 0 and decode worker 1 would share GPU 0"):
        _launch_plan(
            [*nccl, "--gpus", "0,1,2", "--num-prefill", "2", "--num-decode", "2"], monkeypatch
        )


def test_ipc_refuses_tensor_parallel_workers_before_anything_starts(monkeypatch, tiny_model_dirs):
    ipc = ["--transfer-backend", "ipc"]
    plan = _launch_plan([*ipc, "--gpus", "0,1"], monkeypatch)
    assert plan.transfer.backend == "ipc"  # one GPU each, or both on one: no TP, fine
    with pytest.raises(ValueError, match="a worker at TP 2: the ipc backend moves KV between"):
        _launch_plan([*ipc, "--gpus", "0,1,2", "--decode-tp-size", "2"], monkeypatch)
    model = tiny_model_dirs("llama")
    args = build_parser().parse_args(["prefill", "--model-path", model, "--tp-size", "2", *ipc])
    with pytest.raises(ValueError, match="--tp-size 2: the ipc backend moves KV"):
        args.configure(args)


def test_launch_runs_prefill_and_decode_at_their_own_tp_sizes(monkeypatch):
    argv = ["--gpus", "0,1,2,3,4,5", "--prefill-tp-size", "4", "--decode-tp-size", "2"]
    plan = _launch_plan(argv, monkeypatch)
    assert [plan.worker_gpus(k) for k in range(2)] == [("0", "1", "2", "3"), ("4", "5")]
    for kind, size in (("prefill", "4"), ("decode", "2")):
        worker = plan.worker_argv(kind)
        assert worker[worker.index("--tp-size") + 1] == size
    plain = _launch_plan(["--tp-size", "2", "--decode-tp-size", "1"], monkeypatch)
    assert plain.tp_size("prefill") == 2 and plain.tp_size("decode") == 1
    with pytest.raises(ValueError, match="--decode-tp-size must be >= 1"):
        _launch_plan(["--decode-tp-size", "0"], monkeypatch)


def test_a_bad_flag_is_one_line_even_when_the_built_in_model_is_written_first(
    tmp_path, monkeypatch, capsys
):
    """A fresh cache: the first command without a model writes the tiny model, silently."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert main(["--log-level", "error", "serve", "--page-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --page-size must be >= 1, got 0\n"
    assert any(tmp_path.iterdir()), "the built-in model was written to the fresh cache"
