"""Cache-aware routing: a request goes where its prefix was sent while loads are balanced, to
the emptiest index when nothing matches enough, and to the least loaded worker once loads are
imbalanced; through the router, a conversation's turns land on one worker."""

from __future__ import annotations

import json
import tracemalloc

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.router.app import build_router_app
from pdserve.router.config import RouterConfig
from pdserve.router.policies import CacheAware, CacheAwareSettings
from pdserve.router.prefix_index import (
    MAX_BLOCKS,
    TEXT_BLOCK,
    PrefixIndex,
    block_names,
    routing_key,
)
from pdserve.router.workers import Role, Worker


def _workers(count: int) -> list[Worker]:
    return [Worker(f"http://10.0.0.{i}:30000", Role.DECODE) for i in range(count)]


def routed(policy: CacheAware, workers: list[Worker], key, **kw) -> Worker:
    """A request routed by `policy` that its worker accepted."""
    chosen = policy.choose(workers, key=key, **kw)
    policy.accepted(chosen, key)
    return chosen


def test_routing_keys_of_every_request_kind():
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]}]}  # fmt: skip
    assert routing_key(chat) == "<system>Be brief.<user>Hi"
    assert routing_key({"prompt": "once upon"}) == "once upon"
    assert routing_key({"prompt": ["only one"]}) == "only one"
    assert routing_key({"prompt": [5, 6, 7]}) == (5, 6, 7)
    assert routing_key({"prompt": [[5, 6, 7]]}) == (5, 6, 7)
    assert routing_key({"text": "generate me"}) == "generate me"
    assert routing_key({"input_ids": [1, 2]}) == (1, 2)
    for nothing in ({}, {"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": [1, "x"]},
                    {"messages": "not a list"}, {"input_ids": [True]}):  # fmt: skip
        assert routing_key(nothing) is None, nothing


def test_block_names_stand_for_whole_prefixes():
    a = block_names("x" * TEXT_BLOCK + "y" * TEXT_BLOCK + "z")
    b = block_names("w" * TEXT_BLOCK + "y" * TEXT_BLOCK)
    assert len(a) == len(b) == 2
    assert a[1] != b[1], "the same block after different prefixes is another prefix"
    assert block_names((1, 2, 3)) == []  # shorter than a block
    assert len(block_names("x" * (TEXT_BLOCK * MAX_BLOCKS * 4))) == MAX_BLOCKS  # a huge body


def test_an_index_forgets_long_prefixes_first():
    index = PrefixIndex(capacity=4)
    long = block_names(tuple(range(48)))  # 6 blocks of 8 ids
    index.insert(long)
    assert len(index) == 4 and index.match(long) == 4
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)


def test_a_conversation_follows_the_worker_its_prefix_went_to():
    workers = _workers(3)
    policy = CacheAware()
    history = "<system>You are a helpful assistant." * 4 + "<user>Tell me about owls."
    first = routed(policy, workers, history)
    for turn in range(4):
        history += f"<assistant>Answer {turn}.<user>And then {turn}?"
        first.in_flight += 1  # busier than the others, but not past the thresholds
        assert routed(policy, workers, history) is first
    # another conversation goes where the index is emptiest: not `first`
    other = routed(policy, workers, "<user>Something else entirely, and long enough." * 3)
    assert other is not first
    # a retry avoids the worker that failed, even with the best match
    assert routed(policy, workers, history, exclude=[first]) is not first


def test_imbalanced_loads_win_over_the_cache():
    workers = _workers(2)
    policy = CacheAware(CacheAwareSettings(balance_abs_threshold=4, balance_rel_threshold=1.5))
    key = "a shared system prompt that is long enough to fill some blocks" * 3
    home = routed(policy, workers, key)
    home.in_flight = 4  # max - min = 4: not past the absolute threshold, the cache wins
    assert routed(policy, workers, key) is home
    home.in_flight = 5  # max - min = 5 > 4 and 5 > 0 x 1.5: the least loaded wins
    assert routed(policy, workers, key) is not home
    assert routed(policy, workers, None) is not home  # nothing to match: least loaded


def test_below_the_cache_threshold_a_request_goes_to_the_emptiest_index():
    workers = _workers(2)
    policy = CacheAware(CacheAwareSettings(cache_threshold=0.9))
    stem = "s" * (4 * TEXT_BLOCK)
    home = routed(policy, workers, stem + "a" * (4 * TEXT_BLOCK))
    # half of this key matches `home`: not more than 0.9 of it, so the empty worker gets it
    assert routed(policy, workers, stem + "b" * (4 * TEXT_BLOCK)) is not home


