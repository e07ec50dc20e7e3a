"""The launch scripts: shellcheck, and what each builds from its environment (dry runs), or
refuses with a message naming the variable."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from tests.deploy.tooling import require_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "deploy" / "scripts"
ALL_SCRIPTS = sorted([*SCRIPTS.glob("*.sh"), *pathlib.Path(__file__).parent.glob("*.sh")])


def run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPTS / script)],
        env={"PATH": os.environ["PATH"], "PDSERVE_DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def argv_of(script: str, env: dict[str, str]) -> list[str]:
    done = run(script, env)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_passes(script):
    shellcheck = require_tool("shellcheck")
    done = subprocess.run(
        [shellcheck, "--severity=style", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_scripts_are_executable():
    for script in ALL_SCRIPTS:
        assert os.access(script, os.X_OK), f"{script} is not executable (chmod +x)"


WORKER = {"ROLE": "prefill", "MODEL_PATH": "/models", "POD_IP": "10.9.8.7"}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "ROLE is required"),
        ({"ROLE": "trainer"}, "unknown ROLE 'trainer'"),
        ({"ROLE": "decode", "POD_IP": "10.0.0.1"}, "MODEL_PATH is required"),
        ({**WORKER, "PORT": "70000"}, "PORT must be a port number"),
        ({**WORKER, "BOOTSTRAP_PORT": "x"}, "BOOTSTRAP_PORT must be a port number"),
        ({"ROLE": "router", "NNODES": "2"}, "NNODES=2: only workers (serve, prefill, decode)"),
        ({**WORKER, "LWS_GROUP_SIZE": "4"}, "NNODES=4"),
        ({**WORKER, "ROLE": "serve", "NNODES": "2", "TP_SIZE": "3"}, "does not split evenly"),
        ({**WORKER, "ROLE": "serve", "NNODES": "2", "TP_SIZE": "2"}, "needs MASTER_ADDR"),
        ({**WORKER, "TP_SIZE": "0"}, "TP_SIZE must be a positive integer"),
        ({**WORKER, "NODE_RANK": "1"}, "NODE_RANK must be in [0, NNODES=1)"),
        ({**WORKER, "MASTER_PORT": "nope"}, "MASTER_PORT must be a port number"),
        ({"ROLE": "router", "HOST": "127.0.0.1"}, "the router needs prefill workers"),
        (
            {"ROLE": "router", "HOST": "127.0.0.1", "PREFILL_URLS": "http://p:1"},
            "the router needs decode workers",
        ),
        ({**WORKER, "HOST": "no-such-host.invalid"}, "does not resolve"),
    ],
)
def test_node_script_refuses_bad_settings_naming_the_variable(env, message):
    done = run("pdserve-node.sh", env)
    assert done.returncode == 2, done.stdout
    assert message in done.stderr
    assert done.stdout == ""


def test_node_script_refuses_a_missing_model_directory_when_it_really_starts(tmp_path):
    done = run(
        "pdserve-node.sh", {**WORKER, "MODEL_PATH": str(tmp_path / "no"), "PDSERVE_DRY_RUN": "0"}
    )
    assert done.returncode == 2
    assert "is not a directory on this node" in done.stderr


def test_prefill_binds_and_advertises_the_pod_ip_and_passes_the_backend():
    argv = argv_of("pdserve-node.sh", {**WORKER, "TRANSFER_BACKEND": "nccl"})
    assert argv[:4] == ["pdserve", "--log-level", "INFO", "prefill"]
    assert value(argv, "--host") == value(argv, "--bootstrap-host") == "10.9.8.7"
    assert value(argv, "--transfer-backend") == "nccl"
    assert value(argv, "--bootstrap-port") == "8998"
    assert value(argv, "--port") == "30000"


def test_decode_takes_its_bootstrap_allow_list_and_prefill_ignores_it():
    allow = "10.0.0.0/8,192.168.1.5"
    decode = argv_of("pdserve-node.sh", {**WORKER, "ROLE": "decode", "BOOTSTRAP_ALLOW": allow})
    assert value(decode, "--bootstrap-allow") == allow
    assert "--bootstrap-allow" not in argv_of("pdserve-node.sh", {**WORKER, "ROLE": "decode"})
    assert "--bootstrap-allow" not in argv_of(
        "pdserve-node.sh", {**WORKER, "BOOTSTRAP_ALLOW": allow}
    )


def test_a_wildcard_host_binds_all_but_advertises_the_node_address():
    argv = argv_of("pdserve-node.sh", {**WORKER, "HOST": "0.0.0.0"})
    assert value(argv, "--host") == "0.0.0.0"
    assert value(argv, "--bootstrap-host") == "10.9.8.7"


def test_leaderworkerset_variables_stand_in_for_the_usual_ones():
    env = {**WORKER, "LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}
    env["LWS_LEADER_ADDRESS"] = "pdserve-prefill-lws-0.pdserve-prefill-lws"
    assert "--host" in argv_of("pdserve-node.sh", env)
    refused = run("pdserve-node.sh", {**env, "LWS_WORKER_INDEX": "1"})
    assert refused.returncode == 2 and "NODE_RANK must be in [0, NNODES=1)" in refused.stderr


@pytest.mark.parametrize("role", ["serve", "prefill", "decode"])
def test_a_worker_over_two_nodes_gets_the_node_flags(role):
    env = {**WORKER, "ROLE": role, "TP_SIZE": "16", "NNODES": "2", "NODE_RANK": "1"}
    argv = argv_of("pdserve-node.sh", {**env, "MASTER_ADDR": "10.0.0.1"})
    assert value(argv, "--tp-size") == "16"
    assert (value(argv, "--nnodes"), value(argv, "--node-rank")) == ("2", "1")
    assert value(argv, "--dist-init-addr") == "10.0.0.1:29500"
    one_node = argv_of("pdserve-node.sh", {**WORKER, "ROLE": "serve"})
    assert "--tp-size" not in one_node and "--nnodes" not in one_node


def test_extra_args_and_arguments_come_last_and_secrets_never_appear():
    env = {**WORKER, "EXTRA_ARGS": "--page-size 32 --seed 7", "PDSERVE_API_KEY": "s3cret"}
    done = run("pdserve-node.sh", env)
    argv = done.stdout.splitlines()
    assert argv[-4:] == ["--page-size", "32", "--seed", "7"]
    assert "s3cret" not in done.stdout + done.stderr


def test_router_takes_services_and_urls():
    env = {
        "ROLE": "router",
        "HOST": "0.0.0.0",
        "PREFILL_SERVICE": "pdserve-prefill:30000",
        "DECODE_URLS": "http://d1:30000 http://d2:30000",
    }
    argv = argv_of("pdserve-node.sh", env)
    assert value(argv, "--port") == "8000"
    assert value(argv, "--prefill-service") == "pdserve-prefill:30000"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"] == [
        "http://d1:30000",
        "http://d2:30000",
    ]
    assert "--model-path" not in argv and "--transfer-backend" not in argv


def test_one_host_script_builds_a_launch_command():
    argv = argv_of(
        "pdserve-one-host.sh",
        {"MODEL_PATH": "/models", "GPUS": "0,1", "NUM_DECODE": "2", "TRANSFER_BACKEND": "nccl"},
    )
    assert argv[3] == "launch"
    assert value(argv, "--gpus") == "0,1" and value(argv, "--num-decode") == "2"
    assert value(argv, "--transfer-backend") == "nccl" and value(argv, "--model-path") == "/models"
    for env, message in (
        ({"GPUS": "0;1"}, "GPUS must look like"),
        ({"NUM_PREFILL": "0"}, "NUM_PREFILL"),
    ):
        done = run("pdserve-one-host.sh", env)
        assert done.returncode == 2 and message in done.stderr


def test_cluster_script_places_workers_and_points_the_router_at_them():
    env = {
        "PREFILL_HOSTS": "h1 h2",
        "DECODE_HOSTS": "h3 h1@1",
        "ROUTER_HOST": "h0",
        "MODEL_PATH": "/m o'del",
        "REMOTE_ENV_FILE": "/etc/pdserve.env",
    }
    lines = argv_of("pdserve-cluster.sh", env)
    hosts = [line.split("\t", 1)[0] for line in lines]
    assert hosts == ["h1", "h2", "h3", "h1", "h0"]
    remote = [line.split("\t", 1)[1] for line in lines]
    assert all(r.startswith(". '/etc/pdserve.env' && exec env ROLE=") for r in remote)
    assert "PORT=30001" in remote[3] and "CUDA_VISIBLE_DEVICES='1'" in remote[3]
    assert "BOOTSTRAP_PORT=8998" in remote[0] and "MODEL_PATH='/m o'\\''del'" in remote[0]
    assert "PREFILL_URLS='http://h1:30000 http://h2:30000'" in remote[4]
    assert "DECODE_URLS='http://h3:30000 http://h1:30001'" in remote[4]
    # The remote shell must read the quoted model path back exactly.
    echoed = subprocess.run(
        ["sh", "-c", "printf %s " + remote[0].split("MODEL_PATH=", 1)[1].split(" HOST=")[0]],
        capture_output=True,
        text=True,
        check=True,
    )
    assert echoed.stdout == "/m o'del"


def test_cluster_script_names_missing_variables():
    done = run("pdserve-cluster.sh", {"PREFILL_HOSTS": "h1"})
    assert done.returncode == 2 and "DECODE_HOSTS is required" in done.stderr
