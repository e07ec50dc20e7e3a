"""`pdserve bench` as a command: flags to settings, one-line errors (exit 2), the whole run
against an in-process fake server writing its JSON and PNGs, and no torch on the way."""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys

import httpx
import pytest

from pdserve.bench import command
from pdserve.bench.client import BenchClient, NoModelList, served_models
from pdserve.server.local_process import free_port

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(["--base-url", "http://fake", *flags])


def test_flags_become_loads():
    assert [(x.request_rate, x.max_concurrency) for x in command._loads(parse())] == [
        (math.inf, None)
    ]
    assert command._loads(parse("--concurrency", "4"))[0].max_concurrency == 4
    sweep = command._loads(parse("--rate-sweep", "1,2.5,inf", "--max-concurrency", "8"))
    assert [(x.request_rate, x.max_concurrency) for x in sweep] == [
        (1.0, 8),
        (2.5, 8),
        (math.inf, 8),
    ]


def test_workload_defaults_follow_the_workload():
    plan = command.plan_from_args(parse())
    assert (plan.client.endpoint, str(plan.workload.input_len)) == ("completions", "64:512")
    plan = command.plan_from_args(parse("--workload", "multi-turn"))
    assert (plan.client.endpoint, str(plan.workload.output_len)) == ("chat", "16:64")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "4", "--request-rate", "2"], "--concurrency N is rate inf"),
        (["--rate-sweep", "1,x"], "--rate-sweep"),
        (["--input-len", "9:3"], "length range"),
        (["--workload", "multi-turn", "--endpoint", "completions"], "--endpoint chat"),
        (["--request-rate", "0"], "request rate"),
        (["--slo-tpot-ms", "-1"], "SLO tpot"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(flags, message, capsys):
    assert command.run(parse(*flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_an_unreachable_url_is_one_line_naming_it(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    args = argparse.Namespace(**{**vars(parse()), "base_url": url})
    assert command.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach {url}/v1/models") and err.count("\n") == 1


def models_answer(status: int, body) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(status, json=body))


def test_the_model_list_is_read_and_its_absence_explained():
    listed = {"object": "list", "data": [{"id": "a", "object": "model"}, {"id": "b"}]}
    assert served_models("http://fake/v1", None, transport=models_answer(200, listed)) == ["a", "b"]
    refusal = {"error": {"message": "bad key", "type": "authentication_error"}}
    with pytest.raises(NoModelList, match=r"http://fake/v1/models answered HTTP 401: bad key"):
        served_models("http://fake", "sk-wrong", transport=models_answer(401, refusal))
    with pytest.raises(NoModelList, match="no model list"):
        served_models("http://fake", None, transport=models_answer(200, ["a"]))


@pytest.mark.parametrize(
    ("answer", "given", "outcome"),
    [
        ((200, {"data": [{"id": "first"}, {"id": "second"}]}), None, "first"),
        ((200, {"data": [{"id": "first"}]}), "mine", "mine"),
        ((404, {"detail": "Not Found"}), "mine", "mine"),
        ((404, {"detail": "Not Found"}), None, "answered HTTP 404: Not Found; pass --model"),
        ((200, {"data": []}), None, "lists no model; pass --model"),
    ],
)
def test_the_model_is_the_one_given_or_the_first_listed(answer, given, outcome, monkeypatch):
    transport = models_answer(*answer)
    monkeypatch.setattr(
        command, "served_models", functools.partial(served_models, transport=transport)
    )
    settings = command.plan_from_args(parse()).client
    if outcome in ("first", "mine"):
        assert command._resolve_model(settings, given) == outcome
    else:
        with pytest.raises(NoModelList, match=outcome):
            command._resolve_model(settings, given)


def fake_server(fail_every: int = 0):
    """Completions that stream three chunks and usage; every `fail_every`-th is a 500."""
    calls = [0]

    def handle(request: httpx.Request) -> httpx.Response:
        calls[0] += 1
        if fail_every and calls[0] % fail_every == 0:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        body = json.loads(request.content)
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in "abc"]
        chunks.append(
            {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 3}}
        )
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text)

    return httpx.MockTransport(handle)


def test_a_sweep_writes_its_json_and_plots(tmp_path, monkeypatch, capsys):
    transport = fake_server(fail_every=5)
    monkeypatch.setattr(command, "BenchClient", functools.partial(BenchClient, transport=transport))
    monkeypatch.setattr(command, "served_models", lambda url, key: ["tiny"])  # /v1/models
    args = parse(
        "--num-prompts",
        "8",
        "--input-len",
        "4:6",
        "--rate-sweep",
        "400,inf",
        "--slo-ttft-ms",
        "1000",
        "--api-key",
        "sk-secret",
        "--result-json",
        str(tmp_path / "out" / "result.json"),
        "--plot-dir",
        str(tmp_path / "plots"),
    )
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("Successful requests") == 2 and "rate 400/s" in out and "rate inf/s" in out
    report = json.loads((tmp_path / "out" / "result.json").read_text())
    assert report["config"]["model"] == "tiny" and "api_key" not in report["config"]
    assert [r["success"] for r in report["warmup_requests"]] == [True]
    assert [run["request_rate"] for run in report["runs"]] == [400.0, "inf"]
    for run in report["runs"]:
        summary, requests = run["summary"], run["requests"]
        assert len(requests) == 8
        assert summary["completed"] == sum(r["success"] for r in requests)
        assert summary["completed"] + summary["failed"] == 8 and summary["failed"] >= 1
        assert summary["output_tokens"] == 3 * summary["completed"]
        assert summary["errors"][0]["error"] == "HTTP 500: boom"
    for name in ("latency_cdf.png", "sweep.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG_MAGIC


def test_the_bench_package_imports_no_torch():
    code = (
        "import sys, pdserve.bench.command, pdserve.bench.plots, pdserve.bench.__main__\n"
        "assert 'torch' not in sys.modules and 'pdserve.engine' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
