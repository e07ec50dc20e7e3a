"""`pdserve launch`: the whole deployment on this machine. 200 requests of mixed lengths all
succeed and leave every page free; SIGTERM stops every process it started, and so does the
launcher's death (no orphans)."""

from __future__ import annotations

import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pdserve.server.local_process import free_port
from tests.e2e.launched import Launch
from tests.e2e.sse import stream_post
from tests.waiting import wait_until


def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def _one_request(base_url: str, i: int) -> bool:
    rng = random.Random(i)
    prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, 200))]
    max_tokens = rng.randint(1, 48)
    kind, stream = i % 3, i % 2 == 0
    if kind == 0:
        path = "/generate"
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens}}
    elif kind == 1:
        path = "/v1/completions"
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
    else:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": max_tokens}
    if stream:
        status, events = stream_post(base_url + path, {**body, "stream": True}, timeout=120)
        return status == 200 and bool(events) and "error" not in events[-1]
    response = httpx.post(base_url + path, json=body, timeout=120)
    return response.status_code == 200 and "error" not in response.json()


@pytest.fixture
def launched(tiny_model_dirs):
    started = []

    def start(*extra):
        launch = Launch(tiny_model_dirs("llama"), *extra)
        started.append(launch)
        return launch

    yield start
    for launch in started:
        launch.close()


def test_200_mixed_requests_through_launch_then_sigterm_stops_everything(launched):
    launch = launched("--num-prefill", "2", "--num-decode", "1", "--max-model-len", "512")
    workers = launch.worker_urls()
    assert len(workers) == 3
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: _one_request(launch.url, i), range(200)))
    assert results.count(True) == 200
    launch.wait_workers_idle(workers)
    os.kill(launch.process.pid, signal.SIGTERM)
    assert launch.process.wait(timeout=60) == 0
    for url in [launch.url, *workers]:
        wait_until(lambda url=url: not _listening(url), f"{url} to stop", deadline_s=10)


def test_workers_exit_when_the_launcher_is_killed(launched):
    launch = launched()
    workers = launch.worker_urls()
    assert len(workers) == 2
    os.kill(launch.process.pid, signal.SIGKILL)  # the launcher only: no chance to clean up
    for url in [launch.url, *workers]:
        wait_until(lambda url=url: not _listening(url), f"{url} to exit by itself", 30)


def _launch_once(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 240, cwd=None, device="cpu"
):
    # NOTE: -P: started as the `pdserve` script starts it, the current directory off sys.path.
    command = [sys.executable, "-P", "-m", "pdserve.cli", "launch", "--device", device]
    return subprocess.run(
        [*command, "--port", str(free_port()), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
        cwd=cwd,
    )


def _shadowing_folder(tmp_path: pathlib.Path) -> pathlib.Path:
    """A folder holding a `pdserve/` package that is not pdserve (a clone's parent holds the
    clone's `pdserve/`): a child started with the current directory on sys.path imports it."""
    folder = tmp_path / "clone-parent"
    (folder / "pdserve").mkdir(parents=True)
    (folder / "pdserve" / "__init__.py").write_text(
        'raise ImportError("the pdserve/ of the current directory was imported")\n'
    )
    return folder


def test_a_worker_that_cannot_start_is_one_error_line_naming_it(tiny_model_dirs, tmp_path):
    model = tmp_path / "no-weights"
    model.mkdir()
    for config in pathlib.Path(tiny_model_dirs("llama")).glob("*.json"):
        shutil.copy(config, model)
    done = _launch_once(str(model), "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 1, done.stderr
    mine = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(mine) == 1, done.stderr
    assert re.match(r"error: prefill 0 \(http://127\.0\.0\.1:\d+\) exited with code 1", mine[0])
    assert "no *.safetensors files" in mine[0]
    assert f"full log: {tmp_path / 'logs' / 'prefill-0.log'}" in mine[0]
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "flags, message",
    [
        (("--device", "cuda"), "error: --device cuda: CUDA is not available on this machine"),
        (("--gpus", "0,1"), "error: --gpus 0,1: CUDA is not available on this machine"),
        (("--gpus", "abc"), "error: --gpus 'abc': each GPU id is an index (0,1) or a GPU-/MIG-"),
    ],
)
def test_gpu_settings_this_machine_cannot_honour_are_one_error_line(
    tiny_model_dirs, flags, message
):
    done = _launch_once(tiny_model_dirs("llama"), *flags, device="auto", timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
    assert "starting" not in done.stdout  # refused before any worker started


def test_launch_hands_the_api_key_and_model_name_to_every_process(tiny_model_dirs, tmp_path):
    """...started from a folder whose `pdserve/` would shadow the package in every child."""
    done = _launch_once(
        tiny_model_dirs("llama"),
        "--check",
        "--served-model-name",
        "my-model",
        "--log-dir",
        str(tmp_path),
        env={"PDSERVE_API_KEY": "sesame"},
        cwd=_shadowing_folder(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"model":"my-model"' in done.stdout  # the check went through with the key
    assert 'Authorization: Bearer $PDSERVE_API_KEY"' in done.stdout  # the curl line too
    assert "sesame" not in done.stdout + done.stderr
    router_log = (tmp_path / "router.log").read_text()
    assert re.search(r"request \S+ POST /v1/completions 200 prefill=http", router_log)
    for name in ("prefill-0", "decode-0"):
        assert "worker ready on http://" in (tmp_path / f"{name}.log").read_text()
