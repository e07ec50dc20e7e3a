"""The router's DNS discovery: service names, pool membership, failed lookups, and a router
that finds a live (fake) worker through a name."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient

from pdserve.router import discovery
from pdserve.router.app import build_router_app
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Discovery, ServiceName, resolve, worker_url
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import Role, Worker, WorkerPool
from tests.waiting import wait_until

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


def test_service_names_parse_and_name_what_is_wrong():
    assert ServiceName.parse("pdserve-decode:30000") == ServiceName("pdserve-decode", 30000)
    assert ServiceName.parse("[::1]:8") == ServiceName("::1", 8)
    for bad in ("pdserve-decode", ":30000", "http://x:1", "x:port", "x:0", "x:70000"):
        with pytest.raises(ValueError, match=r"NAME:PORT|port must be"):
            ServiceName.parse(bad)


def test_worker_urls_bracket_ipv6():
    assert worker_url("10.1.2.3", 30000) == "http://10.1.2.3:30000"
    assert worker_url("fd00::7", 30000) == "http://[fd00::7]:30000"


def test_sync_adds_out_of_rotation_removes_vanished_and_keeps_static_workers():
    static = Worker("http://static:1", Role.DECODE)
    pool = WorkerPool(Role.DECODE, [static])
    added, removed = pool.sync_discovered({"http://10.0.0.1:2", "http://10.0.0.2:2"})
    assert (added, removed) == (["http://10.0.0.1:2", "http://10.0.0.2:2"], [])
    assert [w.healthy for w in pool.workers] == [True, False, False]
    kept = pool.workers[1]
    added, removed = pool.sync_discovered({"http://10.0.0.1:2"})
    assert (added, removed) == ([], ["http://10.0.0.2:2"])
    assert pool.workers == [static, kept]  # the same object: its health and load stay
    pool.sync_discovered(set())
    assert pool.workers == [static]


def test_a_failed_lookup_keeps_the_workers_the_last_good_one_found(monkeypatch):
    answers = {"p": ["http://10.0.0.1:1"]}

    async def fake_resolve(service, timeout_s):
        if service.host not in answers:
            raise OSError("Name or service not known")
        return answers[service.host]

    monkeypatch.setattr(discovery, "resolve", fake_resolve)
    pool = WorkerPool(Role.PREFILL, [])
    finder = Discovery([(pool, ServiceName("p", 1)), (pool, ServiceName("q", 1))], 1.0)
    asyncio.run(finder.refresh())
    assert pool.workers == []  # q failed: nothing is synced from a partial answer
    answers["q"] = ["http://10.0.0.2:1"]
    asyncio.run(finder.refresh())
    assert [w.url for w in pool.workers] == ["http://10.0.0.1:1", "http://10.0.0.2:1"]
    del answers["p"]
    asyncio.run(finder.refresh())
    assert len(pool.workers) == 2
    answers["p"] = []
    asyncio.run(finder.refresh())
    assert [w.url for w in pool.workers] == ["http://10.0.0.2:1"]


def test_a_dual_stack_name_counts_each_worker_once(monkeypatch):
    import socket

    async def both_families(host, port, type):
        return [
            (socket.AF_INET6, type, 6, "", ("fd00::5", port, 0, 0)),
            (socket.AF_INET, type, 6, "", ("10.0.0.5", port)),
            (socket.AF_INET, type, 6, "", ("10.0.0.5", port)),
        ]

    async def v6_only(host, port, type):
        return [(socket.AF_INET6, type, 6, "", ("fd00::5", port, 0, 0))]

    for fake, expected in (
        (both_families, ["http://10.0.0.5:7"]),
        (v6_only, ["http://[fd00::5]:7"]),
    ):

        async def run(fake=fake):
            loop = asyncio.get_running_loop()
            monkeypatch.setattr(loop, "getaddrinfo", fake)
            return await resolve(ServiceName("w", 7), 1.0)

        assert asyncio.run(run()) == expected


def test_resolve_asks_the_system_resolver():
    urls = asyncio.run(resolve(ServiceName("localhost", 4321), 5.0))
    assert "http://127.0.0.1:4321" in urls
    with pytest.raises(OSError):
        asyncio.run(resolve(ServiceName("no-such-worker.invalid", 1), 5.0))


def test_metrics_drop_workers_that_left_the_pool():
    pool = WorkerPool(Role.DECODE, [])
    metrics = RouterMetrics()
    pool.sync_discovered({"http://10.0.0.9:1"})
    assert b'url="http://10.0.0.9:1"' in metrics.render([pool])
    pool.sync_discovered(set())
    assert b'url="http://10.0.0.9:1"' not in metrics.render([pool])


class _FakeWorker(BaseHTTPRequestHandler):
    """Answers /health and /server_info like a prefill worker with bootstrap port 8998."""

    def do_GET(self):
        body = json.dumps({"disaggregation_bootstrap_port": 8998}).encode()
        self.send_response(200 if self.path in ("/health", "/server_info") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_worker_port():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeWorker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_router_finds_workers_through_a_name(fake_worker_port):
    service = ServiceName("localhost", fake_worker_port)
    config = RouterConfig(prefill_services=(service,), decode_services=(service,))
    with TestClient(build_router_app(config)) as client:
        pools = client.get("/workers").json()
        assert client.get("/health").status_code == 200
        assert client.get("/liveness").status_code == 200
    url = f"http://127.0.0.1:{fake_worker_port}"
    for role in ("prefill", "decode"):
        found = {w["url"]: w for w in pools[role]}
        assert found[url]["healthy"] and found[url]["discovered"]
    assert {w["url"]: w for w in pools["prefill"]}[url]["bootstrap_port"] == 8998


def test_a_router_with_nothing_to_discover_is_live_but_not_healthy():
    service = ServiceName("no-such-worker.invalid", 1)
    config = RouterConfig(
        prefill_services=(service,), decode_services=(service,), health_check_timeout_s=5
    )
    with TestClient(build_router_app(config)) as client:
        assert client.get("/liveness").status_code == 200
        assert client.get("/health").status_code == 503
        assert client.get("/workers").json() == {"prefill": [], "decode": []}
        reply = client.post("/v1/completions", json={"prompt": "hi"})
        assert reply.status_code == 503
        assert "no healthy prefill worker" in reply.json()["error"]["message"]


def test_bootstrap_host_must_be_an_address_peers_can_reach():
    from pdserve.transfer.config import TransferConfig

    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="--bootstrap-host"):
            TransferConfig(bootstrap_host=wildcard)
    assert TransferConfig(bootstrap_host="10.0.0.5").bootstrap_host == "10.0.0.5"


def test_api_key_comes_from_the_environment_when_no_flag_is_given(monkeypatch):
    from pdserve.cli import build_parser
    from pdserve.commands.common import http_settings_from_args

    args = build_parser().parse_args(
        ["router", "--prefill-service", "p:1", "--decode", "http://d:2"]
    )
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert http_settings_from_args(args, port=8000).api_key == "from-env"
    args.api_key = "from-flag"
    assert http_settings_from_args(args, port=8000).api_key == "from-flag"
    monkeypatch.delenv("PDSERVE_API_KEY")
    args.api_key = None
    assert http_settings_from_args(args, port=8000).api_key is None


def test_router_cli_names_what_is_missing_or_malformed(capsys):
    from pdserve.cli import main

    assert main(["router", "--decode", "http://d:2"]) == 2
    assert "--prefill-service" in capsys.readouterr().err
    assert main(["router", "--prefill-service", "p", "--decode", "http://d:2"]) == 2
    assert "NAME:PORT" in capsys.readouterr().err


def test_dead_worker_timeout_sets_keepalive_and_user_timeout():
    import socket

    from pdserve.router.transport import dead_peer_socket_options

    options = {(level, name): value for level, name, value in dead_peer_socket_options(15)}
    assert options[(socket.SOL_SOCKET, socket.SO_KEEPALIVE)] == 1
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        idle = options[(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)]
        interval = options[(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)]
        count = options[(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)]
        assert idle + interval * count <= 15
        assert options[(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)] == 15000
    tiny = {name: value for _, name, value in dead_peer_socket_options(0.5)}
    assert all(value >= 1 for value in tiny.values())


class _NotAWorker(BaseHTTPRequestHandler):
    """/health is fine, /server_info is not JSON (something else on the worker's port)."""

    def do_GET(self):
        body = b"ok" if self.path == "/health" else b"<html>not pdserve</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_prefill_port_that_is_not_a_worker_stays_out_without_stopping_health_checks():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotAWorker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    config = RouterConfig(prefill=((url, None),), decode=(url,), health_check_interval_s=0.05)
    try:
        with TestClient(build_router_app(config)) as client:
            # NOTE: last_error is set at the second failed check: the checker survived the
            # first bad answer (before the fix it raised and health checks stopped).
            def errored() -> dict | None:
                prefill = client.get("/workers").json()["prefill"][0]
                return prefill if prefill["last_error"] else None

            prefill = wait_until(
                errored,
                "the health checker to record an error",
                10,
                poll_s=0.05,
                describe=lambda: client.get("/workers").json(),
            )
            assert not prefill["healthy"]
            assert "did not report its bootstrap port" in prefill["last_error"]
            assert client.get("/workers").json()["decode"][0]["healthy"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
