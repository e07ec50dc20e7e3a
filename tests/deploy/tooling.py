"""External tools the deploy tests run (kubectl, shellcheck, hadolint)."""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(name: str) -> str:
    """Path of an executable; skips the test when it is missing, except on CI (env CI set),
    where a missing tool fails: CI must run every deploy check."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} not found on PATH"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: CI must provide it)")
    pytest.skip(message)
