"""`GET /version` on the router and on workers: pdserve's version, open without the API key
(as `/health`), as vLLM serves it."""

from __future__ import annotations

import pathlib
import tomllib

from fastapi.testclient import TestClient

import pdserve
from pdserve.colocated.worker import build_worker
from pdserve.engine.core.config import EngineConfig
from pdserve.router.app import build_router_app
from pdserve.server.app import build_app
from pdserve.server.role import WorkerRole
from tests.unit.fake_workers import FakeWorkers

PYPROJECT = pathlib.Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_the_source_version_is_the_projects():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["version"] == pdserve.SOURCE_VERSION
    assert pdserve.__version__ == project["version"]  # installed, or the source tree's


def test_the_router_serves_its_version_without_the_key():
    fakes = FakeWorkers()
    with TestClient(build_router_app(fakes.config(api_key="sesame"), fakes.transport)) as client:
        response = client.get("/version")
        assert response.status_code == 200
        assert response.json() == {"version": pdserve.__version__}
        assert client.get("/workers").status_code == 401  # the key still guards the rest


def test_a_worker_serves_its_version_without_the_key():
    role = WorkerRole("colocated", build_worker)
    app = build_app(EngineConfig(model_path="unused"), role, api_key="sesame")
    client = TestClient(app)  # NOTE: no lifespan, no engine
    response = client.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": pdserve.__version__}
    assert client.get("/v1/models").status_code == 401
