"""`pdserve bench` against a real `pdserve launch` cluster (tiny model, CPU): its counts agree
with the router's and the workers' own metrics.

What agrees exactly, per run (warm-up included, as the server sees it): the router's
requests_total{status="200"} for the endpoint rises by completed + warm-up requests; the
prefill worker's generation_tokens_total by one per request (it samples the first token);
the decode worker's by the sum of usage's completion_tokens (it emits every token, the
first one included). With --logprobs 0 each token is its own chunk: ITL has one gap fewer
than the request's tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from tests.e2e.test_launch import Launch
from tests.waiting import wait_until

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    launch = Launch(tiny_model_dirs("llama"), "--max-model-len", "512")
    yield launch
    launch.close()


def counters(launch: Launch) -> dict:
    """The router's requests by (endpoint, status) and generated tokens by worker role."""
    text = httpx.get(launch.url + "/metrics", timeout=10).text
    found = {
        (endpoint, status): float(value)
        for endpoint, status, value in re.findall(
            r'pdserve_router:requests_total\{endpoint="([^"]+)",status="(\d+)"\} (\S+)', text
        )
    }
    for role, url in re.findall(r'worker_healthy\{role="(\w+)",url="([^"]+)"', text):
        worker = httpx.get(url + "/metrics", timeout=10).text
        tokens = re.search(r"^pdserve:generation_tokens_total\{[^}]*\} (\S+)", worker, re.M)
        found[role] = float(tokens.group(1))
    return found


def bench(launch: Launch, tmp_path, *flags: str) -> dict:
    result = tmp_path / "result.json"
    command = [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", launch.url]
    command += [*flags, "--result-json", str(result), "--disable-tqdm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Successful requests" in done.stdout
    return json.loads(result.read_text())


def sent(report: dict) -> list[dict]:
    """Every request the server answered: the warm-up ones and each run's."""
    return report["warmup_requests"] + [r for run in report["runs"] for r in run["requests"]]


def assert_counts_agree(launch: Launch, before: dict, report: dict, endpoint: str) -> None:
    requests = sent(report)
    assert all(r["success"] for r in requests)
    key = (endpoint, "200")

    def router_counted() -> float:
        return counters(launch).get(key, 0.0) - before.get(key, 0.0)

    # NOTE: the router counts a stream once it has relayed its end, maybe after bench read it.
    wait_until(lambda: router_counted() == len(requests), f"{len(requests)} {endpoint} 200s")
    after = counters(launch)
    assert after["prefill"] - before["prefill"] == len(requests)
    assert after["decode"] - before["decode"] == sum(r["output_tokens"] for r in requests)


def test_a_random_run_agrees_with_the_servers_metrics(cluster, tmp_path):
    before = counters(cluster)
    flags = ["--num-prompts", "12", "--concurrency", "4", "--input-len", "8:48"]
    flags += ["--output-len", "4:24", "--logprobs", "0", "--slo-ttft-ms", "60000"]
    report = bench(cluster, tmp_path, *flags, "--plot-dir", str(tmp_path / "plots"))
    (run,) = report["runs"]
    summary = run["summary"]
    assert (summary["completed"], summary["failed"], len(report["warmup_requests"])) == (12, 0, 1)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # a loose SLO
    assert summary["output_tokens"] == sum(r["max_tokens"] for r in run["requests"])  # ignore_eos
    for request in run["requests"]:
        assert request["output_tokens"] == request["max_tokens"]
        # NOTE: gaps between chunks; a stream that fell behind gets several tokens in one.
        assert len(request["itl_s"]) <= request["output_tokens"] - 1
        assert 0 < request["ttft_s"] <= request["e2e_s"]
        assert 0 <= sum(request["itl_s"]) <= request["e2e_s"] - request["ttft_s"]
    assert_counts_agree(cluster, before, report, "/v1/completions")
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes()[:8] == PNG_MAGIC


def test_a_multi_turn_run_agrees_with_the_servers_metrics(cluster, tmp_path):
    before = counters(cluster)
    flags = ["--workload", "multi-turn", "--num-prompts", "3", "--num-turns", "3"]
    flags += ["--concurrency", "3", "--input-len", "4:12", "--output-len", "4:8"]
    flags += ["--system-prompt-len", "8", "--shared-prefix-len", "8"]
    report = bench(cluster, tmp_path, *flags)
    (run,) = report["runs"]
    assert (run["summary"]["completed"], run["summary"]["failed"]) == (9, 0)
    by_conversation = {}
    for request in run["requests"]:
        by_conversation.setdefault(request["conversation"], []).append(request)
    for turns in by_conversation.values():
        # each turn's prompt holds the previous one and its answer: it only grows
        prompts = [t["prompt_tokens"] for t in turns]
        assert prompts == sorted(prompts) and len(set(prompts)) == 3
    assert_counts_agree(cluster, before, report, "/v1/chat/completions")
