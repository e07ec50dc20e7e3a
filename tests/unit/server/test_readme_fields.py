"""The README's lists of honoured and refused request fields are the code's: a field added to a
request body or to `UNSUPPORTED` without the README saying so fails here, and so does a
README that names a field the code does not have."""

from __future__ import annotations

import pathlib
import re

import pytest

from pdserve.server.native_api import UNSUPPORTED_SAMPLING_KEYS
from pdserve.server.openai_protocol import (
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
)

README = (pathlib.Path(__file__).resolve().parents[3] / "README.md").read_text()
BOOTSTRAP = {"bootstrap_host", "bootstrap_port", "bootstrap_room"}  # set by the router
ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def readme_list(path: str, verb: str) -> list[str]:
    """The fields the README's sentence "- `path` verb `a`, `b`, ... ." names (in order)."""
    found = re.findall(rf"- `{re.escape(path)}` {verb}([^.]*)\.", README)
    assert len(found) == 1, f"the README has {len(found)} lists of what {path} {verb}"
    names = re.findall(r"`([a-z_]+)`", found[0])
    assert len(names) == len(set(names)), f"{path} {verb}: a field listed twice: {names}"
    return names


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_the_readme_lists_exactly_the_honoured_fields(path):
    honoured = set(ENDPOINTS[path].model_fields) - BOOTSTRAP
    assert set(readme_list(path, "honours")) == honoured


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_the_readme_lists_exactly_the_refused_fields(path):
    assert set(readme_list(path, "refuses")) == set(UNSUPPORTED[ENDPOINTS[path].endpoint])


def test_the_readme_lists_the_refused_sampling_keys_of_generate():
    assert readme_list("/generate", "refuses") == ["sampling_params", *UNSUPPORTED_SAMPLING_KEYS]


def test_no_field_is_both_honoured_and_refused():
    for path, body in ENDPOINTS.items():
        assert not set(body.model_fields) & set(UNSUPPORTED[body.endpoint]), path
