"""The leaderworkerset-multinode overlay: each prefill and decode worker is one LeaderWorkerSet
group of two pods running one tensor-parallel worker. The leader is the Deployment's pod (HTTP,
probes, Services) with TP_SIZE; the pod after it is the same pod without HTTP (no probes, no
ports, no scrape annotations) under a component label no Service, budget or monitor selects;
the node script turns the group's variables into the node flags of each pod."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.k8s_render import (
    RANK_COMPONENTS,
    WORKERS,
    env_by_name,
    of_kind,
    pod_templates,
    render,
    selected,
)
from tests.deploy.test_scripts import argv_of, value

OVERLAY = "leaderworkerset-multinode"
GROUP_SIZE = 2
HTTP_ONLY = ("startupProbe", "readinessProbe", "livenessProbe", "ports")


@pytest.fixture(scope="module")
def objects():
    return render(OVERLAY)


def groups(objects) -> dict[str, dict]:
    """worker -> its LeaderWorkerSet's leaderWorkerTemplate."""
    found = {}
    for lws in of_kind(objects, "LeaderWorkerSet"):
        worker = lws["metadata"]["labels"]["app.kubernetes.io/component"]
        found[worker] = lws["spec"]["leaderWorkerTemplate"]
    assert set(found) == set(WORKERS)
    return found


def test_a_rank_pod_is_its_leader_without_http(objects):
    for worker, lwt in groups(objects).items():
        assert lwt["size"] == GROUP_SIZE
        leader, rank = lwt["leaderTemplate"], lwt["workerTemplate"]
        expected = copy.deepcopy(leader)
        for field in HTTP_ONLY:
            del expected["spec"]["containers"][0][field]
        del expected["metadata"]["annotations"]
        expected["metadata"]["labels"]["app.kubernetes.io/component"] = f"{worker}-ranks"
        assert rank == expected, worker


def test_the_leader_is_the_deployments_pod_with_tp_size(objects):
    deployments = {d["metadata"]["name"]: d for d in of_kind(render("deployments"), "Deployment")}
    for worker, lwt in groups(objects).items():
        pod = copy.deepcopy(deployments[f"pdserve-{worker}"]["spec"]["template"])
        pod["spec"]["containers"][0]["env"].append({"name": "TP_SIZE", "value": "2"})
        assert lwt["leaderTemplate"] == pod, worker


def test_ranks_per_pod_match_the_gpus_each_pod_asks_for(objects):
    for worker, lwt in groups(objects).items():
        for key in ("leaderTemplate", "workerTemplate"):
            container = lwt[key]["spec"]["containers"][0]
            tp_size = int(env_by_name(container)["TP_SIZE"]["value"])
            gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
            assert tp_size == gpus * lwt["size"], (worker, key)


def test_nothing_but_the_leaders_is_selected(objects):
    """Services (the router finds workers through them), budgets and monitors select the
    leaders; a rank pod serves no HTTP, so none of them may select it."""
    templates = pod_templates(objects)
    ranks = [pod for pod in templates if pod.component in RANK_COMPONENTS]
    assert len(ranks) == len(WORKERS)
    for kind in ("Service", "PodDisruptionBudget", "PodMonitor"):
        for obj in of_kind(objects, kind):
            spec = obj["spec"]
            labels = spec["selector"] if kind == "Service" else spec["selector"]["matchLabels"]
            assert not selected(ranks, labels), obj["metadata"]["name"]
    for worker in WORKERS:
        service = next(
            s for s in of_kind(objects, "Service") if s["metadata"]["name"] == f"pdserve-{worker}"
        )
        leaders = selected(templates, service["spec"]["selector"])
        assert [pod.kind for pod in leaders] == ["LeaderWorkerSet/leaderTemplate"], worker


@pytest.mark.parametrize("worker", WORKERS)
def test_the_node_script_gives_each_pod_of_a_group_its_node_flags(worker, objects):
    """What the LeaderWorkerSet controller sets in each pod (LWS_*), with the template's
    env, becomes node 0 (serving) and node 1 (ranks) of one worker."""
    lwt = groups(objects)[worker]
    leader_address = f"pdserve-{worker}-lws-0.pdserve-{worker}-lws"
    for index, key in enumerate(("leaderTemplate", "workerTemplate")):
        env = {
            name: entry["value"]
            for name, entry in env_by_name(lwt[key]["spec"]["containers"][0]).items()
            if "value" in entry
        }
        env.update(
            POD_IP="10.0.0.7",
            LWS_GROUP_SIZE=str(lwt["size"]),
            LWS_WORKER_INDEX=str(index),
            LWS_LEADER_ADDRESS=leader_address,
        )
        argv = argv_of("pdserve-node.sh", env)
        assert argv[argv.index("--host") - 1] == worker
        assert value(argv, "--tp-size") == "2"
        assert (value(argv, "--nnodes"), value(argv, "--node-rank")) == ("2", str(index))
        assert value(argv, "--dist-init-addr") == f"{leader_address}:29500"
