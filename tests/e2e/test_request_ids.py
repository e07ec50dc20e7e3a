"""One request id end to end: the client's `X-Request-Id` comes back on the answer and names the
request in the log of every process it touched (router, prefill and decode front ends, their
engine processes), so one grep finds a request's whole life. A request without one gets the
router's, the same in every log; a header that cannot be an id is refused naming it."""

from __future__ import annotations

import pathlib
import uuid

import httpx
import pytest

from tests.e2e.pd_cluster import start_cluster
from tests.waiting import wait_until

BODY = {"prompt": "a request to follow", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def traced(tiny_model_dirs, tmp_path_factory):
    """A disaggregated cluster whose processes log at debug level, one file each."""
    log_dir = tmp_path_factory.mktemp("logs")
    cluster = start_cluster(tiny_model_dirs("llama"), log_dir=str(log_dir))
    yield cluster, log_dir
    cluster.stop()


def _lines_naming(log_dir: pathlib.Path, request_id: str) -> dict[str, list[str]]:
    return {
        log.stem: [line for line in log.read_text().splitlines() if request_id in line]
        for log in sorted(log_dir.glob("*.log"))
    }


def _wait_for_whole_life(log_dir: pathlib.Path, request_id: str) -> dict[str, list[str]]:
    """Each process's lines about the request, once every one has written its last (the
    router's access line and the decode engine's end come after the client's answer)."""
    wanted = {
        "router": ["pdserve.router.access: request " + request_id],
        "prefill-0": ["pdserve.server.access: request " + request_id, "engine: request "],
        "decode-0": ["pdserve.server.access: request " + request_id, "engine: request "],
    }

    def seen() -> bool:
        found = _lines_naming(log_dir, request_id)
        return all(
            any(piece in line for line in found.get(name, ()))
            for name, pieces in wanted.items()
            for piece in pieces
        ) and all(
            any(": ended (" in line for line in found[name]) for name in ("prefill-0", "decode-0")
        )

    wait_until(seen, f"every process to log request {request_id}", 20.0)
    return _lines_naming(log_dir, request_id)


def test_the_clients_request_id_names_the_request_in_every_process(traced):
    cluster, log_dir = traced
    request_id = f"trace-{uuid.uuid4().hex}"
    answer = cluster.router.post("/v1/completions", BODY, headers={"X-Request-Id": request_id})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == request_id
    assert answer.json()["id"] == f"cmpl-{request_id}"
    lines = _wait_for_whole_life(log_dir, request_id)
    for worker in ("prefill-0", "decode-0"):
        added = [line for line in lines[worker] if "engine: request " in line and "added" in line]
        assert len(added) == 1, lines[worker]
        assert f"request cmpl-{request_id}: added" in added[0]
        access = [line for line in lines[worker] if "pdserve.server.access" in line]
        assert access and " POST /v1/completions 200 " in access[0]
    assert " 200 " in lines["router"][-1]


def test_a_streamed_chat_without_an_id_carries_the_routers_everywhere(traced):
    cluster, log_dir = traced
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", cluster.router.url + "/v1/chat/completions", json=body, timeout=60
    ) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert f'"id":"chatcmpl-{request_id}"' in events[0].replace(" ", "")
    lines = _wait_for_whole_life(log_dir, request_id)
    assert any(" POST /v1/chat/completions 200 " in line for line in lines["decode-0"])


def test_fanned_out_prompts_keep_the_request_id_as_their_prefix(traced):
    cluster, log_dir = traced
    request_id = f"fan-{uuid.uuid4().hex}"
    body = {**BODY, "prompt": ["first prompt", "second prompt"]}
    answer = cluster.router.post("/v1/completions", body, headers={"X-Request-Id": request_id})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == request_id
    lines = _wait_for_whole_life(log_dir, request_id)
    added = [line for line in lines["decode-0"] if "engine: request " in line and "added" in line]
    assert len(added) == 2, lines["decode-0"]  # the router sent each prompt as a part of its own


@pytest.mark.parametrize(
    "bad",
    ["has space", "x" * 257, "caf\u00e9".encode().decode("latin-1")],
    ids=["space", "long", "utf8"],
)
def test_an_id_that_cannot_name_a_request_is_refused_naming_the_header(traced, bad):
    cluster, _ = traced
    for server in (cluster.router, cluster.prefill[0]):
        answer = httpx.post(
            server.url + "/v1/completions",
            json=BODY,
            headers={"X-Request-Id": bad.encode("latin-1")},
            timeout=30,
        )
        assert answer.status_code == 400, (server.url, answer.text)
        error = answer.json()["error"]
        assert "X-Request-Id" in error["message"] and error["code"] == "invalid_request_id"
