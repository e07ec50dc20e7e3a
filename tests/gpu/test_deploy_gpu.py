"""The launch scripts on two GPUs: `pdserve-cluster.sh` puts a prefill worker on GPU 0 and a
decode worker on GPU 1 (HOST@GPU) with the nccl backend, a request goes through its router and
the KV crosses over NCCL; `pdserve-one-host.sh` does the same through `pdserve launch`.
Needs two GPUs (nvidia-h200-x2)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess

import httpx
import pytest
import torch

from pdserve.server.local_process import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "deploy" / "scripts"
LOCAL_SSH = ROOT / "tests" / "deploy" / "local_ssh.sh"
START_DEADLINE_S = 300


@pytest.fixture
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")


def _wait_healthy(url: str, process: subprocess.Popen, log: pathlib.Path) -> None:
    def healthy() -> bool:
        assert process.poll() is None, log.read_text()[-4000:]
        return httpx.get(url + "/health", timeout=2).status_code == 200

    wait_until(
        healthy,
        f"{url} to be healthy",
        START_DEADLINE_S,
        poll_s=0.5,
        describe=lambda: log.read_text()[-4000:],
        retry_on=(httpx.HTTPError,),
    )


def test_cluster_script_serves_across_two_gpus_over_nccl(two_gpus, tiny_model_dirs, tmp_path):
    model = tiny_model_dirs("llama")
    worker_port, router_port = free_port(), free_port()
    env = {
        **os.environ,
        "PREFILL_HOSTS": "127.0.0.1@0",
        "DECODE_HOSTS": "127.0.0.1@1",
        "ROUTER_HOST": "127.0.0.1",
        "ROUTER_BIND": "127.0.0.1",
        "ROUTER_PORT": str(router_port),
        "WORKER_PORT": str(worker_port),
        "BOOTSTRAP_PORT": str(free_port()),
        "MODEL_PATH": model,
        "TRANSFER_BACKEND": "nccl",
        "EXTRA_ARGS": "--device cuda --kv-cache-memory 1073741824",
        "SSH": str(LOCAL_SSH),
    }
    log = tmp_path / "cluster.log"
    with log.open("w") as out:
        script = subprocess.Popen(
            [str(SCRIPTS / "pdserve-cluster.sh")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    router = f"http://127.0.0.1:{router_port}"
    try:
        _wait_healthy(router, script, log)
        body = {"model": model, "prompt": "hello world", "max_tokens": 16, "temperature": 0}
        reply = httpx.post(router + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 16
        decode = f"http://127.0.0.1:{worker_port + 1}"  # the second worker on this host
        info = httpx.get(decode + "/server_info", timeout=10).json()
        assert info["disaggregation_mode"] == "decode"
        assert info["disaggregation_transfer_backend"] == "nccl"
        assert info["device"].startswith("cuda")
        assert info["internal_states"][0]["bytes_received"] > 0
    finally:
        script.send_signal(signal.SIGTERM)
        status = script.wait(timeout=120)
    assert status == 128 + signal.SIGTERM, log.read_text()[-4000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(router + "/health", timeout=2)


def test_one_host_script_checks_a_request_over_nccl(two_gpus, tiny_model_dirs):
    env = {
        **os.environ,
        "MODEL_PATH": tiny_model_dirs("llama"),
        "GPUS": "0,1",
        "TRANSFER_BACKEND": "nccl",
        "PORT": "0",
        "EXTRA_ARGS": "--check --kv-cache-memory 1073741824",
    }
    done = subprocess.run(
        [str(SCRIPTS / "pdserve-one-host.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_DEADLINE_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
