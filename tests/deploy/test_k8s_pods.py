"""Kubernetes manifests (deploy/k8s), pod level: images, the launch script's environment,
ports, probes, security contexts, resources, GPUs, volumes and secrets follow the deployment
contract in every overlay."""

from __future__ import annotations

from typing import Any

from tests.deploy.k8s_render import (
    PORTS,
    WORKERS,
    PodTemplate,
    container_ports,
    containers,
    env_by_name,
    of_kind,
    pod_templates,
    render,
)

SECRET = "pdserve-secrets"
SECRET_KEYS = {"PDSERVE_API_KEY": "api-key", "PDSERVE_TRANSFER_TOKEN": "transfer-token"}
WORKER_ENV = {
    "MODEL_PATH": "/models",
    "PORT": "30000",
    "TRANSFER_BACKEND": "tcp",
    "SHUTDOWN_TIMEOUT": "50",
}
ENV = {
    "router": {
        "ROLE": "router",
        "HOST": "0.0.0.0",
        "PORT": "8000",
        "PREFILL_SERVICE": "pdserve-prefill:30000",
        "DECODE_SERVICE": "pdserve-decode:30000",
        "SHUTDOWN_TIMEOUT": "50",
    },
    "prefill": {**WORKER_ENV, "ROLE": "prefill", "BOOTSTRAP_PORT": "8998"},
    "decode": {
        **WORKER_ENV,
        "ROLE": "decode",
        "BOOTSTRAP_ALLOW": "127.0.0.0/8,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16",
    },
}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
PROBE_PATHS = {
    "router": ("/liveness", "/liveness", "/liveness"),
    "prefill": ("/health_generate", "/health_generate", "/health"),
    "decode": ("/health_generate", "/health_generate", "/health"),
}
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def volumes(pod: PodTemplate) -> dict[str, dict[str, Any]]:
    return {volume["name"]: volume for volume in pod.spec.get("volumes", [])}


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}


def test_images_and_command(pods):
    for pod in pods:
        for container in containers(pod):
            assert container["image"].startswith("pdserve:"), (pod.name, container["image"])
            assert container["imagePullPolicy"] == "IfNotPresent", pod.name
            assert container["command"] == ["pdserve-node"], pod.name


# Overlays whose workers span pods: tensor-parallel ranks in all, over the group's pods.
TP_ENV = {"leaderworkerset-multinode": {"TP_SIZE": "2"}}


def test_env_follows_contract(pods, overlay):
    for pod in pods:
        env = env_by_name(pod.spec["containers"][0])
        plain = {name: entry["value"] for name, entry in env.items() if "value" in entry}
        spanning = TP_ENV.get(overlay, {}) if pod.component in WORKERS else {}
        assert plain == {**ENV[pod.component], **spanning}, pod.name
        if pod.component in WORKERS:
            assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_secret_refs_use_pdserve_secrets(pods):
    for pod in pods:
        for container in containers(pod):
            assert "envFrom" not in container, pod.name
            for name, entry in env_by_name(container).items():
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if name in SECRET_KEYS:
                    assert ref is not None, f"{pod.name}: {name} must come from the Secret"
                if ref is not None:
                    assert ref["name"] == SECRET, pod.name
                    assert ref["key"] == SECRET_KEYS.get(name), f"{pod.name}: {name}"


def test_secrets_reach_the_roles_that_need_them(pods):
    for pod in pods:
        env = env_by_name(pod.spec["containers"][0])
        wanted = set(SECRET_KEYS) if pod.component in WORKERS else {"PDSERVE_API_KEY"}
        assert set(SECRET_KEYS) & set(env) == wanted, pod.name


def test_container_ports_follow_contract(pods):
    for pod in pods:
        assert container_ports(pod) == PORTS[pod.component], pod.name


def test_probes_use_contract_paths_and_named_ports(pods):
    for pod in pods:
        ports = container_ports(pod)
        container = pod.spec["containers"][0]
        for probe, path in zip(PROBES, PROBE_PATHS[pod.component], strict=True):
            http_get = container[probe]["httpGet"]
            assert http_get["path"] == path, (pod.name, probe)
            assert http_get["port"] == "http" and "http" in ports, (pod.name, probe)


