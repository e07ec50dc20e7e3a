"""Fixtures of the deploy tests: each overlay rendered, and its pod templates."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.k8s_render import OVERLAYS, WORKERS, PodTemplate, pod_templates, render


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
