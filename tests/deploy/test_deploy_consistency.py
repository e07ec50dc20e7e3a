"""The deployment files cannot drift from the code: every flag the scripts build from a
manifest's environment parses and is listed by `pdserve ROLE --help`, every port and probe
path in the manifests is the one the process serves, every variable the manifests set is one
the script reads, and live processes started by the script from a manifest's environment
answer every probe and scrape path the manifests name."""

from __future__ import annotations

import functools
import os
import pathlib
import re
import signal
import subprocess
import sys

import httpx
import pytest

from pdserve.cli import build_parser
from pdserve.server.local_process import free_port
from tests.deploy.k8s_render import (
    OVERLAYS,
    RANK_COMPONENTS,
    container_ports,
    containers,
    of_kind,
    pod_templates,
    render,
)
from tests.waiting import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "deploy" / "scripts"
NODE_SCRIPT = SCRIPTS / "pdserve-node.sh"
FAKE_POD_IP = "10.1.2.3"
START_DEADLINE_S = 180
# What pdserve reads from the environment itself (secrets stay off command lines).
PDSERVE_ENV = ("PDSERVE_API_KEY", "PDSERVE_TRANSFER_TOKEN")


def _node_containers(overlay: str):
    """(pod template, container) for every container started by the node script."""
    for pod in pod_templates(render(overlay)):
        for container in containers(pod):
            if container.get("command") == ["pdserve-node"]:
                yield pod, container


def _literal_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet would set it (the pod IP faked; secrets
    left out: pdserve reads those itself)."""
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        elif entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[entry["name"]] = FAKE_POD_IP
    return env


def _dry_run(script: pathlib.Path, env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [str(script)],
        env={"PATH": os.environ["PATH"], **env, "PDSERVE_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, f"{script.name} refused {env}: {done.stderr}"
    return done.stdout.splitlines()


@functools.cache
def _help(*command: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def _documented_variables(script: pathlib.Path) -> set[str]:
    """The variables the script's header documents: in its `Variables` block (up to the next
    empty comment line), upper-case names that start a line or follow a comma on one."""
    lines = script.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Variables"))
    names = set()
    for line in lines[start + 1 :]:
        if line.strip() == "#" or not line.startswith("#"):
            break
        match = re.match(r"#\s+([A-Z][A-Z0-9_]+(?:,\s*[A-Z][A-Z0-9_]+)*)\s", line + " ")
        if match:
            names.update(n.strip() for n in match.group(1).split(","))
    return names


def _read_variables(script: pathlib.Path) -> set[str]:
    body = "\n".join(line for line in script.read_text().splitlines() if not line.startswith("#"))
    return set(re.findall(r"\$\{?!?([A-Z][A-Z0-9_]+)", body)) | set(
        re.findall(r"\b(?:require|check_port) ([A-Z][A-Z0-9_]+)", body)
    )


# ---- static: manifests -> script -> CLI -----------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifest_environments_build_commands_the_cli_accepts(overlay):
    found = 0
    for pod, container in _node_containers(overlay):
        argv = _dry_run(NODE_SCRIPT, _literal_env(container))
        assert argv[0] == "pdserve"
        args = build_parser().parse_args(argv[1:])  # exits (fails the test) on a bad flag
        role = argv[argv.index("--log-level") + 2]
        # NOTE: a rank pod (after a spanning worker's leader) runs its worker's role, ranks only.
        assert role == RANK_COMPONENTS.get(pod.component, pod.component), (pod.name, argv)
        listed = _help(role)
        for flag in _flags(argv[argv.index(role) + 1 :]):
            assert flag in listed, f"{flag} (from {pod.name}) is not in `pdserve {role} --help`"
        if pod.component in RANK_COMPONENTS:
            continue  # no HTTP: no ports to agree with
        ports = container_ports(pod)
        assert args.port == ports["http"], (pod.name, args.port, ports)
        if role == "prefill":
            assert args.bootstrap_port == ports["bootstrap"], (pod.name, ports)
        if role != "router":
            assert args.host == FAKE_POD_IP and args.bootstrap_host == FAKE_POD_IP, argv
        found += 1
    assert found >= 3, f"{overlay}: expected router, prefill and decode containers"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_set_only_variables_the_script_or_pdserve_reads(overlay):
    readable = _documented_variables(NODE_SCRIPT)
    for pod, container in _node_containers(overlay):
        for entry in container.get("env", []):
            assert entry["name"] in readable, (
                f"{pod.name} sets {entry['name']}, which pdserve-node.sh does not document"
            )


def test_pdserve_reads_the_secret_variables_itself():
    for role in ("prefill", "decode", "router", "serve"):
        assert "$PDSERVE_API_KEY" in _help(role), role
    for role in ("prefill", "decode"):
        assert "$PDSERVE_TRANSFER_TOKEN" in _help(role), role


@pytest.mark.parametrize("script", sorted(SCRIPTS.glob("*.sh")), ids=lambda p: p.name)
def test_every_documented_variable_is_read_and_every_read_one_documented(script):
    documented, read = _documented_variables(script), _read_variables(script)
    # pdserve reads these itself; the node script only documents them.
    assert documented - set(PDSERVE_ENV) <= read, f"documented, never read: {documented - read}"
    internal = {"BASH_SOURCE", "BASH_REMATCH"}
    assert read - internal <= documented, f"read, not documented: {read - documented}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_discovers_the_worker_services(overlay):
    objects = render(overlay)
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    pods = pod_templates(objects)
    routers = [c for p, c in _node_containers(overlay) if p.component == "router"]
    assert routers
    for container in routers:
        env = _literal_env(container)
        for role in ("prefill", "decode"):
            name, port = env[f"{role.upper()}_SERVICE"].rsplit(":", 1)
            service = services[name]
            assert service["spec"].get("clusterIP") == "None", f"{name} must be headless"
            assert int(port) in [p["port"] for p in service["spec"]["ports"]]
            selector = service["spec"]["selector"]
            matched = [p for p in pods if selector.items() <= p.labels.items()]
            assert matched and all(p.component == role for p in matched), (name, selector)


def _probe_paths(pod) -> set[tuple[str, str]]:
    """(kind, path) of every HTTP probe and scrape path on the pod."""
    found = set()
    for container in containers(pod):
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            http = container.get(kind, {}).get("httpGet")
            if http:
                assert http["port"] in ("http", container_ports(pod).get("http")), (pod.name, kind)
                found.add((kind, http["path"]))
    if pod.annotations.get("prometheus.io/scrape") == "true":
        found.add(("scrape", pod.annotations["prometheus.io/path"]))
    return found


def _manifest_paths() -> dict[str, set[tuple[str, str]]]:
    by_role: dict[str, set[tuple[str, str]]] = {}
    for overlay in OVERLAYS:
        objects = render(overlay)
        for pod in pod_templates(objects):
            if pod.component in RANK_COMPONENTS:
                continue  # serves no HTTP (test_k8s_multinode.py)
            by_role.setdefault(pod.component, set()).update(_probe_paths(pod))
        for monitor in of_kind(objects, "PodMonitor"):
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                for role in by_role:
                    by_role[role].add(("podmonitor", endpoint.get("path", "/metrics")))
    return by_role


def test_every_pod_has_startup_readiness_and_liveness_probes():
    for role, paths in _manifest_paths().items():
        kinds = {kind for kind, _ in paths}
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= kinds, (role, paths)


# ---- live: processes started by the script answer the manifests' paths -----------------


class _Role:
    def __init__(self, name: str, env: dict[str, str], log: pathlib.Path):
        self.name = name
        self.url = f"http://127.0.0.1:{env['PORT']}"
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [str(NODE_SCRIPT)],
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ok(self, path: str, deadline_s: float = START_DEADLINE_S) -> None:
        """Until `path` answers 200; a timeout or an exit shows the role's log."""

        def ok() -> bool:
            assert self.process.poll() is None, f"{self.name} exited:\n{self.tail()}"
            return httpx.get(self.url + path, timeout=2).status_code == 200

        what = f"{self.name} {path} to answer 200"
        wait_until(
            ok, what, deadline_s, poll_s=0.25, describe=self.tail, retry_on=(httpx.HTTPError,)
        )

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(timeout=30)


