"""Kubernetes manifests (deploy/k8s), object level: every overlay renders and validates against
the 1.32 schemas; LeaderWorkerSet and PodMonitor (custom resources, no offline schema) are
checked for the fields their controllers require; Services, PDBs and monitors select pods.
Pod-level checks are in test_k8s_pods.py.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.k8s_render import (
    OVERLAYS,
    PORTS,
    WORKERS,
    container_ports,
    env_by_name,
    kind_name,
    of_kind,
    pod_templates,
    render,
    selected,
)

NAMESPACE = "pdserve"
COMMON_LABELS = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/part-of": "pdserve"}
CUSTOM_KINDS = {"LeaderWorkerSet", "PodMonitor"}
K8S_VERSION = "1.32"
LWS_SPEC_KEYS = {
    "replicas",
    "leaderWorkerTemplate",
    "rolloutStrategy",
    "startupPolicy",
    "networkConfig",
}
LWS_RESTART_POLICIES = {"None", "Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart"}
LWS_STARTUP_POLICIES = {"LeaderCreated", "LeaderReady"}


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
    expected = {"deployments", "leaderworkerset", "leaderworkerset-multinode", "hostpath-model"}
    assert expected | {"podmonitor"} <= set(OVERLAYS)


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


def test_lws_groups_are_one_pod_unless_the_worker_spans_pods():
    """Size 1 in the leaderworkerset overlay; 2 in leaderworkerset-multinode, whose workers
    span two pods (test_k8s_multinode.py)."""
    for overlay, size in (("leaderworkerset", 1), ("leaderworkerset-multinode", 2)):
        for lws in of_kind(render(overlay), "LeaderWorkerSet"):
            lwt = lws["spec"]["leaderWorkerTemplate"]
            assert lwt.get("size", 1) == size, f"{overlay}: {kind_name(lws)}"
            assert ("leaderTemplate" in lwt) == (size > 1), f"{overlay}: {kind_name(lws)}"


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
