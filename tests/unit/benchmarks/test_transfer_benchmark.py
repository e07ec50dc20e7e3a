"""`benchmarks/transfer.py` runs against the transfer layer as it is: a short protocol-only
run of each backend CI can run (tcp, gloo and ipc on the CPU) completes its rooms and reports
each protocol step, so an interface change cannot leave the benchmark broken until someone
measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("backend", ["tcp", "gloo", "ipc"])
def test_the_transfer_benchmark_runs_every_room_of_a_protocol_only_run(tmp_path, backend):
    output = tmp_path / "report.json"
    command = [sys.executable, "benchmarks/transfer.py", "--backend", backend, "--protocol-only"]
    cpu_only = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # NOTE: ipc between GPUs needs two
    done = subprocess.run(
        [*command, "--output", str(output)],
        cwd=ROOT,
        env=cpu_only,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["backend"] == backend
    steps = report["median_steps_ms"]
    assert {"commit_end", "ack_seen"} <= set(steps)
    assert steps["commit_end"] > 0 and steps["ack_seen"] > 0  # NOTE: medians of each step
