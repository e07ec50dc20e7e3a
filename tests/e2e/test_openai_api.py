"""The OpenAI API through the official client against a live `pdserve serve`."""

from __future__ import annotations

import openai
import pytest

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server):
    return server.model_path


def test_models_lists_the_served_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_completion_with_usage(client, model):
    out = client.completions.create(
        model=model,
        prompt="Hello there",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streamed_completion_equals_non_streamed(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=20, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # NOTE: each token's text_offset too, however the stream grouped tokens into events.
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in streamed for x in getattr(lp, field)] == getattr(whole.logprobs, field)


def test_chat_completion_and_stream(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    stream = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == (
        whole.usage.completion_tokens
    )


def test_n_choices(client, model):
    out = client.completions.create(
        model=model, prompt="Pick", max_tokens=8, n=2, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text != out.choices[1].text
    assert out.usage.completion_tokens == sum(8 for _ in out.choices) or all(
        c.finish_reason == "stop" for c in out.choices
    )


def test_stop_string(client, model):
    full = (
        client.completions.create(
            model=model, prompt="The", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[5:8]
    out = client.completions.create(
        model=model, prompt="The", max_tokens=30, temperature=0, stop=[stop]
    ).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]


def test_seeded_sampling_reproduces(client, model):
    def sample(seed):
        return (
            client.completions.create(
                model=model, prompt="Seeds", max_tokens=16, temperature=1.0, top_p=0.95, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_completion_logprobs(client, model):
    out = client.completions.create(
        model=model,
        prompt="Log",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert len(out.logprobs.token_logprobs) == 5
    assert all(len(top) <= 2 and top for top in out.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in out.logprobs.token_logprobs)
    assert len(out.logprobs.tokens) == len(out.logprobs.text_offset) == 5


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: top-1


def test_token_id_prompts_and_greedy_equal_offline_llm(client, model):
    prompts = [[5, 17, 300, 42], [7] * 40, [900]]
    out = client.completions.create(
        model=model, prompt=prompts, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    served = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    offline = LLM(model, device="cpu", max_model_len=512).generate(
        prompts, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    )
    assert served == [o.text for o in offline]