def test_worker_startup_probe_allows_a_slow_model_load(pods):
    for pod in pods:
        if pod.component in WORKERS:
            startup = pod.spec["containers"][0]["startupProbe"]
            budget_s = startup["failureThreshold"] * startup.get("periodSeconds", 10)
            assert budget_s >= 600, f"{pod.name}: model load gets only {budget_s} s"


def test_prometheus_annotations(pods):
    for pod in pods:
        assert pod.annotations["prometheus.io/scrape"] == "true", pod.name
        assert pod.annotations["prometheus.io/path"] == "/metrics", pod.name
        assert pod.annotations["prometheus.io/port"] == str(container_ports(pod)["http"]), pod.name


def test_pods_run_as_non_root(pods):
    for pod in pods:
        assert POD_SECURITY.items() <= pod.spec["securityContext"].items(), pod.name
        for container in containers(pod):
            assert CONTAINER_SECURITY.items() <= container["securityContext"].items(), pod.name


def test_every_container_requests_cpu_and_memory(pods):
    for pod in pods:
        for container in containers(pod):
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), pod.name
            if pod.component in WORKERS:
                assert "memory" in container["resources"]["limits"], pod.name


def test_gpus_go_to_workers_only(pods):
    for pod in pods:
        resources = pod.spec["containers"][0]["resources"]
        gpus = (
            resources.get("requests", {}).get("nvidia.com/gpu"),
            resources.get("limits", {}).get("nvidia.com/gpu"),
        )
        assert gpus == ((1, 1) if pod.component in WORKERS else (None, None)), pod.name


def test_worker_dev_shm_is_memory_backed(pods):
    for pod in pods:
        if pod.component in WORKERS:
            shm = mounts(pod.spec["containers"][0])["/dev/shm"]
            empty_dir = volumes(pod)[shm["name"]]["emptyDir"]
            assert empty_dir["medium"] == "Memory" and "sizeLimit" in empty_dir, pod.name


def test_grace_period_outlasts_the_shutdown_timeout(pods):
    """pdserve lets in-flight requests finish for SHUTDOWN_TIMEOUT seconds after SIGTERM; the
    kubelet must not kill it before that."""
    for pod in pods:
        env = env_by_name(pod.spec["containers"][0])
        shutdown = float(env["SHUTDOWN_TIMEOUT"]["value"])
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        assert grace >= shutdown + 5, (pod.name, grace, shutdown)


def test_volume_mounts_have_volumes(pods):
    for pod in pods:
        for container in containers(pod):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes(pod), (pod.name, mount["name"])


def test_writable_dirs_are_empty_dirs(pods):
    """readOnlyRootFilesystem holds only because /tmp and $HOME/.cache are emptyDirs."""
    for pod in pods:
        for container in containers(pod):
            for path in ("/tmp", "/home/pdserve/.cache"):
                mount = mounts(container).get(path)
                assert mount is not None, (pod.name, path)
                assert "emptyDir" in volumes(pod)[mount["name"]], (pod.name, path)


def test_claims_exist_in_render(objects, pods):
    claims = {pvc["metadata"]["name"] for pvc in of_kind(objects, "PersistentVolumeClaim")}
    for pod in pods:
        for volume in volumes(pod).values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, pod.name


def test_workers_mount_the_model_read_only(pods):
    for pod in pods:
        if pod.component in WORKERS:
            mount = mounts(pod.spec["containers"][0])["/models"]
            assert mount["readOnly"] is True, pod.name
            volume = volumes(pod)[mount["name"]]
            if "hostPath" in volume:
                assert volume["hostPath"] == {"path": "/models", "type": "Directory"}
            else:
                assert volume["persistentVolumeClaim"] == {
                    "claimName": "pdserve-model",
                    "readOnly": True,
                }


def test_hostpath_overlay_drops_the_claim():
    objects = render("hostpath-model")
    assert not of_kind(objects, "PersistentVolumeClaim")
    for pod in pod_templates(objects):
        if pod.component in WORKERS:
            assert "hostPath" in volumes(pod)["model"], pod.name
