"""Disaggregated serving through the router answers what colocated `pdserve serve` answers,
field for field: token ids, text, every token's logprob and top logprobs, finish and stop
reasons, usage, speculative counters. For /v1/completions, /v1/chat/completions and
/generate, streamed and not; greedy and seeded sampling; one token (the prefill worker's
alone) and several; a stop string; plain and with EAGLE-3 speculative decoding (which takes
sampling and logprobs as plain decoding does). fp32 on CPU, tcp transfer.

Answers are compared whole after `normalized` drops what differs between any two answers
(ids, creation times, latencies), so that a field added later is compared too. A stream is
compared per choice: its concatenated text, its list of logprob entries, its finish chunk, the
other chunks' fields (without the text and logprobs they carried: chunking is not part of the
answer) and the usage chunk (tests/e2e/answers.py). Floats agree to 1e-5: the prefill worker
computes the first token in another process, and batches of other shapes round differently.

Cases are data (`CASES`) sent to shared servers: a new kind of request is a new row. Rows with
n > 1 and prompt lists go through the router's fan-out (a room per prompt and choice, merged
back): choices are compared by index, a /generate list answer item by item.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.server.local_process import LocalServer
from pdserve.speculative.checkpoints import make_tiny_eagle_draft
from tests.e2e.answers import assert_same, generate_stream, normalized, openai_stream, values_of
from tests.e2e.conftest import START_DEADLINE_S, Server
from tests.e2e.pd_cluster import begin_cluster
from tests.e2e.sse import stream_post
from tests.waiting import wait_until

ARGS = ("--dtype", "float32", "--max-model-len", "256", "--chunked-prefill-size", "16")
COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"
ENDPOINT_NAMES = {COMPLETIONS: "completions", CHAT: "chat", GENERATE: "generate"}
# Over one chunked-prefill chunk (16 tokens) of the tiny tokenizer.
PROMPT = (
    "Prefill reads the whole prompt at once and decode writes one token at a time, so the "
    "two run on separate workers."
)
TOP_LOGPROBS = 3
SAMPLINGS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 1234},
}


@dataclass(frozen=True)
class Case:
    path: str
    body: dict
    deployment: str = "plain"  # or "speculative": both sides run EAGLE-3
    # Add a stop string taken from the reference's own answer to this body.
    stop_word: bool = False
    label: str = ""  # what else sets this row apart, for its test id

    @property
    def sampling(self) -> dict:
        return self.body.get("sampling_params", self.body)

    @property
    def max_tokens(self) -> int:
        return self.sampling.get("max_new_tokens", self.body.get("max_tokens"))

    @property
    def name(self) -> str:
        b = self.body
        kind = "seeded" if self.sampling.get("seed") is not None else "greedy"
        parts = [self.deployment, ENDPOINT_NAMES[self.path], kind, f"max{self.max_tokens}"]
        if b.get("stream"):
            parts.append("stream")
        if self.stop_word:
            parts.append("stop")
        return "-".join([*parts, self.label] if self.label else parts)


def request_body(path: str, sampling: dict, max_tokens: int, stream: bool) -> dict:
    """One prompt, one choice, logprobs with the top TOP_LOGPROBS, in each API's words."""
    if path == GENERATE:
        return {
            "text": PROMPT,
            "sampling_params": {**sampling, "max_new_tokens": max_tokens},
            "return_logprob": True,
            "top_logprobs_num": TOP_LOGPROBS,
            "stream": stream,
        }
    body = {**sampling, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if path == COMPLETIONS:
        return {**body, "prompt": PROMPT, "logprobs": TOP_LOGPROBS}
    messages = [{"role": "user", "content": PROMPT}]
    return {**body, "messages": messages, "logprobs": True, "top_logprobs": TOP_LOGPROBS}


CASES = [
    Case(path, request_body(path, sampling, max_tokens, stream), deployment)
    for deployment, path, stream, sampling, max_tokens in itertools.product(
        ("plain", "speculative"),
        (COMPLETIONS, CHAT, GENERATE),
        (False, True),
        SAMPLINGS.values(),
        (6, 1),  # several tokens; the prefill worker's token alone
    )
] + [
    Case(path, request_body(path, SAMPLINGS["greedy"], 8, stream), deployment, stop_word=True)
    for deployment, path, stream in itertools.product(
        ("plain", "speculative"), (COMPLETIONS, CHAT, GENERATE), (False, True)
    )
]

# Several choices and several prompts: one room each through the router, merged back.
PROMPTS = [PROMPT, "A second prompt, shorter.", "And a third"]
FANOUTS = [
    (COMPLETIONS, {"n": 3}, "n3"),
    (CHAT, {"n": 3}, "n3"),
    (COMPLETIONS, {"prompt": PROMPTS}, "list3"),
    (COMPLETIONS, {"prompt": PROMPTS[:2], "n": 2}, "list2xn2"),
    (GENERATE, {"text": PROMPTS}, "list3"),
]
CASES += [
    Case(path, {**request_body(path, sampling, 5, stream), **extra}, deployment, label=label)
    for path, extra, label in FANOUTS
    for stream in (False, True)
    for sampling, deployment in (
        (SAMPLINGS["greedy"], "plain"),
        (SAMPLINGS["seeded"], "plain"),
        (SAMPLINGS["seeded"], "speculative"),
    )
]


@pytest.fixture(scope="module")
def deployments(tiny_model_dirs, tmp_path_factory):
    """name -> (colocated server, cluster of 1 prefill + 1 decode worker behind a router),
    both with the same flags; all started at once."""
    model = tiny_model_dirs("llama")
    draft = make_tiny_eagle_draft(
        tmp_path_factory.mktemp("fidelity-draft") / "eagle3", model, aux_layer_ids=[0, 1], seed=4
    )
    eagle3 = (
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
    )  # fmt: skip
    flags = {"plain": ARGS, "speculative": (*ARGS, *eagle3)}
    colocated = {
        name: LocalServer(["serve", "--model-path", model, "--device", "cpu", *args])
        for name, args in flags.items()
    }
    pending = {
        name: begin_cluster(model, backend="tcp", worker_args=args) for name, args in flags.items()
    }
    clusters = {}
    try:
        references = {
            name: Server(local.wait_healthy(START_DEADLINE_S), model)
            for name, local in colocated.items()
        }
        for name, cluster in pending.items():
            clusters[name] = cluster.ready()
        yield {name: (references[name], clusters[name]) for name in flags}
    finally:
        for name, cluster in pending.items():
            if name in clusters:
                clusters[name].stop()
            else:
                for local in [*cluster.prefill, *cluster.decode]:
                    local.stop()
        for local in colocated.values():
            local.stop()


# ---- what is compared -------------------------------------------------------------------


def answer(base_url: str, case: Case, body: dict):
    """The normalized answer to `body` (a stream summarized as above)."""
    if not body.get("stream"):
        response = httpx.post(base_url + case.path, json=body, timeout=120)
        assert response.status_code == 200, response.text
        return normalized(response.json())
    status, events = stream_post(base_url + case.path, body, timeout=120)
    assert status == 200, events
    assert events and not any("error" in e for e in events), events[-1:]
    return generate_stream(events) if case.path == GENERATE else openai_stream(events)


# ---- the cases ----------------------------------------------------------------------------


def with_stop_word(reference: Server, case: Case) -> tuple[dict, str]:
    """The case's body with a stop string: the last word of 3+ letters in the reference's
    answer without one (so that the stop is met after some tokens, on both sides)."""
    probe = {k: v for k, v in case.body.items() if k not in ("stream", "stream_options")}
    response = reference.post(case.path, probe)
    assert response.status_code == 200, response.text
    data = response.json()
    if case.path == GENERATE:
        text = data["text"]
    else:
        choice = data["choices"][0]
        text = choice["text"] if case.path == COMPLETIONS else choice["message"]["content"]
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert words, f"no word in {text!r} to stop at: change the prompt"
    if case.path == GENERATE:
        sampling = {**case.body["sampling_params"], "stop": [words[-1]]}
        return {**case.body, "sampling_params": sampling}, words[-1]
    return {**case.body, "stop": [words[-1]]}, words[-1]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_disaggregated_answer_equals_colocated(deployments, case):
    reference, cluster = deployments[case.deployment]
    body, stop = case.body, None
    if case.stop_word:
        body, stop = with_stop_word(reference, case)
    want = answer(reference.url, case, body)
    got = answer(cluster.router.url, case, body)
    assert_same(got, want)
    # What the comparison covers is there: top logprobs, the stop met, speculation.
    assert any(values_of(want, "top_logprobs") + values_of(want, "output_top_logprobs")), want
    if stop is not None:
        assert stop in values_of(want, "stop_reason") + values_of(want, "matched"), want
    if case.deployment == "speculative" and case.path == GENERATE and case.max_tokens > 1:
        assert values_of(want, "spec_verify_ct"), want


# ---- what a disaggregated cluster refuses, it refuses as colocated does ---------------------

TYPE_CONFUSION = [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "n": "2"}, "n"),
    (COMPLETIONS, {"prompt": ["hi", 3]}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": "true"}, "stream"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]}, "tools"),
    (GENERATE, {"text": "hi", "sampling_params": {"max_new_tokens": 4.0}}, "max_new_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), TYPE_CONFUSION)
def test_a_wrong_type_is_the_same_400_through_the_router(deployments, path, body, param):
    """The router passes what it cannot split to the workers, which refuse it as a
    colocated worker does; a client's 400 is not a worker failure in the router's metrics."""
    reference, cluster = deployments["plain"]
    want = reference.post(path, body)
    got = cluster.router.post(path, body)
    assert want.status_code == got.status_code == 400, (want.text, got.text)
    assert param in (got.json()["error"]["param"] or got.json()["error"]["message"])
    assert got.json()["error"]["param"] == want.json()["error"]["param"]
    assert "leg_failures_total{" not in cluster.router.get("/metrics").text


def test_a_repeated_prompt_reports_its_cached_tokens_colocated_and_disaggregated(deployments):
    """The second request of a prompt reads its full pages from the prefix cache (of the
    colocated worker; of the prefill worker, which reports them to decode in the metadata
    record), and the usage block says how many tokens that was, as OpenAI and vLLM do."""
    reference, cluster = deployments["plain"]
    body = {"prompt": list(range(100, 141)), "max_tokens": 2, "temperature": 0}
    hits_before = reference.metric("prefix_cache_hit_tokens_total")
    for base in (reference.url, cluster.router.url):
        usages = [
            httpx.post(base + COMPLETIONS, json=body, timeout=120).json()["usage"] for _ in "12"
        ]
        # 41 tokens: two full pages of 16 are cached, the last page is computed again
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 32], base
    assert reference.metric("prefix_cache_hit_tokens_total") == hits_before + 32
    assert reference.metric("kv_cache_pages_cached") >= 2


def test_a_conversation_sends_the_decode_worker_only_its_new_pages(deployments, tiny_model_dirs):
    """Turn n + 1 resends turn n's prompt and answer: the decode worker that decoded turn n
    holds their KV in its prefix cache, so the prefill worker sends only the pages after
    them (decode's transfer counters show it), and every answer equals colocated serving
    without prefix caching."""
    _, cluster = deployments["plain"]
    (decode,) = cluster.decode
    plain = LLM(
        tiny_model_dirs("llama"),
        device="cpu",
        dtype="float32",
        chunked_prefill_size=16,
        disable_prefix_caching=True,
    )
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    page = 16  # the engine's default page size
    prompt = list(range(400, 441))
    before = cluster.state(decode)
    page_bytes = None
    known = 0  # tokens of the conversation whose KV decode holds
    for turn in range(3):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                "ignore_eos": True}}  # fmt: skip
        answer = httpx.post(cluster.router.url + GENERATE, json=body, timeout=120).json()
        assert answer["output_ids"] == plain.generate([prompt], greedy)[0].token_ids, turn
        cached = min(known, len(prompt) - 1) // page
        pages = -(-len(prompt) // page)

        def counted(last=before, cached=cached) -> bool:
            # NOTE: workers report their counters with their stats, a moment after a step;
            # decode counts the bytes it skipped when it commits, after all others landed.
            state = cluster.state(decode)
            return state["bytes_received"] > last["bytes_received"] and (
                cached == 0 or state["bytes_skipped"] > last["bytes_skipped"]
            )

        wait_until(counted, f"turn {turn}'s transfer counters", 10, describe=cluster.states)
        now = cluster.state(decode)
        received = now["bytes_received"] - before["bytes_received"]
        page_bytes = page_bytes or received // pages  # turn 0 receives every page
        assert received == (pages - cached) * page_bytes, turn
        assert now["bytes_skipped"] - before["bytes_skipped"] == cached * page_bytes, turn
        if turn:
            assert cached >= 3  # the previous turn's prompt and answer, but its last token
        before = now
        known = len(prompt) + len(answer["output_ids"]) - 1
        prompt = prompt + answer["output_ids"] + list(range(500 + 10 * turn, 509 + 10 * turn))
    assert decode.metric("kv_transfer_skipped_bytes_total") > 0


def test_every_page_is_free_afterwards(deployments):
    for _, cluster in deployments.values():
        cluster.wait_all_free()
