"""Kubernetes manifests (deploy/k8s): every overlay renders, validates against the 1.32 schemas
and follows the deployment contract (names, env, ports, probes, security, secrets).

Custom resources have no offline schema, so LeaderWorkerSet and PodMonitor are checked here for
the fields their controllers require.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.k8s_render import (
    OVERLAYS,
    PodTemplate,
    container_ports,
    containers,
    env_by_name,
    of_kind,
    pod_templates,
    render,
)

K8S_VERSION = "1.32"
NAMESPACE = "pdserve"
COMMON_LABELS = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/part-of": "pdserve"}
CUSTOM_KINDS = {"LeaderWorkerSet", "PodMonitor"}
WORKERS = ("prefill", "decode")
SECRET = "pdserve-secrets"
SECRET_KEYS = {"PDSERVE_API_KEY": "api-key", "PDSERVE_TRANSFER_TOKEN": "transfer-token"}
PORTS = {
    "router": {"http": 8000},
    "prefill": {"http": 30000, "bootstrap": 8998},
    "decode": {"http": 30000},
}
WORKER_ENV = {"MODEL_PATH": "/models", "PORT": "30000", "TRANSFER_BACKEND": "tcp"}
ENV = {
    "router": {
        "ROLE": "router",
        "HOST": "0.0.0.0",
        "PORT": "8000",
        "PREFILL_SERVICE": "pdserve-prefill:30000",
        "DECODE_SERVICE": "pdserve-decode:30000",
    },
    "prefill": {**WORKER_ENV, "ROLE": "prefill", "BOOTSTRAP_PORT": "8998"},
    "decode": {**WORKER_ENV, "ROLE": "decode"},
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
LWS_SPEC_KEYS = {
    "replicas",
    "leaderWorkerTemplate",
    "rolloutStrategy",
    "startupPolicy",
    "networkConfig",
}
LWS_RESTART_POLICIES = {"None", "Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart"}
LWS_STARTUP_POLICIES = {"LeaderCreated", "LeaderReady"}


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture
def objects(overlay) -> list[dict[str, Any]]:
    return render(overlay)


@pytest.fixture
def pods(objects) -> list[PodTemplate]:
    templates = pod_templates(objects)
    assert {pod.component for pod in templates} == {"router", *WORKERS}
    return templates


def kind_name(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def selected(pods: list[PodTemplate], match_labels: dict[str, str]) -> list[PodTemplate]:
    """Pod templates whose labels include every match label (an empty selector selects none)."""
    if not match_labels:
        return []
    return [pod for pod in pods if match_labels.items() <= pod.labels.items()]


def volumes(pod: PodTemplate) -> dict[str, dict[str, Any]]:
    return {volume["name"]: volume for volume in pod.spec.get("volumes", [])}


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}


def validate_pod_template(template: dict[str, Any], name: str) -> None:
    """A LeaderWorkerSet pod template is a core/v1 PodTemplateSpec: validate it as a PodTemplate."""
    wrapped = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": name},
        "template": template,
    }
    kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


# Rendering and schemas


def test_expected_overlays_exist():
    assert {"deployments", "leaderworkerset", "hostpath-model", "podmonitor"} <= set(OVERLAYS)


def test_objects_share_namespace_and_common_labels(objects):
    assert objects
    for obj in objects:
        assert obj["metadata"].get("namespace") == NAMESPACE, kind_name(obj)
        labels = obj["metadata"].get("labels", {})
        assert COMMON_LABELS.items() <= labels.items(), kind_name(obj)


def test_object_names_are_unique(objects):
    names = [kind_name(obj) for obj in objects]
    assert len(names) == len(set(names))


def test_no_secret_is_shipped(objects):
    assert not of_kind(objects, "Secret"), "users create pdserve-secrets; no default key ships"


def test_builtin_objects_validate_strictly(objects):
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert obj["kind"] in CUSTOM_KINDS, f"no schema for {kind_name(obj)}"
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{kind_name(obj)}: {error.message} at {list(error.absolute_path)}")


# LeaderWorkerSet (custom resource: checked against what the LWS API requires)


@pytest.fixture(scope="module")
def leaderworkersets() -> list[dict[str, Any]]:
    found = [obj for name in OVERLAYS for obj in of_kind(render(name), "LeaderWorkerSet")]
    assert found, "no overlay renders a LeaderWorkerSet"
    return found


def test_lws_overlay_replaces_worker_deployments():
    objects = render("leaderworkerset")
    assert {d["metadata"]["name"] for d in of_kind(objects, "Deployment")} == {"pdserve-router"}
    lws_names = {lws["metadata"]["name"] for lws in of_kind(objects, "LeaderWorkerSet")}
    assert lws_names == {"pdserve-prefill-lws", "pdserve-decode-lws"}


def test_lws_names_leave_worker_service_names_free(objects):
    # The LWS controller creates a headless Service named after each LeaderWorkerSet.
    services = {svc["metadata"]["name"] for svc in of_kind(objects, "Service")}
    for lws in of_kind(objects, "LeaderWorkerSet"):
        assert lws["metadata"]["name"] not in services


def test_lws_api_version_and_spec_keys(leaderworkersets):
    for lws in leaderworkersets:
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert set(lws["spec"]) <= LWS_SPEC_KEYS, kind_name(lws)
        assert "workerTemplate" in lws["spec"]["leaderWorkerTemplate"], kind_name(lws)


def test_lws_group_size_is_one(leaderworkersets):
    for lws in leaderworkersets:
        size = lws["spec"]["leaderWorkerTemplate"].get("size", 1)
        assert isinstance(size, int) and size >= 1, f"{kind_name(lws)}: size {size!r}"
        assert size == 1, (
            f"{kind_name(lws)}: size {size}, but a pdserve worker is one process on one GPU "
            "with no multi-node model parallelism; pdserve-node refuses LWS_GROUP_SIZE > 1"
        )


def test_lws_restart_and_startup_policies(leaderworkersets):
    for lws in leaderworkersets:
        restart = lws["spec"]["leaderWorkerTemplate"].get(
            "restartPolicy", "RecreateGroupOnPodRestart"
        )
        startup = lws["spec"].get("startupPolicy", "LeaderCreated")
        assert restart in LWS_RESTART_POLICIES, kind_name(lws)
        assert startup in LWS_STARTUP_POLICIES, kind_name(lws)
        assert (restart, startup) == ("RecreateGroupOnPodRestart", "LeaderCreated")


def test_lws_pod_templates_validate_as_core_pod_templates(leaderworkersets):
    for lws in leaderworkersets:
        lwt = lws["spec"]["leaderWorkerTemplate"]
        for key in ("workerTemplate", "leaderTemplate"):
            if key in lwt:
                validate_pod_template(lwt[key], f"{lws['metadata']['name']}-{key.lower()}")


def test_lws_pods_equal_deployment_pods():
    """Nothing in the pod template has to differ: the Services and PDBs select both alike."""
    deployments = {d["metadata"]["name"]: d for d in of_kind(render("deployments"), "Deployment")}
    for lws in of_kind(render("leaderworkerset"), "LeaderWorkerSet"):
        source = deployments[lws["metadata"]["name"].removesuffix("-lws")]
        assert lws["spec"]["leaderWorkerTemplate"]["workerTemplate"] == source["spec"]["template"]
        assert lws["spec"].get("replicas", 1) == source["spec"].get("replicas", 1)


# PodMonitor (custom resource)


def test_podmonitor_selects_pods_by_named_port():
    checked = 0
    for name in OVERLAYS:
        objects = render(name)
        for monitor in of_kind(objects, "PodMonitor"):
            assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
            matched = selected(pod_templates(objects), monitor["spec"]["selector"]["matchLabels"])
            assert matched, f"{name}: PodMonitor selects no pods"
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert endpoint.get("path", "/metrics") == "/metrics"
                for pod in matched:
                    assert endpoint["port"] in container_ports(pod), (name, pod.name)
            checked += 1
    assert checked, "no overlay renders a PodMonitor"


# Services, budgets and discovery


def test_services_select_pods_and_their_target_ports(objects, pods):
    for svc in of_kind(objects, "Service"):
        matched = selected(pods, svc["spec"]["selector"])
        assert matched, f"{kind_name(svc)} selects no pods"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in matched:
                ports = container_ports(pod)
                found = target in ports if isinstance(target, str) else target in ports.values()
                assert found, f"{kind_name(svc)} port {target!r} not in {pod.name}"


def test_service_shapes(objects):
    services = {svc["metadata"]["name"]: svc["spec"] for svc in of_kind(objects, "Service")}
    assert services["pdserve-router"].get("type", "ClusterIP") == "ClusterIP"
    assert services["pdserve-router"].get("clusterIP") != "None"
    for component in ("router", *WORKERS):
        spec = services[f"pdserve-{component}"]
        assert {p["name"]: p["port"] for p in spec["ports"]} == PORTS[component]
    for worker in WORKERS:
        assert services[f"pdserve-{worker}"]["clusterIP"] == "None", "the router resolves pod IPs"


def test_router_discovers_worker_services(objects, pods):
    services = {svc["metadata"]["name"]: svc["spec"] for svc in of_kind(objects, "Service")}
    (router,) = [pod for pod in pods if pod.component == "router"]
    env = env_by_name(router.spec["containers"][0])
    for worker in WORKERS:
        name, port = env[f"{worker.upper()}_SERVICE"]["value"].split(":")
        assert int(port) in [p["port"] for p in services[name]["ports"]]
        assert {pod.component for pod in selected(pods, services[name]["selector"])} == {worker}


def test_pdbs_select_one_component_each(objects, pods):
    covered = set()
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        assert pdb["spec"]["maxUnavailable"] == 1, kind_name(pdb)
        assert set(pdb["spec"]["selector"]) == {"matchLabels"}, kind_name(pdb)
        components = {
            pod.component for pod in selected(pods, pdb["spec"]["selector"]["matchLabels"])
        }
        assert len(components) == 1, f"{kind_name(pdb)} selects {components or 'no pods'}"
        covered |= components
    assert covered == {"router", *WORKERS}


def test_router_runs_two_replicas(objects):
    (router,) = [
        d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == "pdserve-router"
    ]
    assert router["spec"]["replicas"] == 2


# Pods


def test_images_and_command(pods):
    for pod in pods:
        for container in containers(pod):
            assert container["image"].startswith("pdserve:"), (pod.name, container["image"])
            assert container["imagePullPolicy"] == "IfNotPresent", pod.name
            assert container["command"] == ["pdserve-node"], pod.name


def test_env_follows_contract(pods):
    for pod in pods:
        env = env_by_name(pod.spec["containers"][0])
        plain = {name: entry["value"] for name, entry in env.items() if "value" in entry}
        assert plain == ENV[pod.component], pod.name
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


def test_worker_grace_period(pods):
    for pod in pods:
        if pod.component in WORKERS:
            assert pod.spec["terminationGracePeriodSeconds"] >= 60, pod.name


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
