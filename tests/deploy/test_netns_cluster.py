"""Several hosts on one machine: network namespaces with their own addresses, joined by a
bridge, play a router node, a prefill node and a decode node. `deploy/scripts/pdserve-cluster.sh`
starts the roles in them (through an ssh stand-in that enters the namespace) with
`pdserve-node.sh`; a request goes through the router; then the decode node's cable is cut.

Needs root (CAP_NET_ADMIN) for `ip netns`; skips, saying why, where that is not permitted.
Every address used lives only inside namespaces this test creates and deletes.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.waiting import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "deploy" / "scripts"
SSH_STAND_IN = pathlib.Path(__file__).with_name("netns_ssh.sh")
SUBNET = "10.231.0"
NODES = {"router": 1, "prefill": 2, "decode": 3}  # node -> last address byte
REQUEST_TIMEOUT_S = 120  # longer than any failure below may take: they must not need it
DEAD_WORKER_S = 6
START_DEADLINE_S = 240

CLIENT = r"""
import json, sys, time, urllib.error, urllib.request
method, url, body, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
request = urllib.request.Request(
    url, data=body.encode() or None, method=method,
    headers={"Content-Type": "application/json"},
)
start = time.monotonic()
try:
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        status, text = reply.status, reply.read().decode()
except urllib.error.HTTPError as e:
    status, text = e.code, e.read().decode()
except OSError as e:
    status, text = 0, repr(e)
print(json.dumps({"status": status, "body": text, "seconds": time.monotonic() - start}))
"""

# Streams a completion; prints FIRST at its first event, then a summary when it ends.
STREAM_CLIENT = r"""
import json, sys, time, urllib.request
request = urllib.request.Request(
    sys.argv[1], data=sys.argv[2].encode(), headers={"Content-Type": "application/json"}
)
tokens, error, first = 0, None, None
with urllib.request.urlopen(request, timeout=300) as reply:
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if first is None:
            first = time.monotonic()
            print("FIRST", flush=True)
        if "error" in event:
            error = event["error"]
            break
        tokens += 1
print(json.dumps({"tokens": tokens, "error": error, "ended": time.monotonic()}), flush=True)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class Lab:
    """The namespaces: one per node plus a switch holding the bridge."""

    def __init__(self) -> None:
        tag = f"pd{os.getpid() % 100000}"
        self.switch = f"{tag}-sw"
        self.ns = {node: f"{tag}-{node}" for node in NODES}
        self.addr = {node: f"{SUBNET}.{last}" for node, last in NODES.items()}

    def create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node, ns in self.ns.items():
            _ip("netns", "add", ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                f"port-{node}", "netns", self.switch)  # fmt: skip
            _ip("-n", self.switch, "link", "set", f"port-{node}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[node]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def delete(self) -> None:
        for ns in [*self.ns.values(), self.switch]:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)

    def cable(self, node: str, up: bool) -> None:
        _ip("-n", self.switch, "link", "set", f"port-{node}", "up" if up else "down")

    def pids(self, node: str) -> list[str]:
        return _ip("netns", "pids", self.ns[node], check=False).stdout.split()

    def http(self, method: str, url: str, body: dict | None = None, timeout: float = 10) -> dict:
        """A request sent from inside the router node."""
        argv = [sys.executable, "-c", CLIENT, method, url, json.dumps(body) if body else ""]
        done = subprocess.run(
            ["ip", "netns", "exec", self.ns["router"], *argv, str(timeout)],
            capture_output=True,
            text=True,
            timeout=timeout + 30,
            check=True,
        )
        return json.loads(done.stdout)


def _wait_for(check, what: str, deadline_s: float, log: pathlib.Path) -> None:
    """wait_until at this file's pace (each check may start a process in a namespace); a
    timeout shows the cluster script's log."""
    wait_until(check, what, deadline_s, poll_s=0.5, describe=lambda: _tail(log))


def _tail(log: pathlib.Path) -> str:
    return log.read_text()[-4000:] if log.exists() else f"(no log at {log})"