def test_through_the_router_a_conversation_stays_on_one_worker():
    hosts = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200)
        hosts.append(request.url.host)
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"},
                  "finish_reason": "stop"}  # fmt: skip
        return httpx.Response(200, json={"id": "c", "object": "chat.completion",
                                         "choices": [choice]})  # fmt: skip

    config = RouterConfig(
        worker_urls=("http://w0", "http://w1", "http://w2"),
        policy="cache_aware",
        health_check_interval_s=60.0,
    )
    app = build_router_app(config, httpx.MockTransport(handle))
    conversations = {name: [{"role": "system", "content": f"You are {name}. " * 20}]
                     for name in ("ann", "bob", "cid")}  # fmt: skip
    with TestClient(app) as client:
        for turn in range(4):
            for name, messages in conversations.items():
                messages.append({"role": "user", "content": f"turn {turn} of {name}"})
                reply = client.post("/v1/chat/completions", json={"messages": messages})
                assert reply.status_code == 200, reply.text
                messages.append({"role": "assistant", "content": "ok"})
    by_conversation = [hosts[i::3] for i in range(3)]
    assert all(len(set(turns)) == 1 for turns in by_conversation), by_conversation
    assert len({turns[0] for turns in by_conversation}) == 3, "spread over the workers"


def test_choosing_a_worker_remembers_nothing_until_it_accepted():
    workers = _workers(2)
    policy = CacheAware()
    key = "a long system prompt shared by a whole conversation, turn after turn" * 3
    chosen = policy.choose(workers, key=key)
    assert all(len(policy._index(w)) == 0 for w in workers)
    policy.accepted(chosen, key)
    assert len(policy._index(chosen)) == len(block_names(key))


def test_an_index_at_its_cap_costs_about_8_bytes_a_name():
    capacity = 1 << 16
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(capacity)
        index.insert(range(1, 4 * capacity))  # NOTE: four times what it holds
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == capacity
    # NOTE: an OrderedDict of int names cost ~200 bytes a name
    assert held < 10 * capacity, f"{held / capacity:.0f} bytes a name"


def test_an_index_keeps_recent_names_and_pushes_out_old_ones():
    index = PrefixIndex(1 << 12)
    index.insert(range(1, 1 << 14))  # NOTE: inserted last to first: 1 is the most recent
    recent = list(range(1, 1 << 9))
    assert index.match(recent) == len(recent)
    assert index.match([(1 << 14) - 1]) == 0, "the oldest name is gone"
    assert index.match([-5]) == 0


def test_a_text_part_that_is_no_string_reaches_the_worker_and_gets_its_400():
    bodies = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200)
        bodies.append(json.loads(request.content))
        error = {"message": "content[0].text: Input should be a valid string", "type":
                 "invalid_request_error", "param": "messages", "code": 400}  # fmt: skip
        return httpx.Response(400, json={"error": error})

    config = RouterConfig(
        worker_urls=("http://w0", "http://w1"), policy="cache_aware", health_check_interval_s=60
    )
    with TestClient(build_router_app(config, httpx.MockTransport(handle))) as client:
        for text in (5, None, ["a"], {"b": 1}):
            content = [{"type": "text", "text": text}]
            body = {"messages": [{"role": "user", "content": content}]}
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 400, reply.text
            assert "valid string" in reply.json()["error"]["message"]
        # NOTE: refused everywhere, so remembered nowhere
        policy = client.app.state.proxy.route.policy
        assert all(len(index) == 0 for index in policy._indexes.values())
    assert len(bodies) == 4
    assert routing_key({"messages": [{"role": "user", "content": content}]}) == "<user>"


def test_requests_every_worker_refuses_leave_the_index_alone():
    async def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200)
        if b"refuse me" in request.content:
            return httpx.Response(400, json={"error": {"message": "no", "code": 400}})
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"},
                  "finish_reason": "stop"}  # fmt: skip
        return httpx.Response(200, json={"id": "c", "object": "chat.completion",
                                         "choices": [choice]})  # fmt: skip

    config = RouterConfig(
        worker_urls=("http://w0", "http://w1"), policy="cache_aware", health_check_interval_s=60
    )
    with TestClient(build_router_app(config, httpx.MockTransport(handle))) as client:
        policy = client.app.state.proxy.route.policy
        for i in range(20):
            body = {"messages": [{"role": "user", "content": f"refuse me {i} " * 40}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 400
        assert sum(len(index) for index in policy._indexes.values()) == 0
        body = {"messages": [{"role": "user", "content": "a real conversation " * 40}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert sum(len(index) for index in policy._indexes.values()) > 0
