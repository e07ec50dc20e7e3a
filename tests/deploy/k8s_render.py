"""Render the kustomize overlays under deploy/k8s for the deploy tests (offline, torch-free).

`kubectl kustomize` is the renderer users run, so the tests check exactly what gets applied.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from tests.deploy.tooling import require_tool

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = tuple(
    sorted(p.name for p in (K8S_DIR / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
)
RENDER_TIMEOUT_S = 60
WORKERS = ("prefill", "decode")
# Pods of a worker spanning several pods, after its leader (overlay leaderworkerset-multinode):
# they run tensor-parallel ranks only, under a component label of their own.
RANK_COMPONENTS = {f"{worker}-ranks": worker for worker in WORKERS}
# The contract's named ports per component.
PORTS = {
    "router": {"http": 8000},
    "prefill": {"http": 30000, "bootstrap": 8998},
    "decode": {"http": 30000},
}


class PodTemplate(NamedTuple):
    """One pod template of a rendered workload.

    kind is "Deployment", "LeaderWorkerSet/workerTemplate" or "LeaderWorkerSet/leaderTemplate";
    component is the template's app.kubernetes.io/component label (None when missing).
    """

    kind: str
    name: str
    component: str | None
    spec: dict[str, Any]
    labels: dict[str, str]
    annotations: dict[str, str]


@functools.cache
def _render_text(overlay: str) -> str:
    kubectl = require_tool("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S_DIR / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=RENDER_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {overlay} failed:\n{result.stderr}")
    return result.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects of one overlay, freshly parsed (callers may mutate them)."""
    return [obj for obj in yaml.safe_load_all(_render_text(overlay)) if obj]


def pod_templates(objects: list[dict[str, Any]]) -> list[PodTemplate]:
    """Pod templates of the Deployments and LeaderWorkerSets (leader and worker) in objects."""
    found = []
    for obj in objects:
        name = obj["metadata"]["name"]
        if obj["kind"] == "Deployment":
            templates = {"Deployment": obj["spec"]["template"]}
        elif obj["kind"] == "LeaderWorkerSet":
            lwt = obj["spec"]["leaderWorkerTemplate"]
            templates = {
                f"LeaderWorkerSet/{key}": lwt[key]
                for key in ("workerTemplate", "leaderTemplate")
                if key in lwt
            }
        else:
            continue
        for kind, template in templates.items():
            meta = template.get("metadata", {})
            labels = meta.get("labels", {})
            found.append(
                PodTemplate(
                    kind=kind,
                    name=name,
                    component=labels.get("app.kubernetes.io/component"),
                    spec=template["spec"],
                    labels=labels,
                    annotations=meta.get("annotations", {}),
                )
            )
    return found


def is_rank_pod(pod: PodTemplate) -> bool:
    return pod.component in RANK_COMPONENTS


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def containers(pod: PodTemplate) -> list[dict[str, Any]]:
    """Init containers, then containers."""
    return pod.spec.get("initContainers", []) + pod.spec["containers"]


def container_ports(pod: PodTemplate) -> dict[str, int]:
    """Named container ports of a pod: name -> containerPort."""
    return {p["name"]: p["containerPort"] for c in containers(pod) for p in c.get("ports", [])}


def env_by_name(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's env entries by variable name."""
    return {entry["name"]: entry for entry in container.get("env", [])}


def kind_name(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def selected(pods: list[PodTemplate], match_labels: dict[str, str]) -> list[PodTemplate]:
    """Pod templates whose labels include every match label (an empty selector selects none)."""
    if not match_labels:
        return []
    return [pod for pod in pods if match_labels.items() <= pod.labels.items()]