def _netns_permitted() -> str | None:
    """None if this process may create network namespaces, else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"pdprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    veth = _ip("link", "add", "eth0", "netns", probe, "type", "veth", "peer", "name", "eth1",
               "netns", probe, check=False)  # fmt: skip
    _ip("netns", "del", probe, check=False)
    if veth.returncode != 0:
        return f"veth pairs are not permitted here: {veth.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def lab():
    reason = _netns_permitted()
    if reason is not None:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    lab = Lab()
    try:
        lab.create()
        yield lab
    finally:
        lab.delete()


@pytest.fixture(scope="module")
def cluster(lab, tiny_model_dirs, tmp_path_factory):
    """The cluster script holding a router, a prefill and a decode node."""
    log = tmp_path_factory.mktemp("netns") / "cluster.log"
    env = {
        **os.environ,
        "PREFILL_HOSTS": lab.addr["prefill"],
        "DECODE_HOSTS": lab.addr["decode"],
        "ROUTER_HOST": lab.addr["router"],
        "ROUTER_BIND": lab.addr["router"],
        "MODEL_PATH": tiny_model_dirs("llama"),
        "TRANSFER_BACKEND": "tcp",
        "EXTRA_ARGS": "--device cpu --transfer-timeout 8 --transfer-peer-timeout 3",
        "ROUTER_ARGS": f"--request-timeout {REQUEST_TIMEOUT_S} --health-check-interval 1 "
        f"--health-check-timeout 1 --connect-timeout 2 --dead-worker-timeout {DEAD_WORKER_S}",
        "SSH": str(SSH_STAND_IN),
        "NETNS_HOSTS": " ".join(f"{lab.addr[n]}={lab.ns[n]}" for n in NODES),
        "PDSERVE_BIN": shutil.which("pdserve") or "pdserve",
    }
    with log.open("w") as out:
        script = subprocess.Popen(
            [str(SCRIPTS / "pdserve-cluster.sh")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    router = f"http://{lab.addr['router']}:8000"

    def healthy():
        assert script.poll() is None, f"the cluster script exited:\n{_tail(log)}"
        return lab.http("GET", router + "/health", timeout=3)["status"] == 200

    try:
        _wait_for(healthy, "router /health 200", START_DEADLINE_S, log)
        yield script, router, log
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait(timeout=30)


def _worker_health(lab, router: str) -> dict[str, bool]:
    pools = json.loads(lab.http("GET", router + "/workers")["body"])
    return {w["url"]: w["healthy"] for role in ("prefill", "decode") for w in pools[role]}


def _idle(lab, node: str) -> bool:
    url = f"http://{lab.addr[node]}:30000/server_info"
    reply = lab.http("GET", url, timeout=3)
    if reply["status"] != 200:
        return False
    state = json.loads(reply["body"])["internal_states"][0]
    busy = ("kv_pages_used", "num_running", "num_waiting", "num_bootstrapping")
    busy += ("num_prealloc", "num_transferring", "num_prefilling")
    return all(state.get(key, 0) == 0 for key in busy)


def _completion(model_path: str) -> dict:
    return {"model": model_path, "prompt": "hello world", "max_tokens": 6, "temperature": 0}


def test_node_script_picks_the_namespace_address(lab, tiny_model_dirs):
    """Without HOST, the node's address comes from its interfaces (or its route to
    MASTER_ADDR): the veth address, never loopback."""
    base = {**os.environ, "ROLE": "decode", "MODEL_PATH": tiny_model_dirs("llama")}
    for extra in ({}, {"MASTER_ADDR": lab.addr["router"]}):
        done = subprocess.run(
            ["ip", "netns", "exec", lab.ns["decode"], str(SCRIPTS / "pdserve-node.sh")],
            env={**base, **extra, "PDSERVE_DRY_RUN": "1"},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        argv = done.stdout.split()
        assert argv[argv.index("--host") + 1] == lab.addr["decode"], done.stdout
        assert argv[argv.index("--bootstrap-host") + 1] == lab.addr["decode"], done.stdout


def test_request_through_three_hosts_then_the_decode_link_is_cut(lab, cluster, tiny_model_dirs):
    script, router, log = cluster
    completion = _completion(tiny_model_dirs("llama"))
    reply = lab.http("POST", router + "/v1/completions", completion, timeout=60)
    assert reply["status"] == 200, reply
    assert json.loads(reply["body"])["usage"]["completion_tokens"] == 6
    decode_url = f"http://{lab.addr['decode']}:30000"
    assert _worker_health(lab, router)[decode_url] is True

    lab.cable("decode", up=False)
    try:
        reply = lab.http("POST", router + "/v1/completions", completion, timeout=60)
        assert reply["status"] in (502, 503, 504), reply
        assert "error" in json.loads(reply["body"]), reply
        assert reply["seconds"] <= DEAD_WORKER_S + 10, reply  # not the request deadline
        _wait_for(
            lambda: _worker_health(lab, router)[decode_url] is False,
            "the router to take the decode worker out of rotation",
            20,
            log,
        )
        metrics = lab.http("GET", router + "/metrics")["body"]
        assert f'pdserve_router:worker_healthy{{role="decode",url="{decode_url}"}} 0.0' in metrics
        reply = lab.http("POST", router + "/v1/completions", completion, timeout=30)
        assert reply["status"] == 503, reply
        assert "no healthy decode worker" in reply["body"]
        assert reply["seconds"] < 5, reply
        assert lab.http("GET", router + "/health")["status"] == 503
        _wait_for(lambda: _idle(lab, "prefill"), "the prefill worker to free its room", 30, log)
    finally:
        lab.cable("decode", up=True)

    _wait_for(
        lambda: _worker_health(lab, router)[decode_url] is True,
        "the decode worker back in rotation",
        20,
        log,
    )
    reply = lab.http("POST", router + "/v1/completions", completion, timeout=60)
    assert reply["status"] == 200, reply
    _wait_for(lambda: _idle(lab, "decode"), "the decode worker to free every page", 30, log)
    assert script.poll() is None


def test_a_stream_whose_decode_link_is_cut_ends_with_an_error_event(lab, cluster, tiny_model_dirs):
    """Mid-stream, the decode node goes silent (no FIN, no reset): the router's keepalive
    gives up after about --dead-worker-timeout and ends the stream with an SSE error event,
    long before the request deadline."""
    _, router, log = cluster
    decode_url = f"http://{lab.addr['decode']}:30000"
    _wait_for(lambda: _worker_health(lab, router)[decode_url], "decode in rotation", 20, log)
    body = {**_completion(tiny_model_dirs("llama")), "max_tokens": 1900, "ignore_eos": True}
    client = subprocess.Popen(
        ["ip", "netns", "exec", lab.ns["router"], sys.executable, "-c", STREAM_CLIENT,
         router + "/v1/completions", json.dumps({**body, "stream": True})],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert client.stdout.readline().strip() == "FIRST"
        lab.cable("decode", up=False)
        cut = time.monotonic()
        out, _ = client.communicate(timeout=DEAD_WORKER_S + 60)
        summary = json.loads(out.strip().splitlines()[-1])
    finally:
        lab.cable("decode", up=True)
        if client.poll() is None:
            client.kill()
    assert "failed mid-stream (" in summary["error"]["message"], summary
    assert summary["tokens"] < 1900, summary
    assert summary["ended"] - cut <= DEAD_WORKER_S + 15, summary
    _wait_for(lambda: _worker_health(lab, router)[decode_url], "decode back in rotation", 30, log)
    _wait_for(lambda: _idle(lab, "decode"), "the decode worker to free every page", 60, log)


def test_sigterm_to_the_cluster_script_stops_every_role(lab, cluster):
    script, _, log = cluster
    assert all(lab.pids(node) for node in NODES)
    script.send_signal(signal.SIGTERM)
    assert script.wait(timeout=60) == 143, _tail(log)
    _wait_for(
        lambda: not any(lab.pids(node) for node in NODES),
        "every role to exit after SIGTERM",
        30,
        log,
    )


def test_a_tensor_parallel_worker_spans_two_hosts(lab, tiny_model_dirs, tmp_path):
    """`pdserve-node.sh` with ROLE=serve, TP_SIZE=2, NNODES=2 on two hosts (CPU, gloo over the
    bridge): node 0 serves what a TP 1 engine generates, token for token; stopping it ends
    node 1. Its own ports, so it can run beside the cluster above."""
    from pdserve import LLM, SamplingParams

    model = tiny_model_dirs("llama")
    with LLM(model, device="cpu") as llm:
        greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
        expected = llm.generate(["hello world"], greedy)[0].token_ids
    hosts = {0: "prefill", 1: "decode"}  # node rank -> namespace
    env = {
        **os.environ,
        "ROLE": "serve",
        "MODEL_PATH": model,
        "DEVICE": "cpu",
        "PORT": "31000",
        "TP_SIZE": "2",
        "NNODES": "2",
        "MASTER_ADDR": lab.addr[hosts[0]],
        "MASTER_PORT": "29600",
        "GLOO_SOCKET_IFNAME": "eth0",
        "PDSERVE_BIN": shutil.which("pdserve") or "pdserve",
    }
    logs = {rank: tmp_path / f"node{rank}.log" for rank in hosts}
    nodes = {}
    for rank, host in hosts.items():
        with logs[rank].open("w") as out:
            nodes[rank] = subprocess.Popen(
                ["ip", "netns", "exec", lab.ns[host], str(SCRIPTS / "pdserve-node.sh")],
                env={**env, "NODE_RANK": str(rank)},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    url = f"http://{lab.addr[hosts[0]]}:31000"

    def healthy():
        for rank, node in nodes.items():
            assert node.poll() is None, f"node {rank} exited:\n{_tail(logs[rank])}"
        return lab.http("GET", url + "/health", timeout=3)["status"] == 200

    try:
        _wait_for(
            healthy,
            "node 0 /health 200",
            START_DEADLINE_S,
            logs[1],
        )
        body = {
            "text": "hello world",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        }
        reply = lab.http("POST", url + "/generate", body, timeout=60)
        assert reply["status"] == 200, reply
        assert json.loads(reply["body"])["output_ids"] == expected
        nodes[0].send_signal(signal.SIGTERM)
        assert nodes[0].wait(timeout=60) in (0, 143), _tail(logs[0])
        assert nodes[1].wait(timeout=30) == 0, _tail(logs[1])
    finally:
        for node in nodes.values():
            if node.poll() is None:
                node.kill()
                node.wait(timeout=30)
