"""`pdserve bench` takes `vllm bench serve`'s common flags: a vLLM command line runs against a
scripted server (an in-process fake), writes vLLM's result file, reads a real ShareGPT file;
a flag that clashes with bench's own is one line; an unknown flag shows bench's usage; plots
name the server, model and workload, the ITL CDF has a log axis, a sweep plots TTFT."""

from __future__ import annotations

import functools
import json
import random

import httpx
import pytest

from pdserve.bench import command, plots
from pdserve.bench.client import BenchClient
from pdserve.bench.metrics import SLO
from pdserve.bench.workloads import LengthRange, WorkloadSpec, build_workload, load_sharegpt
from pdserve.cli import build_parser, main

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "one two three four five"},
                                  {"from": "gpt", "value": "an answer of six words here"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "too short"},
                                  {"from": "gpt", "value": "left out"}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "the model speaks first here"},
                                  {"from": "human", "value": "so this one is left out"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "asked but never answered"}]},
    {"id": "e", "conversations": [{"from": "human", "value": "w " * 40},
                                  {"from": "gpt", "value": "x " * 900}]},
]  # fmt: skip


def bench_args(*flags: str):
    return build_parser().parse_args(["bench", *flags])


def test_a_vllm_command_line_becomes_bench_settings():
    plan = command.plan_from_args(
        bench_args(
            "--dataset-name", "random",
            "--random-input-len", "100",
            "--random-output-len", "20",
            "--random-range-ratio", "0.5",
            "--host", "10.0.0.7",
            "--port", "8001",
            "--goodput", "ttft:500", "tpot:50",
            "--num-prompts", "3",
        )
    )  # fmt: skip
    assert plan.workload.name == "random" and plan.num_prompts == 3
    assert (plan.workload.input_len, plan.workload.output_len) == (
        LengthRange(50, 150),
        LengthRange(10, 30),
    )
    assert plan.client.base_url == "http://10.0.0.7:8001"
    assert plan.slo == SLO(ttft_ms=500.0, tpot_ms=50.0)
    exact = command.plan_from_args(bench_args("--random-input-len", "64", "--port", "9"))
    assert exact.workload.input_len == LengthRange(64, 64)
    assert exact.client.base_url == "http://127.0.0.1:9"
    assert command.plan_from_args(bench_args()).client.base_url == "http://127.0.0.1:8000"
    assert command.plan_from_args(bench_args("--goodput", "e2el:900")).slo == SLO(e2e_ms=900.0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--base-url", "http://x", "--port", "1"], "--base-url or --host/--port, not both"),
        (["--input-len", "5", "--random-input-len", "5"], "--input-len or --random-input-len"),
        (["--random-range-ratio", "0.2"], "--random-range-ratio needs --random-input-len"),
        (["--random-input-len", "8", "--random-range-ratio", "1"], "must be in [0, 1)"),
        (["--dataset-name", "sharegpt", "--random-input-len", "8"], "--dataset-name random"),
        (["--dataset-path", "x.json"], "--dataset-path is read by --dataset-name sharegpt"),
        (["--goodput", "ttft"], "--goodput 'ttft': expected KEY:MS with KEY one of ttft, tpot"),
        (["--goodput", "ttft:fast"], "'fast' is not a number of ms"),
        (["--goodput", "ttft:5", "--slo-tpot-ms", "5"], "--goodput or --slo-*-ms"),
        (["--save-result", "--result-json", "r.json"], "--result-json or --save-result"),
        (["--result-dir", "out"], "go with --save-result"),
        (["--dataset-name", "sharegpt", "--dataset-path", "/nonexistent.json"], "cannot read"),
    ],
)
def test_clashing_or_pointless_vllm_flags_are_one_line_and_exit_2(flags, message, capsys):
    assert command.run(bench_args(*flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_an_unknown_flag_shows_benchs_own_usage(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--dataset-name", "random", "--percentile-metricz", "ttft"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pdserve bench ") and "--random-input-len" in err
    assert err.endswith("pdserve bench: error: unrecognized arguments: --percentile-metricz ttft\n")


def test_a_sharegpt_file_gives_its_first_turns_as_vllm_filters_them(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    usable = load_sharegpt(path, max_input=1024, max_output=512)
    assert usable == (("one two three four five", 6), (("w " * 40), 512))
    assert load_sharegpt(path, max_input=39, max_output=512) == usable[:1]
    spec = WorkloadSpec("sharegpt", True, LengthRange(1, 1), LengthRange(1, 1), dataset=usable)
    conversations = build_workload(spec, 5, seed=0)
    prompts = [c.turns[0].prompt for c in conversations]
    assert set(prompts) == {p for p, _ in usable} and len(prompts) == 5  # drawn again
    assert build_workload(spec, 5, seed=0) == conversations
    path.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="not a ShareGPT file"):
        load_sharegpt(path, 1024, 512)
    path.write_text(json.dumps(SHAREGPT[1:4]))
    with pytest.raises(ValueError, match="no conversation with a human first turn"):
        load_sharegpt(path, 1024, 512)


def scripted_chat_server(seen: list[dict]) -> httpx.MockTransport:
    """Chat completions that stream three one-token chunks and usage; records each body."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        chunks = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in "abc"]
        words = len(body["messages"][-1]["content"].split())
        chunks.append({"choices": [], "usage": {"prompt_tokens": words, "completion_tokens": 3}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text)

    return httpx.MockTransport(handle)


def test_a_vllm_sharegpt_run_saves_vllms_result_file_and_titled_plots(
    tmp_path, monkeypatch, capsys
):
    dataset = tmp_path / "ShareGPT_V3.json"
    dataset.write_text(json.dumps(SHAREGPT))
    seen: list[dict] = []
    transport = scripted_chat_server(seen)
    monkeypatch.setattr(command, "BenchClient", functools.partial(BenchClient, transport=transport))
    monkeypatch.setattr(command, "served_models", lambda url, key: ["org/tiny-chat"])
    args = bench_args(
        "--dataset-name", "sharegpt",
        "--dataset-path", str(dataset),
        "--num-prompts", "4",
        "--port", "8123",
        "--goodput", "ttft:10000",
        "--save-result",
        "--result-dir", str(tmp_path / "results"),
        "--plot-dir", str(tmp_path / "plots"),
        "--disable-tqdm",
    )  # fmt: skip
    assert command.run(args) == 0
    assert {body["messages"][-1]["content"] for body in seen} <= {"one two three four five",
                                                                  "w " * 40}  # fmt: skip
    assert {body["max_tokens"] for body in seen} <= {6, 512} and len(seen) == 5  # + warm-up
    (saved,) = (tmp_path / "results").iterdir()
    assert saved.name.startswith("pdserve-bench-infqps-tiny-chat-")
    report = json.loads(saved.read_text())
    assert (report["backend"], report["model_id"], report["num_prompts"]) == (
        "openai-chat",
        "org/tiny-chat",
        4,
    )
    assert report["completed"] == 4 and report["total_output_tokens"] == 12
    assert report["request_goodput"] == report["request_throughput"] > 0
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms"):
        assert report[key] is not None and report[key] >= 0, key
    assert report["runs"][0]["vllm_metrics"]["completed"] == 4
    assert f"results: {saved}" in capsys.readouterr().out
    assert (tmp_path / "plots" / "latency_cdf.png").is_file()


def fake_result(rate: float, seed: int):
    """A run's result with made-up latencies, as the runner returns it."""
    from pdserve.bench.client import RequestRecord
    from pdserve.bench.runner import Load, RunResult

    rng = random.Random(seed)
    records = []
    for i in range(6):
        record = RequestRecord(conversation=i, turn=0)
        record.success, record.output_tokens = True, 4
        record.ttft_s, record.e2e_s = rng.uniform(0.01, 0.2), rng.uniform(0.3, 0.9)
        record.itl_s = [rng.uniform(1e-4, 0.5) for _ in range(3)]
        records.append(record)
    return RunResult(Load(rate, None), records, 1.0)


def test_plots_name_server_model_and_workload_with_a_log_itl_axis_and_ttft_by_rate():
    from pdserve.bench.metrics import summarize

    title = plots.PlotTitle("http://10.0.0.7:8000", "org/model", "random: input 64:512 tokens")
    results = [fake_result(rate, seed) for seed, rate in enumerate((1.0, 4.0, float("inf")))]
    summaries = [summarize(r.records, r.duration_s, SLO()) for r in results]
    cdfs = plots.latency_cdfs(results, title)
    assert cdfs.get_suptitle() == "org/model on http://10.0.0.7:8000\nrandom: input 64:512 tokens"
    scales = {axes.get_title(): axes.get_xscale() for axes in cdfs.axes}
    assert scales["Inter-token latency, chunk gaps (ms)"] == "log"
    assert scales["Time to first token (ms)"] == "linear"
    sweep = plots.sweep(results, summaries, title)
    assert sweep.get_suptitle() == cdfs.get_suptitle()
    ttft = next(axes for axes in sweep.axes if axes.get_title() == "Time to first token")
    medians = [s["ttft_ms"]["median"] for s in summaries]
    assert list(ttft.lines[0].get_ydata()) == pytest.approx(medians)
    assert [t.get_text() for t in ttft.get_xticklabels()] == ["1", "4", "inf"]
