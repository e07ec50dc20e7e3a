"""Fixtures of the deploy tests: each overlay rendered, and its pod templates."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.k8s_render import (
    OVERLAYS,
    WORKERS,
    PodTemplate,
    is_rank_pod,
    pod_templates,
    render,
)


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture
def objects(overlay) -> list[dict[str, Any]]:
    return render(overlay)


@pytest.fixture
def pods(objects) -> list[PodTemplate]:
    """The pods that serve (router and workers; a spanning worker's leader): the rank pods
    after a leader are checked against their leader in test_k8s_multinode.py."""
    templates = [pod for pod in pod_templates(objects) if not is_rank_pod(pod)]
    assert {pod.component for pod in templates} == {"router", *WORKERS}
    return templates