API_KEY = "consistency-key"


@pytest.fixture(scope="module")
def live_roles(tiny_model_dirs, tmp_path_factory):
    """A prefill, a decode worker and a router started by pdserve-node.sh with the
    `deployments` overlay's environment (loopback instead of the pod IP, free ports, the tiny
    model, the API key the Secret would hold); the router discovers the workers by name."""
    logs = tmp_path_factory.mktemp("roles")
    envs = {pod.component: _literal_env(c) for pod, c in _node_containers("deployments")}
    started: list[_Role] = []
    try:
        ports = {}
        for role in ("prefill", "decode"):
            ports[role] = free_port()
            env = {
                **envs[role],
                "POD_IP": "127.0.0.1",
                "PORT": str(ports[role]),
                "MODEL_PATH": tiny_model_dirs("llama"),
                "DEVICE": "cpu",
                "PDSERVE_API_KEY": API_KEY,
            }
            if role == "prefill":
                env["BOOTSTRAP_PORT"] = str(free_port())
            started.append(_Role(role, env, logs / f"{role}.log"))
        router_env = {
            **envs["router"],
            "HOST": "127.0.0.1",
            "PORT": str(free_port()),
            "PREFILL_SERVICE": f"localhost:{ports['prefill']}",
            "DECODE_SERVICE": f"localhost:{ports['decode']}",
            "EXTRA_ARGS": "--health-check-interval 0.5",
            "PDSERVE_API_KEY": API_KEY,
        }
        started.append(_Role("router", router_env, logs / "router.log"))
        yield {role.name: role for role in started}
    finally:
        for role in started:
            role.stop()


def test_live_roles_answer_every_probe_and_scrape_path(live_roles):
    for role, paths in _manifest_paths().items():
        process = live_roles[role]
        for kind, path in sorted(paths):
            process.wait_ok(path)  # raises with the log if it never answers 200
            reply = httpx.get(process.url + path, timeout=10)  # probes send no API key
            assert reply.status_code == 200, (role, kind, path, reply.text)
            if kind in ("scrape", "podmonitor"):
                assert "pdserve" in reply.text, (role, path)


def test_a_request_through_the_discovering_router_uses_the_secret_key(live_roles, tiny_model_dirs):
    router = live_roles["router"]
    router.wait_ok("/health")  # both workers found through DNS and healthy
    body = {"model": tiny_model_dirs("llama"), "prompt": "hi", "max_tokens": 4}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=60).status_code == 401
    reply = httpx.post(
        router.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_sigterm_reaches_pdserve_through_the_script(live_roles):
    """Runs last in this module: stops the roles the way the kubelet does. The script
    forwards SIGTERM, pdserve shuts down gracefully (uvicorn then exits with the signal's
    status, 143) and the script exits with pdserve's status; nothing keeps serving."""
    for role in ("router", "decode", "prefill"):
        process = live_roles[role]
        status = process.stop()
        assert status in (0, 128 + signal.SIGTERM), f"{role}: exit {status}\n{process.tail()}"
        assert "Finished server process" in process.log.read_text(), process.tail()
        with pytest.raises(httpx.HTTPError):
            httpx.get(process.url + "/health", timeout=2)
